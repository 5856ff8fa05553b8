"""orda_tp.integrations.trl with LM heads held as DTensors, on real gloo groups of 2 and 3 ranks,
against TRL 1.16's loss on the full tensors in one process (workers: tests/support/trl_shard_workers.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from .support import trl_shard_workers  # noqa: E402
from .test_tensor_parallel import run_and_check  # noqa: E402

TIMEOUT_S = 240.0


@pytest.mark.parametrize("world_size", [2, 3])
def test_trl_gathers_an_fsdp_sharded_head_and_leaves_each_rank_its_own_gradient(world_size: int) -> None:
    run_and_check(world_size, trl_shard_workers.trl_fsdp_worker, timeout=TIMEOUT_S)
