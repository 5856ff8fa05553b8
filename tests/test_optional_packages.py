"""``import orda_tp`` needs torch alone: the optional extras (safetensors for the top-k cache files,
megatron-core for its integration) are imported where they are named, and then a missing one
raises with its install line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _without(package: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where ``import package`` fails, as where it is not installed."""
    blocked = f"import sys; sys.modules[{package!r}] = None\n"
    return subprocess.run([sys.executable, "-c", blocked + code], capture_output=True, text=True, cwd=ROOT)


def test_import_orda_tp_needs_no_safetensors() -> None:
    run = _without(
        "safetensors",
        "import orda_tp, torch; h = torch.randn(3, 4); print(orda_tp.teacher_topk(h, torch.randn(9, 4), 2).ids.shape)",
    )
    assert run.returncode == 0, run.stderr
    assert "torch.Size([3, 2])" in run.stdout


def test_the_cache_files_name_their_extra_where_safetensors_is_missing() -> None:
    run = _without("safetensors", "from orda_tp.topk_cache import TopKCacheWriter")
    assert run.returncode != 0
    assert "orda_tp.topk_cache needs safetensors: pip install 'orda_tp[cache]'" in run.stderr
