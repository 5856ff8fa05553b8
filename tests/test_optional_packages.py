"""``import orda_tp`` needs torch alone: the optional extras (safetensors for the top-k cache files,
megatron-core and trl for their integrations, triton for the kernels) are imported where they are named, and
then a missing one raises with its install line; so do the examples that need transformers or
megatron-core."""

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


def test_the_megatron_integration_names_its_extra_where_megatron_core_is_missing() -> None:
    for module in ("orda_tp.integrations.megatron", "orda_tp.integrations.megatron_head"):
        run = _without("megatron", f"import {module}")
        assert run.returncode != 0
        assert "orda_tp.integrations.megatron needs megatron-core: pip install 'orda_tp[megatron]'" in run.stderr


def test_the_trl_loss_needs_no_trl_and_its_trainer_names_the_extra() -> None:
    run = _without("trl", "from orda_tp.integrations.trl import chunked_divergence_loss; print('imported')")
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr
    line = "the TRL trainer of orda_tp.integrations.trl needs trl: pip install 'orda_tp[trl]'"
    for code in (
        "from orda_tp.integrations.trl import OrdaDistillationTrainer",
        "import orda_tp.integrations.trl as t\nwith t.orda_divergence_loss(): pass",
    ):
        run = _without("trl", code)
        assert run.returncode != 0 and line in run.stderr, run.stderr


def test_printing_a_kernel_names_its_extra_where_triton_is_missing() -> None:
    run = _without("triton", "import orda_tp.kernels; orda_tp.kernels.print_kernel('grads', kl_divergence='reverse')")
    assert run.returncode != 0
    assert "printing a kernel needs triton: pip install 'orda_tp[gpu]'" in run.stderr
    command = "import runpy, sys; sys.argv[1:] = ['grads']; runpy.run_module('orda_tp.kernels', run_name='__main__')"
    run = _without("triton", command)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip() == (
        "python -m orda_tp.kernels: printing a kernel needs triton: pip install 'orda_tp[gpu]'"
    )


def test_the_examples_name_their_packages_where_missing() -> None:
    for package, example, line in [
        ("transformers", "hf_trainer_distill.py", "pip install 'transformers==5.24.0' 'accelerate==1.15.0'"),
        ("megatron", "megatron_distill.py", "pip install 'orda_tp[megatron]'"),
        ("transformers", "offline_topk_distill.py", "pip install 'transformers==5.24.0'"),
        ("transformers", "mixture_distill.py", "pip install 'transformers==5.24.0'"),
    ]:
        run = _without(package, f"import runpy; runpy.run_path('examples/{example}', run_name='__main__')")
        assert run.returncode != 0
        assert f"examples/{example} needs " in run.stderr and line in run.stderr, run.stderr
