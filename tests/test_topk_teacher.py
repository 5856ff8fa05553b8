"""Top-k teacher caches: ``PrecomputedTeacher(topk_ids=..., topk_logprobs=..., tail=...)``.

Every precomputed-capable variant (13: all but the co-training ones) on a top-k cache equals the
same loss on the dense teacher it stands for (tests/support/topk_cases.py, built from the definition):
fp64 ≤ 1e-9 for values and gradients on the torch and reference backends, with ``tail="uniform"``
(the missing mass spread over the other real columns) and ``tail="renormalize"`` (the softmax of
the cached values; the variants that are +inf where the teacher has no mass raise), T_s ≠ T_t,
the teacher CE, a padded vocabulary, every reduction; the Triton kernels (interpreted) in fp32;
TP = 2 and 3 on gloo equal to TP = 1; bad caches raise naming the argument.
"""

from __future__ import annotations

import pytest
import torch

import orda_tp
from orda_tp import KL_VARIANTS

from .support.cases import COTRAINED, SMALL_CHUNKS, VARIANT_KWARGS, make_problem, relative_error, stable_seed
from .support.topk_cases import dense_teacher, topk_of

CACHE_VARIANTS = [variant for variant in KL_VARIANTS if variant not in COTRAINED]
INFINITE_WITHOUT_SUPPORT = ("reverse", "jeffreys", "entropy_adaptive")
VOCAB, K = 203, 11


def compare(
    variant: str, tail: str, reduction: str, backend: str, dtype: torch.dtype, vocab_size: int | None, tolerance: float,
    vocab: int = VOCAB, k: int = K,
) -> None:  # fmt: skip
    problem = make_problem(rows=16, vocab=vocab, seed=stable_seed(variant, tail, reduction)).to(dtype)
    if vocab_size is not None:
        problem.labels[problem.labels >= vocab_size] -= vocab - vocab_size
    ids, logprobs = topk_of(problem.teacher_logits, k, vocab_size)
    kwargs: dict[str, object] = dict(
        kl_weight=1.3, kl_divergence=variant, kl_temperature=2.0, kl_teacher_temperature=1.5,
        teacher_ce_weight=0.4 if tail == "uniform" else 0.0, label_smoothing=0.1, reduction=reduction,
        vocab_size=vocab_size, **VARIANT_KWARGS[variant],
    )  # fmt: skip
    cache = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail=tail, retemper=True)
    config = None if backend == "reference" else SMALL_CHUNKS
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, cache, backend=backend, config=config, **kwargs
    )
    exact = problem.to(torch.float64)
    dense = orda_tp.PrecomputedTeacher(logits=dense_teacher(ids, logprobs, tail, vocab, vocab_size))
    expected = orda_tp.distillation_loss(
        exact.student_hidden, exact.weight, exact.labels, dense, backend="reference", **kwargs
    )
    for name, value, want in zip(expected._fields, out, expected):
        assert relative_error(value, want) <= tolerance, (name, relative_error(value, want))
    upstream = torch.rand(out.loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out.loss, [problem.student_hidden, problem.weight], upstream.to(out.loss.dtype))
    wanted = torch.autograd.grad(expected.loss, [exact.student_hidden, exact.weight], upstream)
    for grad, want in zip(grads, wanted):
        assert relative_error(grad, want) <= tolerance * 10, relative_error(grad, want)


@pytest.mark.parametrize("tail", ["uniform", "renormalize"])
@pytest.mark.parametrize("variant", CACHE_VARIANTS)
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_topk_cache_equals_its_dense_teacher(backend: str, variant: str, tail: str) -> None:
    if tail == "renormalize" and variant in INFINITE_WITHOUT_SUPPORT:
        pytest.skip("raises: test_renormalized_cache_refuses_variants_infinite_without_support")
    reduction = ("mean", "sum", "none")[stable_seed(variant) % 3]
    compare(variant, tail, reduction, backend, torch.float64, VOCAB - 13 if tail == "uniform" else None, 1e-9)


