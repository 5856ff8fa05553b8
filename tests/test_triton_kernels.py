"""The Triton kernels (``backend="triton"``) against the fp64 reference.

On a machine without a GPU they run under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``), on small shapes. fp16 and bf16 inputs are compared with the reference
on the same rounded values: logits are formed in fp32 from them, so the loss keeps fp32
accuracy, while gradients come back in the input dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import orda_tp
from orda_tp import KL_VARIANTS
from orda_tp.arguments.plan import LogitFamily, LossPlan
from orda_tp.divergences.expr import equal, exp, greater, log, row, where
from orda_tp.divergences.terms import RAW_STUDENT
from orda_tp.engine.records import merge_stacked_records
from orda_tp.engine.torch_math import TorchBlockMath, evaluate_rows

from .support.cases import (
    COTRAINED,
    TEACHER_MODES,
    call_kwargs,
    loss_and_grads,
    make_problem,
    relative_error,
    separate_problem,
    stable_seed,
)

pytest.importorskip("triton")

CHUNKS = orda_tp.KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=7), vocab_block=96)
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def compare(variant: str, mode: str, reduction: str, dtype: torch.dtype) -> None:
    base = make_problem(rows=14, vocab=203, seed=stable_seed(variant, mode, reduction)).to(dtype)
    if mode == "separate":
        base = separate_problem(base).to(dtype)
    exact = base.to(torch.float64)
    kwargs = call_kwargs(variant, mode, reduction)
    upstream = None
    if reduction == "none":
        upstream = torch.rand(base.labels.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected, expected_grads = loss_and_grads(exact, mode, upstream, backend="reference", **kwargs)
    actual, actual_grads = loss_and_grads(
        base, mode, None if upstream is None else upstream.float(), backend="triton", config=CHUNKS, **kwargs
    )
    for field in ("loss", "student_ce", "teacher_ce", "kl"):
        assert relative_error(getattr(actual, field), getattr(expected, field)) <= 1e-5, field
    for index, (grad, reference) in enumerate(zip(actual_grads, expected_grads)):
        assert (grad is None) == (reference is None), index
        if grad is not None:
            assert grad.dtype == dtype
            assert relative_error(grad, reference) <= GRAD_TOLERANCE[dtype], (index, relative_error(grad, reference))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("mode", TEACHER_MODES)
@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_triton_matches_reference_fp32(variant: str, mode: str, reduction: str) -> None:
    if variant in COTRAINED and mode == "precomputed":
        pytest.skip("co-training variants need a trainable teacher (tested to raise in test_equivalence)")
    compare(variant, mode, reduction, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_triton_low_precision_inputs(variant: str, dtype: torch.dtype) -> None:
    compare(variant, "tied", "mean", dtype)


@pytest.mark.parametrize("mode", TEACHER_MODES)
def test_forward_kl_sums_round_two_in_its_gradient_pass(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With eager gradients, ``forward`` (whose gradient ``p − q`` reads nothing of round 2) on a
    head's logits runs no round-2 pass of its own: the gradient kernel sums it. The loss equals
    the one a call without gradients computes with the round-2 kernel, and the reference's; a
    variant whose gradient reads round 2 (``reverse``) keeps the pass."""
    from orda_tp.engine.triton_math import TritonBlockMath

    passes: list[str] = []
    kl_sums = TritonBlockMath.kl_sums

    def counted(self: TritonBlockMath, plan: LossPlan, *args: Any) -> torch.Tensor:
        assert plan.divergence is not None
        passes.append(plan.divergence.name)
        return kl_sums(self, plan, *args)

    monkeypatch.setattr(TritonBlockMath, "kl_sums", counted)
    problem = make_problem(rows=14, vocab=203, seed=stable_seed("folded", mode)).to(torch.float32)
    if mode == "separate":
        problem = separate_problem(problem).to(torch.float32)
    kwargs = call_kwargs("forward", mode, "mean")
    expected, _ = loss_and_grads(problem.to(torch.float64), mode, backend="reference", **kwargs)
    folded, _ = loss_and_grads(problem, mode, backend="triton", config=CHUNKS, **kwargs)
    assert passes == []
    with torch.no_grad():
        separate = orda_tp.distillation_loss(
            problem.student_hidden, problem.weight, problem.labels, problem.teacher(mode),
            backend="triton", config=CHUNKS, **kwargs,
        )  # fmt: skip
    assert passes == ["forward"] * 2  # one round-2 pass per chunk of 7 rows
    for field in ("loss", "kl"):
        assert relative_error(getattr(folded, field), getattr(expected, field)) <= 1e-5, field
        assert relative_error(getattr(folded, field), getattr(separate, field)) <= 1e-6, field
    loss_and_grads(problem, mode, backend="triton", config=CHUNKS, **call_kwargs("reverse", mode, "mean"))
    assert passes == ["forward"] * 2 + ["reverse"] * 2


