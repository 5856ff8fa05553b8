"""The loss inside FSDP2 and DTensor tensor-parallel models, on real gloo groups.

Each case is right (fp64 loss and gradients within 1e-12 of the single-process result; gradients
averaged over data parallelism as FSDP averages them) or raises a ValueError on every rank. The
workers are in tests/support/stack_workers.py.
"""

from __future__ import annotations

from .support import stack_workers
from .support.distributed import run_distributed
from .test_tensor_parallel import run_and_check

TIMEOUT_S = 240.0


def test_fsdp_data_parallel_head_unit_root_unit_and_distillation_head() -> None:
    """1-D mesh: a head weight read outside its FSDP unit's forward raises (same or different labels,
    root resharded or not); read inside the forward that gathers it, and through DistillationHead
    under every wrapping, the loss and gradients are the single-process ones."""
    run_and_check(2, stack_workers.fsdp_1d_worker, timeout=TIMEOUT_S)


def test_fsdp_with_vocabulary_parallel_head_on_2d_mesh() -> None:
    """(dp, tp) mesh: DistillationHead under VocabParallel and under torch's ColwiseParallel, with
    FSDP over dp, as its own unit or in the root's."""
    run_and_check(4, stack_workers.fsdp_tp_worker, timeout=TIMEOUT_S)


def test_full_head_on_every_rank_raises() -> None:
    run_and_check(2, stack_workers.full_head_worker)


def test_frozen_fsdp_teacher_head() -> None:
    run_and_check(2, stack_workers.teacher_head_worker)


def test_frozen_fsdp_teacher_head_in_a_mixture() -> None:
    run_and_check(2, stack_workers.mixture_teacher_head_worker)


def test_fsdp_state_lookup_still_reads_torch_internals() -> None:
    """orda_tp.parallel.fsdp reads FSDP2's per-module state; if torch renames it, this fails
    loudly instead of letting a sharded weight through."""
    assert run_distributed(2, stack_workers.fsdp_lookup_worker) == [True, True]


def test_vocab_parallel_style_without_fsdp() -> None:
    """parallelize_module(head, tp_mesh, VocabParallel(...)): logits and loss against one process."""
    run_and_check(2, stack_workers.vocab_parallel_worker)