@pytest.mark.parametrize(
    ("variant", "tail", "reduction"),
    [("forward", "uniform", "mean"), ("skew_js", "renormalize", "none"), ("renyi", "uniform", "sum"),
     ("dkd", "renormalize", "mean"), ("triangular", "uniform", "none")],
)  # fmt: skip
def test_triton_topk_cache_equals_its_dense_teacher(variant: str, tail: str, reduction: str) -> None:
    pytest.importorskip("triton")
    compare(variant, tail, reduction, "triton", torch.float32, VOCAB - 13, 2e-5)


def test_triton_reads_caches_of_many_ids() -> None:
    """k = 260: rows whose ids fill most of a tile, searched in several steps."""
    pytest.importorskip("triton")
    compare("forward", "uniform", "mean", "triton", torch.float32, 300, 2e-5, vocab=310, k=260)


@pytest.mark.parametrize("variant", INFINITE_WITHOUT_SUPPORT)
def test_renormalized_cache_refuses_variants_infinite_without_support(variant: str) -> None:
    problem = make_problem(rows=4, vocab=VOCAB, seed=3)
    ids, logprobs = topk_of(problem.teacher_logits, K)
    cache = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail="renormalize")
    with pytest.raises(ValueError, match=f"kl_divergence='{variant}' is \\+inf on every row .* tail='uniform'"):
        orda_tp.distillation_loss(
            problem.student_hidden, problem.weight, problem.labels, cache, kl_weight=1.0, kl_divergence=variant,
            **VARIANT_KWARGS[variant],  # type: ignore[arg-type]
        )  # fmt: skip
    # The same cache with another tail, or without a KL term, is fine.
    uniform = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, retemper=True)
    out = orda_tp.distillation_loss(problem.student_hidden, problem.weight, problem.labels, uniform, kl_weight=1.0)
    assert torch.isfinite(out.loss)


def test_a_renormalized_cache_refuses_renyi_reverse_of_order_above_one() -> None:
    """``D_r(p‖q)`` reads ``q^{1−r}``: +inf where q = 0 < p once r > 1, finite below."""
    problem = make_problem(rows=4, vocab=VOCAB, seed=3)
    ids, logprobs = topk_of(problem.teacher_logits, K)
    cache = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail="renormalize")
    call = {"kl_weight": 1.0, "kl_divergence": "renyi_reverse"}
    with pytest.raises(ValueError, match="kl_divergence='renyi_reverse' is \\+inf on every row .* tail='uniform'"):
        orda_tp.distillation_loss(problem.student_hidden, problem.weight, problem.labels, cache, **call, kl_alpha=1.5)
    out = orda_tp.distillation_loss(problem.student_hidden, problem.weight, problem.labels, cache, **call, kl_alpha=0.6)
    assert torch.isfinite(out.loss)


def test_the_cache_is_read_in_chunks_never_densified() -> None:
    """The walk asks the cache for one chunk's rows at a time (7 here), never for all 16."""
    from orda_tp.teachers.topk import TopKBlocks

    problem = make_problem(rows=16, vocab=VOCAB, seed=4)
    ids, logprobs = topk_of(problem.teacher_logits, K)
    cache = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, retemper=True)
    seen: list[tuple[int, int]] = []
    original = TopKBlocks.block

    def recording(self: TopKBlocks, begin: int, end: int, *args: object) -> torch.Tensor:
        seen.append((begin, end))
        return original(self, begin, end, *args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TopKBlocks, "block", recording)
        out = orda_tp.distillation_loss(
            problem.student_hidden, problem.weight, problem.labels, cache, kl_weight=1.0, config=SMALL_CHUNKS
        )
        out.loss.backward()
    assert seen and max(end - begin for begin, end in seen) <= 7