def test_triton_padded_vocabulary_and_zero_support() -> None:
    p = make_problem(rows=14, vocab=203, ignored_every=0).to(torch.float32)
    logits = p.teacher_logits.clone()
    logits[2, :40] = float("-inf")
    logits[5] = float("-inf")
    labels = p.labels.clamp(max=189)
    for variant in ("reverse", "renyi", "triangular", "dkd"):
        kwargs = dict(kl_weight=1.0, kl_divergence=variant, reduction="none", vocab_size=190)
        teacher = orda_tp.PrecomputedTeacher(logits=logits)
        out = orda_tp.distillation_loss(
            p.student_hidden, p.weight, labels, teacher, backend="triton", config=CHUNKS, **kwargs
        )
        ref = orda_tp.distillation_loss(p.student_hidden, p.weight, labels, teacher, backend="reference", **kwargs)
        finite = torch.isfinite(ref.kl)
        assert torch.equal(torch.isfinite(out.kl), finite) and torch.equal(
            torch.isposinf(out.kl), torch.isposinf(ref.kl)
        )
        assert relative_error(out.kl[finite], ref.kl[finite]) <= 1e-5
        grads = [torch.autograd.grad(o.loss.sum(), [p.student_hidden, p.weight]) for o in (out, ref)]
        for grad, reference in zip(*grads):
            assert torch.isfinite(grad).all()
            assert relative_error(grad, reference) <= 1e-5


def test_triton_reads_a_teacher_cache_whose_columns_are_strided() -> None:
    """A ``PrecomputedTeacher`` whose logits are a transposed view (column stride ≠ 1): the
    kernels, which assume unit-stride columns, get each block copied and give the reference's
    loss and gradients."""
    p = make_problem(rows=14, vocab=203, ignored_every=5).to(torch.float32)
    strided = p.teacher_logits.T.contiguous().T
    assert strided.stride(1) != 1 and torch.equal(strided, p.teacher_logits)
    kwargs = dict(kl_weight=1.0, teacher_ce_weight=0.3, kl_divergence="forward")
    out = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, orda_tp.PrecomputedTeacher(logits=strided), backend="triton",
        config=CHUNKS, **kwargs,
    )  # fmt: skip
    ref = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, orda_tp.PrecomputedTeacher(logits=p.teacher_logits),
        backend="reference", **kwargs,
    )  # fmt: skip
    assert relative_error(out.loss, ref.loss) <= 1e-5
    grads = [torch.autograd.grad(o.loss, [p.student_hidden, p.weight]) for o in (out, ref)]
    for grad, reference in zip(*grads):
        assert relative_error(grad, reference) <= 1e-5


def test_triton_backend_rejects_fp64() -> None:
    p = make_problem()
    with pytest.raises(ValueError, match="backend='triton' is unavailable on this machine: .*float64"):
        orda_tp.distillation_loss(
            p.student_hidden, p.weight, p.labels, orda_tp.TiedTeacher(p.teacher_hidden), backend="triton"
        )


