"""orda_tp.integrations.trl with LM heads held as DTensors, on real gloo groups of 2 and 3 ranks,
against TRL 1.16's ``_chunked_divergence_loss`` on the full tensors in one process (fp32, 1e-5).
The workers are in tests/support/trl_shard_workers.py.

- Vocabulary-parallel heads (``Shard(0)`` weights and biases on a tp mesh, uneven over 2 and 3
  ranks): the loss, entropy sum, count and every gradient are TRL's, for β ∈ {0, 0.5, 1},
  T ∈ {1, 2}, logit scales, soft-caps and biases; no head is gathered.
- FSDP2: the head in the root's unit or in one unit with the final norm (accelerate 1.15's wrap:
  the one-device path), or its own unit (the rows-gathered path: FSDP2 never gathers it, nor
  reduces its gradient), the teacher's head whole or FSDP-sharded, ranks with different lengths, a
  rank without completion tokens, an empty vocabulary shard, ranks' different upstream gradients:
  each rank's loss, entropy sum, count and hidden-state gradient are its own batch's, and the
  gradients on the shards FSDP2's mean over the ranks (a sum where the head's unit divides by 1);
  also without gradients.
- TRL's own function on the FSDP-sharded head gathers it and leaves each shard its own rank's
  gradient rows (what the adapter does differently).
- Heads sharded in ways that do not fit, and one rank's rows that do not fit, raise on every rank.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from .support import trl_shard_workers  # noqa: E402
from .test_tensor_parallel import run_and_check  # noqa: E402

TIMEOUT_S = 240.0


@pytest.mark.parametrize("world_size", [2, 3])
def test_vocabulary_parallel_heads_equal_trl(world_size: int) -> None:
    run_and_check(world_size, trl_shard_workers.tp_worker, timeout=TIMEOUT_S)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_heads_equal_one_process(world_size: int) -> None:
    run_and_check(world_size, trl_shard_workers.fsdp_worker, timeout=TIMEOUT_S)


def test_trl_gathers_an_fsdp2_sharded_head_and_leaves_each_rank_its_own_gradient() -> None:
    run_and_check(2, trl_shard_workers.trl_fsdp_worker, timeout=TIMEOUT_S)


def test_heads_that_do_not_fit_raise_on_every_rank() -> None:
    run_and_check(3, trl_shard_workers.errors_worker, timeout=TIMEOUT_S)