def test_the_sparse_block_reads_as_the_dense_block() -> None:
    """What the Triton kernels read (each row's ids ascending with their values, and ``τ``)
    stands for the formed block: on a shard's block whose columns hold only some of the ids, the
    listed values at their columns and ``τ`` elsewhere equal it entry for entry."""
    from orda_tp.teachers.source import SparseLogits

    vocab, rows, k, vocab_start, start, stop = 1000, 5, 11, 200, 150, 550
    logits = torch.randn(rows, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    ids, logprobs = topk_of(logits, k)
    cache = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, retemper=True)
    blocks = cache.block_source(vocab_start=vocab_start, vocab_size=vocab)
    assert blocks is not None
    dense = blocks.block(1, 4, start, stop, torch.float64, as_stored=False)
    sparse = blocks.block(1, 4, start, stop, torch.float64, as_stored=True)
    assert isinstance(sparse, SparseLogits) and sparse.ids.shape == (3, k)
    assert bool((sparse.ids[:, 1:] > sparse.ids[:, :-1]).all())
    read = sparse.fill[:, None].expand(3, stop - start).clone()
    first = vocab_start + start
    inside = (sparse.ids >= first) & (sparse.ids < vocab_start + stop)
    assert 0 < int(inside.sum()) < 3 * k
    for row, column in inside.nonzero().tolist():
        read[row, int(sparse.ids[row, column]) - first] = sparse.values[row, column]
    assert torch.equal(read, dense)
    expected = dense_teacher(ids, logprobs, "uniform", vocab, None)[1:4, first : vocab_start + stop]
    torch.testing.assert_close(dense, expected, rtol=1e-12, atol=0.0)


def _cache_error(message: str, edit: object, *, vocab_size: int | None = None, **fields: object) -> None:
    problem = make_problem(rows=6, vocab=VOCAB, seed=2)
    if vocab_size is not None:
        problem.labels[problem.labels >= vocab_size] = 0
    ids, logprobs = topk_of(problem.teacher_logits, 4, vocab_size)
    ids, logprobs = ids.clone(), logprobs.clone()
    assert callable(edit)
    edit(ids, logprobs)
    with pytest.raises(ValueError, match=message):
        cache = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, **fields)  # type: ignore[arg-type]
        orda_tp.distillation_loss(
            problem.student_hidden, problem.weight, problem.labels, cache, kl_weight=1.0, vocab_size=vocab_size
        )


def _set(index: tuple[int, int], *, id_value: int | None = None, logprob: float | None = None) -> object:
    def edit(ids: torch.Tensor, logprobs: torch.Tensor) -> None:
        if id_value is not None:
            ids[index] = id_value
        if logprob is not None:
            logprobs[index] = logprob

    return edit