def test_triton_backend_on_two_gloo_ranks() -> None:
    """The kernels produce the same records as the torch path, so they work on vocabulary shards."""
    from .support import triton_workers
    from .support.distributed import run_distributed

    variants = ["forward", "mutual", "skew_js", "dkd", "abkd", "renyi_reverse"]
    reports = run_distributed(2, triton_workers.triton_tp_worker, variants, timeout=300)
    problems = [problem for report in reports for problem in report]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("factor", [0.375, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_in_place_scaling_kernel(dtype: torch.dtype, factor: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """``x *= scale`` in place, two programs striding over four blocks; a scale of 1 (which the
    kernel skips) leaves ``x`` bitwise as it was."""
    from orda_tp.engine import triton_math
    from orda_tp.engine.triton_math import SCALE_BLOCK, scale_in_place

    monkeypatch.setattr(triton_math, "SCALE_PROGRAMS", 2)
    values = torch.randn(3 * SCALE_BLOCK + 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    matrix = torch.randn(5, 7, generator=torch.Generator().manual_seed(1)).to(dtype)
    values[3], matrix[1, 2] = float("nan"), float("-inf")
    expected = [(t.float() * factor).to(dtype) for t in (values, matrix)]
    scale_in_place([values, matrix], torch.tensor(factor))
    # The interpreter's fp32 -> bf16 conversion may round differently: within one bf16 step there.
    rtol = 2.0**-7 if dtype == torch.bfloat16 and not torch.cuda.is_available() else 0.0
    for actual, wanted in zip((values, matrix), expected):
        torch.testing.assert_close(actual, wanted, rtol=rtol, atol=0.0, equal_nan=True)


# The launches one by one against the torch block math, on blocks wider than one column split
# (300 columns: three splits of 128 under the interpreter, merged by the merge kernel).
FAMILY_SETS = {
    "student": (LogitFamily("student", 1.0),),
    "both": (LogitFamily("student", 2.0), LogitFamily("teacher", 1.5)),
    "four": (
        LogitFamily("teacher", 1.5),
        LogitFamily("student", 0.7),
        LogitFamily("teacher", 1.0),
        LogitFamily("student", 1.0),
    ),
}


def block_logits(rows: int, cols: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student, teacher = (torch.randn(2, rows, cols, generator=generator) * 3).to(dtype)
    student[3, 5:9] = float("-inf")
    teacher[2, :40] = float("-inf")
    teacher[5] = float("-inf")
    return student, teacher


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("families", FAMILY_SETS)
def test_partition_kernel_gives_the_torch_record(families: str, dtype: torch.dtype) -> None:
    from orda_tp.engine.triton_math import TritonBlockMath

    student, teacher = block_logits(21, 300, dtype, stable_seed(families, str(dtype)))
    col_start = 50
    labels = torch.randint(col_start, col_start + 300, (21,), generator=torch.Generator().manual_seed(1))
    labels[::4] = -100
    labels[1], labels[2], labels[3] = col_start - 1, col_start + 300, col_start + 299
    with_teacher = families != "student"
    other = teacher if with_teacher else None
    # The student terms' column sums (label smoothing's Σ s_j), with a second term of our own.
    sums = () if families == "both" else (RAW_STUDENT, exp(RAW_STUDENT * 0.25))
    actual = TritonBlockMath().partition(student, other, labels, col_start, FAMILY_SETS[families], sums)
    expected = TorchBlockMath().partition(
        student.float(), None if other is None else other.float(), labels, col_start, FAMILY_SETS[families], sums
    )
    count = len(FAMILY_SETS[families])
    hits, sums_from = 2 * count + 2, 2 * count + 3
    assert torch.equal(actual[:, hits], expected[:, hits])
    assert actual.shape == (21, sums_from + len(sums))
    torch.testing.assert_close(actual[:, sums_from:], expected[:, sums_from:], rtol=1e-5, atol=1e-4)
    assert torch.equal(actual[:, 2 * count : hits], expected[:, 2 * count : hits])  # s_y, t_y
    # x·(1/T) against x/T, and another order of the sums: a few fp32 roundings apart
    torch.testing.assert_close(actual[:, :count], expected[:, :count], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(actual[:, count : 2 * count], expected[:, count : 2 * count], rtol=1e-5, atol=0.0)


@pytest.mark.parametrize(("num_families", "num_sums"), [(1, 0), (2, 0), (4, 0), (1, 1), (2, 2)])
def test_merge_kernel_gives_the_torch_merge(num_families: int, num_sums: int) -> None:
    from orda_tp.engine.triton_math import TritonBlockMath

    width = 2 * num_families + 3 + num_sums
    stacked = torch.randn(5, 37, width, generator=torch.Generator().manual_seed(num_families))
    stacked[:, 3, :num_families] = float("-inf")  # a row empty in every split
    stacked[1, 8, 0] = float("-inf")  # one empty split
    actual = TritonBlockMath().merge_stacked(stacked, num_families)
    expected = merge_stacked_records(stacked, num_families)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_row_kernel_gives_the_torch_row_formulas() -> None:
    from orda_tp.engine.row_formulas import RowProgram
    from orda_tp.engine.triton_math import TritonBlockMath

    m, z, flag, upstream = row("m"), row("z"), row("flag"), row("upstream")
    lse = where(equal(m, float("-inf")), 0.0, m) + log(z)
    exprs = (lse, where(greater(flag, 0.5), lse * row("t"), float("nan")), upstream * row("t"), flag)
    generator = torch.Generator().manual_seed(0)
    values = {
        "m": torch.randn(2, 300, generator=generator)[1],  # a strided view
        "z": torch.rand(300, generator=generator) + 0.5,
        "flag": torch.rand(300, generator=generator) > 0.3,  # booleans, read as 0/1
        "upstream": torch.tensor(0.75).expand(300),  # stride 0
    }
    values["m"][::7] = float("-inf")
    like = torch.empty(0)
    program = RowProgram(("m", "z", "flag", "upstream"), ("t",), ("lse", "scaled", "upstream_t", "flag"), exprs)
    actual = TritonBlockMath().rows(program, values, {"t": 1.5}, like)
    expected = evaluate_rows(program, values, {"t": 1.5}, like)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0.0, equal_nan=True)  # log: an ulp apart


def test_compiled_tiles_follow_the_block_dtype_and_a_sparse_teacher(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA device a launch reads kernels.tiles: HALF_PRECISION_TILES for student logits in 2
    bytes, else SPARSE_TEACHER_TILES for a top-k cache's rows, else CUDA_TILES; its grid covers
    every row and column with splits a whole number of tiles wide."""
    from orda_tp.engine import triton_math
    from orda_tp.kernels import tiles

    monkeypatch.setattr(triton_math, "INTERPRETED", False)
    wide, narrow = torch.empty(300, 1 << 15), torch.empty(300, 1000)
    assert triton_math._tiles_and_grid("grads", wide)[0] == tiles.CUDA_TILES[("grads", True)]
    assert triton_math._tiles_and_grid("grads", wide, sparse=True)[0] == tiles.SPARSE_TEACHER_TILES[("grads", True)]
    assert (
        triton_math._tiles_and_grid("grads", wide.bfloat16(), sparse=True)[0]
        == tiles.HALF_PRECISION_TILES[("grads", True)]
    )
    assert triton_math._tiles_and_grid("grads", narrow, sparse=True)[0] == tiles.CUDA_TILES[("grads", False)]
    assert triton_math._tiles_and_grid("partition", wide, sparse=True)[0] == tiles.CUDA_TILES[("partition", True)]
    for block in (wide, narrow):
        chosen, (row_tiles, splits), per_split = triton_math._tiles_and_grid("grads", block, sparse=True)
        rows, cols = block.shape
        assert (row_tiles - 1) * chosen.block_r < rows <= row_tiles * chosen.block_r
        assert per_split % chosen.block_c == 0 and (splits - 1) * per_split < cols <= splits * per_split
