"""The tensor-parallel contract (docs/guide.md §12.7) on real gloo process groups (2–4 ranks,
tests/support/distributed.py).

Every tensor-parallel call is compared, in the same process, with the single-device call on the
full tensors: loss and components bitwise identical on every rank and equal to the single-device
values (fp64 ≤ 1e-12, fp32 ≤ 1e-6 relative); each rank's head gradients equal its slice of the
single-device gradients; hidden gradients equal the full ones (or this rank's rows under sequence
parallelism). The workers are in tests/support/tp_workers.py; each spawn runs many cases and
reports every mismatch at once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest

from orda_tp.parallel.layout import ShardClaim

from .support import tp_workers
from .support.distributed import run_distributed

# The full matrix runs 270 cases per spawn; generous bounds, CI runs other tests alongside.
MATRIX_TIMEOUT_S = 300.0
CASES_TIMEOUT_S = 180.0
ERROR_TIMEOUT_S = 60.0
# An error scenario takes well under a second; a rank left waiting in a collective would take the
# collective timeout (ERROR_TIMEOUT_S / 2) and fail.
ERROR_SECONDS = 10.0


def run_and_check(
    world_size: int, worker: Callable[..., list[str]], *args: Any, timeout: float = CASES_TIMEOUT_S
) -> None:
    """Run ``worker`` on ``world_size`` ranks and fail with every rank's mismatches."""
    results = run_distributed(world_size, worker, *args, timeout=timeout)
    problems = [f"rank {rank}: {problem}" for rank, found in enumerate(results) for problem in found]
    shown = "\n".join(problems[:80]) + (f"\n... and {len(problems) - 80} more" if len(problems) > 80 else "")
    assert not problems, f"{len(problems)} mismatches:\n{shown}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_variant_mode_reduction_and_dtype(world_size: int) -> None:
    """15 variants × 3 teacher modes × 3 reductions × fp64/fp32 on torch.chunk shards of V=203
    (uneven on 2, 3 and 4 ranks), 4 row chunks per call, ignored rows, T_s ≠ T_t; co-trained
    variants with a cached teacher raise on every rank."""
    run_and_check(world_size, tp_workers.matrix_worker, timeout=MATRIX_TIMEOUT_S)


def test_uneven_shards_v1001_over_4() -> None:
    """V=1001 over 4 ranks in torch.chunk order (251, 251, 251, 248) with the default vocab_range."""
    run_and_check(4, tp_workers.uneven_worker)


def test_explicit_vocab_range_out_of_rank_order() -> None:
    """vocab_range blocks of sizes 37, 23, 90, 53 where rank 0 holds the last block."""
    run_and_check(4, tp_workers.permuted_worker)


def test_vocab_padding_across_ranks() -> None:
    """vocab_size below the head's rows with padding on two ranks (one of them only padding),
    in torch.chunk order and in a permuted explicit partition; against the call on the real
    columns and against the padded single-device head with vocab_size; with gradient buffers that
    come filled with NaN, so that a padding row the walk leaves unzeroed fails."""
    run_and_check(4, tp_workers.padded_worker)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel(world_size: int) -> None:
    """sequence_parallel=True: hidden (student and teacher) rows sharded, labels full, hidden
    gradients come back as this rank's rows."""
    run_and_check(world_size, tp_workers.sequence_parallel_worker)


def test_module_form() -> None:
    """DistillationLoss(tp_group=..., vocab_size=..., sequence_parallel=...)."""
    run_and_check(2, tp_workers.module_worker)


def test_calls_with_few_or_no_statistics() -> None:
    """Every row ignored; CE only, with the student entropy or the entropy alone; KL only;
    num_valid_tokens as a number and as a tensor."""
    run_and_check(3, tp_workers.edge_worker)


def test_layout_change_on_some_ranks_only() -> None:
    """A later call whose shard sizes change on ranks 1 and 2 but not on rank 0 (whose own
    shapes repeat a cached layout) is still exact, and so is going back."""
    run_and_check(3, tp_workers.layout_change_worker)


def test_dtensor_weight_on_1d_mesh() -> None:
    """Weight Shard(0) DTensor (group and vocab_range inferred); hidden plain, Replicate or
    Shard(0) (sequence parallel); cached logits plain shards or Shard(-1); gradients of DTensor
    inputs are DTensors with the inputs' placements."""
    run_and_check(2, tp_workers.dtensor_1d_worker)


