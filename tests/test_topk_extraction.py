"""``orda_tp.teacher_topk`` and ``teacher_topk_of_logits`` against the fp64 oracle
(tests/support/topk_extraction_cases.py): ids identical (ties: lowest id first), values and log-partitions
≤ 1e-12 in fp64 on the reference and torch backends, fp32 rounding on the Triton kernel (run by
Triton's interpreter without a GPU); the extracted cache with ``k = V`` read as the dense teacher;
bad input raising; 2 and 3 gloo ranks with uneven and padded shards (tests/support/topk_extraction_workers.py).
"""

from __future__ import annotations

import pytest
import torch

import orda_tp
from orda_tp.engine.logits import logits_mm

from .support.topk_extraction_cases import oracle_topk, topk_problems

SMALL_CHUNKS = orda_tp.KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=5), vocab_block=64)
#: The Triton kernel keeps fp32 statistics: its values are the fp32 logits' within fp32 rounding.
TRITON_TOLERANCE = 2e-5


def teacher(rows: int = 13, hidden: int = 16, vocab: int = 203, seed: int = 0, dtype: torch.dtype = torch.float64):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    w = 3 * torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) / hidden**0.5
    return h.to(dtype), w.to(dtype)


OPTIONS = [
    {},
    {"temperature": 2.5},
    {"logit_softcap": 4.0},
    {"temperature": 0.7, "logit_softcap": 6.0, "vocab_size": 190},
]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("k", [1, 7, 64])
def test_fp64_extraction_equals_the_oracle(backend: str, options: dict, k: int) -> None:
    h, w = teacher()
    want = oracle_topk(h @ w.T, k, **options)
    got = orda_tp.teacher_topk(h, w, k, backend=backend, config=SMALL_CHUNKS, **options)
    assert got.logprobs.dtype == torch.float64
    assert not topk_problems("hidden", got, want, 1e-12)
    from_logits = orda_tp.teacher_topk_of_logits(h @ w.T, k, backend=backend, config=SMALL_CHUNKS, **options)
    assert not topk_problems("logits", from_logits, want, 1e-12)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("k", [1, 9, 64, 256])