@pytest.mark.parametrize(
    ("message", "edit", "vocab_size"),
    [
        (r"topk_ids must lie in \[0, 203\) .*topk_ids\[2, 1\] = 203", _set((2, 1), id_value=203), None),
        (r"topk_ids must lie in \[0, 203\) .*topk_ids\[0, 3\] = -1", _set((0, 3), id_value=-1), None),
        (r"topk_ids must lie in \[0, 150\) \(the real vocabulary\)", _set((1, 0), id_value=160), 150),
        ("topk_ids must be distinct in each row; row 4 holds id", None, None),
        (r"topk_logprobs must be log-probabilities .*topk_logprobs\[3, 2\] = 0.5", _set((3, 2), logprob=0.5), None),
        (r"topk_logprobs must be log-probabilities .*= nan", _set((5, 0), logprob=float("nan")), None),
        (r"at most the whole mass of each row .*row 1 sums to", _set((1, 1), logprob=-0.01), None),
    ],
)
def test_bad_cache_values_raise_naming_the_argument(message: str, edit: object, vocab_size: int | None) -> None:
    if edit is None:  # a duplicated id

        def edit(ids: torch.Tensor, logprobs: torch.Tensor) -> None:
            ids[4, 2] = ids[4, 0]

    if vocab_size is not None:  # ids past vocab_size are padding columns
        _cache_error(message, edit, vocab_size=vocab_size)
        return
    _cache_error(message, edit)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"topk_ids": torch.zeros(6, 4, dtype=torch.int32)}, TypeError, "topk_ids must be a 2-D int64 tensor"),
        ({"topk_logprobs": torch.zeros(6, 3)}, ValueError, "topk_logprobs must have topk_ids' shape and device"),
        ({"tail": "zero"}, ValueError, r"tail must be one of \('uniform', 'renormalize'\), got 'zero'"),
        ({"topk_logprobs": None}, ValueError, "needs topk_ids and topk_logprobs together"),
        ({"logits": torch.zeros(6, 203)}, ValueError, "needs exactly one of .* got more than one"),
        ({"topk_logprobs": torch.zeros(6, 4, requires_grad=True)}, ValueError, "topk_logprobs must not require grad"),
    ],
)
def test_bad_cache_fields_raise_at_construction(fields: dict[str, object], error: type, message: str) -> None:
    given: dict[str, object] = {"topk_ids": torch.zeros(6, 4, dtype=torch.long), "topk_logprobs": torch.zeros(6, 4)}
    with pytest.raises(error, match=message):
        orda_tp.PrecomputedTeacher(**{**given, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("variant", "tail", "backend"),
    [("forward", "uniform", "torch"), ("reverse", "uniform", "torch"), ("skew_js", "renormalize", "torch"),
     ("dkd", "renormalize", "torch"), ("forward", "uniform", "triton"), ("abkd", "renormalize", "triton")],
)  # fmt: skip
def test_kdloss_takes_a_topk_cache_in_place_of_teacher_logits(variant: str, tail: str, backend: str) -> None:
    """``KDLoss(...)(student_logits, PrecomputedTeacher(topk_ids=..., ...), labels)`` equals KDLoss on
    the dense teacher logits the cache stands for (values and the student logits' gradient)."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype, tolerance = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-9)
    generator = torch.Generator().manual_seed(stable_seed(variant, tail))
    student = torch.randn(2, 7, VOCAB, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    teacher_logits = torch.randn(2, 7, VOCAB, generator=generator, dtype=torch.float64) * 2
    labels = torch.randint(0, VOCAB, (2, 7), generator=generator)
    labels[0, ::3] = -100
    ids, logprobs = topk_of(teacher_logits.reshape(-1, VOCAB), K)
    cache = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs.to(dtype), tail=tail, retemper=True)
    keywords = dict(temperature=1.5, kl_divergence=variant, chunk_size=5, backend=backend, **VARIANT_KWARGS[variant])
    loss = orda_tp.KDLoss(**keywords)(student, cache, labels)  # type: ignore[arg-type]
    (grad,) = torch.autograd.grad(loss, student)
    exact = student.detach().double().requires_grad_()
    dense = dense_teacher(ids, logprobs.to(dtype), tail, VOCAB).reshape(2, 7, VOCAB)
    expected = orda_tp.KDLoss(**{**keywords, "backend": "torch"})(exact, dense, labels)  # type: ignore[arg-type]
    (want,) = torch.autograd.grad(expected, exact)
    assert relative_error(loss, expected) <= tolerance
    assert relative_error(grad, want) <= tolerance * 10


def test_kdloss_refuses_other_caches_and_infinite_variants() -> None:
    student = torch.randn(6, VOCAB, dtype=torch.float64)
    labels = torch.zeros(6, dtype=torch.long)
    logits_cache = orda_tp.PrecomputedTeacher(logits=torch.randn(6, VOCAB, dtype=torch.float64))
    with pytest.raises(TypeError, match="KDLoss takes teacher_logits as a tensor or as PrecomputedTeacher"):
        orda_tp.KDLoss()(student, logits_cache, labels)  # type: ignore[arg-type]
    ids, logprobs = topk_of(torch.randn(6, VOCAB, dtype=torch.float64), K)
    renormalized = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail="renormalize")
    with pytest.raises(ValueError, match="kl_divergence='reverse' is \\+inf on every row"):
        orda_tp.KDLoss(kl_divergence="reverse")(student, renormalized, labels)
    short = orda_tp.PrecomputedTeacher(topk_ids=ids[:4], topk_logprobs=logprobs[:4])
    with pytest.raises(ValueError, match=r"topk_ids must have one row per label \(6\), got \(4, 11\)"):
        orda_tp.KDLoss()(student, short, labels)


@pytest.mark.parametrize("world_size", [2, 3])
def test_topk_cache_under_tensor_parallelism(world_size: int) -> None:
    from .support import topk_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, topk_workers.topk_worker, timeout=300)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])