def test_dtensor_weight_on_2d_mesh() -> None:
    """A (dp=2, tp=2) mesh with heads [Replicate(), Shard(0)]: each dp group is its own
    tensor-parallel problem; also sequence parallel through [Replicate(), Shard(0)] hidden."""
    run_and_check(4, tp_workers.dtensor_2d_worker)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_collectives_per_call(world_size: int) -> None:
    """Per call: the handshake's two fixed-size gathers, at most one collective per statistics round (two per
    row chunk), the hidden gradients' sums (one all-reduce per hidden gradient and row group, each
    started as soon as its rows are complete; one reduce-scatter under sequence parallelism, which
    also gathers the rows once); every call alike (nothing is cached across calls); a no-grad call
    has no gradient collective. The same counts at TP = 2, 4 and 8: the number of collectives does
    not grow with the group (their size does, docs/architecture.md §4.3)."""
    reports = run_distributed(world_size, tp_workers.counting_worker, timeout=MATRIX_TIMEOUT_S)
    failures = []
    for rank, report in enumerate(reports):
        for name, info in report.items():
            calls = [len(c) for c in info["calls"]]
            first, second, third, no_grad = calls
            gather = 1 if info["sequence_parallel"] else 0
            gradient_sums = 1 if info["sequence_parallel"] else info["row_groups"] * info["hidden_grads"]
            bound = 2 + 2 * info["row_chunks"] + gradient_sums + gather
            kinds = dict(Counter(info["calls"][1]))
            detail = (
                f"rank {rank} {name}: {first}/{second}/{third}/{no_grad} collectives in the first/second/"
                f"third/no-grad call (second: {kinds}), {info['row_chunks']} row chunks"
            )
            if second > bound:
                failures.append(f"{detail}: {second} collectives > {bound}")
            if not first == second == third:
                failures.append(f"{detail}: calls differ in their collectives")
            if no_grad > bound - gradient_sums:
                failures.append(f"{detail}: no-grad call made {no_grad} > {bound - gradient_sums}")
            if kinds.get("all_reduce", 0) > gradient_sums:
                failures.append(f"{detail}: more than {gradient_sums} all-reduces (the hidden gradient's sums)")
    assert not failures, "\n".join(failures)


def test_host_reads_of_a_call() -> None:
    """With host checks off (a CUDA call's default), a call reads on the host only the ranks'
    claims, host values gathered over a host group (2 ranks × the claim's fields; the labels' checksums and
    the heads' fingerprints stay on the device). A teacher read through a head has no local value
    check, so its first record exchange carries no error columns; a cached teacher's exchange
    carries them, and they are read once more (2 ranks × 3)."""
    reports = run_distributed(2, tp_workers.host_reads_worker, timeout=MATRIX_TIMEOUT_S)
    claims, errors = ("tolist", (2, len(fields(ShardClaim)))), ("tolist", (2, 3))
    for report in reports:
        assert report == {"tied": [claims], "separate": [claims], "precomputed": [claims, errors]}, report


def test_without_host_checks_bad_labels_or_a_full_head_make_every_rank_nan() -> None:
    """Host checks off (a CUDA call's default): the handshake's checks run on the device. Labels
    that differ on one rank, or the same full head on every rank, give a NaN loss and NaN
    gradients on every rank (with host checks they raise, test_error_on_one_rank_raises_everywhere);
    good inputs equal the single-device loss."""
    reports = run_distributed(2, tp_workers.device_checks_worker, timeout=MATRIX_TIMEOUT_S)
    for report in reports:
        loss, all_nan, error = report["good"]
        assert math.isfinite(loss) and not all_nan and error <= 1e-12, report
        for name in ("labels differ", "full head on every rank"):
            loss, all_nan, _ = report[name]
            assert math.isnan(loss) and all_nan, (name, report)


def test_gloo_twin_gathers_host_values() -> None:
    """The group that carries the handshake's host values beside an NCCL group (exercised here on
    gloo): the same ranks, made once, gathering in rank order."""
    reports = run_distributed(2, tp_workers.gloo_twin_worker, timeout=MATRIX_TIMEOUT_S)
    for ranks, cached, gathered in reports:
        assert ranks == [0, 1] and cached and gathered == [[[0, 0]], [[1, 10]]]


@pytest.mark.parametrize("scenario", list(tp_workers.ERROR_SCENARIOS))
def test_error_on_one_rank_raises_everywhere(scenario: str) -> None:
    """An invalid input on one rank only: every rank raises the same ValueError, and none waits
    (well under the collective timeout)."""
    outcomes = run_distributed(tp_workers.ERROR_WORLD, tp_workers.error_worker, scenario, timeout=ERROR_TIMEOUT_S)
    listing = "\n".join(
        f"rank {rank}: {kind or 'no error'} after {seconds:.1f} s: {message}"
        for rank, (kind, message, seconds) in enumerate(outcomes)
    )
    assert all(kind == "ValueError" for kind, _, _ in outcomes), listing
    assert len({message for _, message, _ in outcomes}) == 1, f"different messages:\n{listing}"
    assert max(seconds for _, _, seconds in outcomes) < ERROR_SECONDS, listing