def test_triton_kernel_equals_the_oracle_on_its_fp32_logits(options: dict, k: int) -> None:
    pytest.importorskip("triton")
    h, w = teacher(rows=9, vocab=300, dtype=torch.float32, seed=k)
    k = min(k, options.get("vocab_size", 300))
    want = oracle_topk(logits_mm(h, w, torch.float32), k, **options)
    got = orda_tp.teacher_topk(h, w, k, backend="triton", config=SMALL_CHUNKS, **options)
    assert got.logprobs.dtype == torch.float32
    assert not topk_problems("triton", got, want, TRITON_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_logits_are_read_as_stored(dtype: torch.dtype, backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    h, w = teacher(rows=6, vocab=257)
    logits = (h @ w.T).to(dtype)
    want = oracle_topk(logits, 20, temperature=1.5)
    got = orda_tp.teacher_topk_of_logits(logits, 20, temperature=1.5, backend=backend, config=SMALL_CHUNKS)
    tolerance = TRITON_TOLERANCE if backend == "triton" else 1e-5
    assert not topk_problems(f"{dtype}", got, want, tolerance)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_ties_go_to_the_lowest_id_across_blocks(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (7, 400), generator=generator).float()  # hundreds of equal values per row
    logits[:, 390] = 2.0  # ties past the last block boundary too
    want = oracle_topk(logits, 150)
    got = orda_tp.teacher_topk_of_logits(logits, 150, backend=backend, config=SMALL_CHUNKS)
    assert torch.equal(got.ids, want.ids)
    assert not topk_problems(backend, got, want, 1e-6)


@pytest.mark.parametrize("tail", ["uniform", "renormalize"])
def test_a_cache_of_every_id_is_the_dense_teacher(tail: str) -> None:
    """k = V: the cache holds the whole distribution; with ``tail="uniform"`` (or nothing left to
    renormalize) the loss and gradients are the dense teacher's (fp64 ≤ 1e-10)."""
    h, w = teacher(rows=10, vocab=150, seed=3)
    generator = torch.Generator().manual_seed(4)
    student = torch.randn(10, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    student_weight = (torch.randn(150, 16, generator=generator, dtype=torch.float64) / 4).requires_grad_()
    labels = torch.randint(0, 150, (10,), generator=generator)
    kwargs = {"kl_weight": 1.0, "kl_divergence": "forward", "kl_temperature": 1.3, "teacher_ce_weight": 0.0}
    dense = orda_tp.PrecomputedTeacher(logits=h @ w.T)
    cache = orda_tp.teacher_topk(h, w, 150, backend="torch", config=SMALL_CHUNKS).teacher(tail)
    losses, grads = [], []
    for source in (dense, cache):
        out = orda_tp.distillation_loss(student, student_weight, labels, source, **kwargs)
        losses.append(out.loss.detach())
        grads.append(torch.autograd.grad(out.loss, [student, student_weight]))
    assert float((losses[0] - losses[1]).abs() / losses[0].abs()) <= 1e-10
    for want, got in zip(grads[0], grads[1]):
        assert float((want - got).norm() / want.norm()) <= 1e-10


def test_extraction_forms_no_logits_beyond_one_chunk() -> None:
    """The torch backend forms each chunk's (rows, vocab_block) block only: with 5-row chunks and
    64-column blocks, no tensor of the matmul has more than 5 × 64 entries."""
    h, w = teacher(rows=40, vocab=500)
    shapes: list[tuple[int, ...]] = []
    original = torch.Tensor.__matmul__

    def recording(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        result = original(a, b)
        shapes.append(tuple(result.shape))
        return result

    torch.Tensor.__matmul__ = recording  # type: ignore[method-assign]
    try:
        got = orda_tp.teacher_topk(h, w, 10, backend="torch", config=SMALL_CHUNKS)
    finally:
        torch.Tensor.__matmul__ = original  # type: ignore[method-assign]
    assert not topk_problems("chunks", got, oracle_topk(h @ w.T, 10), 1e-12)
    assert shapes and max(a * b for a, b in shapes) <= 5 * 64, shapes


def test_no_autograd_graph_and_the_cache_reads_as_a_teacher() -> None:
    h, w = teacher(rows=4, vocab=100)
    top = orda_tp.teacher_topk(h.requires_grad_(), w.requires_grad_(), 5)
    assert not top.logprobs.requires_grad and top.ids.dtype == torch.int64
    cache = top.teacher("renormalize")
    assert cache.tail == "renormalize" and torch.equal(cache.topk_ids, top.ids)


BAD_INPUT = [
    ({"k": 0}, ValueError, r"k must be"),
    ({"k": 101}, ValueError, r"k must be at most the real vocabulary \(100 ids\), got k=101"),
    ({"k": 95, "vocab_size": 90}, ValueError, r"k must be at most the real vocabulary \(90 ids\), got k=95"),
    ({"vocab_size": 120}, ValueError, r"vocab_size must lie in \[1, 100\]"),
    ({"temperature": 0.0}, ValueError, r"temperature"),
    ({"temperature": -1.0}, ValueError, r"temperature"),
    ({"logit_softcap": 0.0}, ValueError, r"logit_softcap"),
    ({"backend": "cuda"}, ValueError, r"backend"),
    ({"config": {"vocab_block": 64}}, TypeError, r"config must be an orda_tp.KernelConfig"),
]


@pytest.mark.parametrize("fields, error, message", BAD_INPUT)
def test_bad_input_raises_naming_the_argument(fields: dict, error: type, message: str) -> None:
    h, w = teacher(rows=4, vocab=100)
    kwargs = {"k": 5, **fields}
    with pytest.raises(error, match=message):
        orda_tp.teacher_topk(h, w, **kwargs)
    with pytest.raises(error, match=message):
        orda_tp.teacher_topk_of_logits(h @ w.T, **kwargs)


def test_bad_tensors_raise_naming_the_argument() -> None:
    h, w = teacher(rows=4, vocab=100)
    with pytest.raises(ValueError, match=r"hidden and weight must share the hidden size"):
        orda_tp.teacher_topk(h[:, :8], w, 5)
    with pytest.raises((ValueError, TypeError), match=r"weight"):
        orda_tp.teacher_topk(h, w[0], 5)
    with pytest.raises((ValueError, TypeError), match=r"logits"):
        orda_tp.teacher_topk_of_logits(torch.zeros(4, 10, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match=r"row 2 hold NaN"):
        bad = h @ w.T
        bad[2, 7] = float("nan")
        orda_tp.teacher_topk_of_logits(bad, 5)


def test_triton_refuses_what_it_cannot_run() -> None:
    h, w = teacher(rows=4, vocab=400, dtype=torch.float32)
    refused = r"backend='triton' cannot run this call: the Triton kernel extracts k <= 256, got k=300"
    with pytest.raises(ValueError, match=refused):
        orda_tp.teacher_topk(h, w, 300, backend="triton")
    with pytest.raises(ValueError, match=r"backend='triton' is unavailable"):
        orda_tp.teacher_topk(h.double(), w.double(), 3, backend="triton")


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_extraction_is_the_single_device_one(world_size: int) -> None:
    from .support import topk_extraction_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, topk_extraction_workers.extraction_worker, timeout=400)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_peaked_teacher_keeps_its_mass_within_rounding(backend: str) -> None:
    """Logits of std ≈ 11: the top 8 hold nearly all the mass. The log-probabilities are formed
    relative to the row's best value, so their mass stays within ``k`` fp32 units of 1 and the
    cache passes ``PrecomputedTeacher``'s check (the difference ``t − LSE`` of two rounded numbers
    near 30 would not)."""
    if backend == "triton":
        pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(50, 32, generator=generator)
    w = 2 * torch.randn(300, 32, generator=generator)
    top = orda_tp.teacher_topk(h, w, 8, backend=backend)
    mass = torch.exp(top.logprobs.double()).sum(dim=1)
    assert float(mass.max()) <= 1 + 8 * torch.finfo(torch.float32).eps, float(mass.max())
    assert not topk_problems("peaked", top, oracle_topk(logits_mm(h, w, torch.float32), 8), TRITON_TOLERANCE)
    labels = torch.randint(0, 300, (50,), generator=generator)
    loss = orda_tp.distillation_loss(h, w / 2, labels, top.teacher(), kl_weight=1.0, backend=backend).loss
    assert torch.isfinite(loss)
