"""orda_tp.topk_cache.compact: the compact row encoding of a top-k cache (Elias-Fano ids, float16
log-probabilities without their sign bit). Round trips against the float16 cache's values
(``stored_logprobs``) sorted by id, written independently here; the bit layout pinned on a small
row; the bytes at k = 64; a loss read through the codec against the float32 and float16 caches'
losses; the errors of bad inputs and of corrupt bits; a cache of ``encoding="compact"`` written
and read through the cache's writer and reader against a plain float16 cache of the same rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

import orda_tp
from orda_tp.topk_cache import compact
from orda_tp.topk_cache.compact import TENSORS, decode, encode, layout
from orda_tp.topk_cache.rounding import stored_logprobs

pytest.importorskip("safetensors")


def _id_sets(vocab: int, k: int, rows: int, generator: torch.Generator) -> Tensor:
    """Rows of ``k`` distinct ids below ``vocab``: random, then the extremes of the gaps between
    sorted ids (every gap 1, every gap as large as it can be, one gap of nearly ``vocab``, the
    bottom and the top of the range)."""
    if vocab <= 1 << 20:
        random = torch.rand(rows, vocab, generator=generator).argsort(dim=1)[:, :k]
    else:  # a random distinct set: k draws from k disjoint stretches, shuffled
        stretch = vocab // k
        random = torch.arange(k) * stretch + torch.randint(0, stretch, (rows, k), generator=generator)
        random = random.gather(1, torch.rand(rows, k, generator=generator).argsort(dim=1))
    half = k // 2
    extremes = [
        torch.arange(k),  # the bottom: all gaps 1
        torch.arange(vocab - k, vocab),  # the top
        torch.arange(k) * (vocab // k) + (vocab % k),  # gaps as even and large as they get
        torch.cat([torch.arange(half), torch.arange(vocab - (k - half), vocab)]),  # one gap of nearly vocab
    ]
    return torch.cat([random, torch.stack(extremes)])


def _logprobs(rows: int, k: int, generator: torch.Generator) -> Tensor:
    """Log-probabilities of rows of mass below 1 (logits of std 3 over 2k ids, the top k kept)."""
    logits = 3.0 * torch.randn(rows, 2 * k, generator=generator)
    return torch.log_softmax(logits, dim=1)[:, :k]


def _expected(ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """The float16 cache's (id, value) pairs of each row, sorted by id."""
    order = ids.sort(dim=1, stable=True).indices
    return ids.gather(1, order).long(), stored_logprobs(logprobs, torch.float16).float().gather(1, order)


def _round_trip(ids: Tensor, logprobs: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """Encoded, stored and loaded by safetensors, decoded."""
    from safetensors.torch import load, save

    stored = encode(ids, logprobs, vocab)
    plan = layout(ids.shape[1], vocab)
    assert set(stored) == set(TENSORS)
    assert [tuple(stored[name].shape) for name in TENSORS] == [
        (ids.shape[0], plan.id_bytes),
        (ids.shape[0], plan.logprob_bytes),
    ]
    assert all(tensor.dtype == torch.uint8 and tensor.is_contiguous() for tensor in stored.values())
    return decode(load(save(stored)), ids.shape[1], vocab)


@pytest.mark.parametrize(
    ("vocab", "k"),
    [(300, 8), (32000, 64), (151936, 64), (262144, 128), (2**16, 5), (2**16 + 1, 16), (2**16 - 1, 256),
     (2**31, 64), (2**31, 1), (2**31 - 1, 3), (2**31, 256), (50, 50), (1, 1), (40, 1), (7, 6)],
)  # fmt: skip
def test_round_trip_is_the_float16_cache_sorted_by_id(vocab: int, k: int) -> None:
    generator = torch.Generator().manual_seed(vocab % 1000 + k)
    ids = _id_sets(vocab, k, 12, generator)
    logprobs = _logprobs(ids.shape[0], k, generator)
    got_ids, got_logprobs = _round_trip(ids, logprobs, vocab)
    want_ids, want_logprobs = _expected(ids, logprobs)
    assert got_ids.dtype == torch.int64 and got_logprobs.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)  # lossless
    assert torch.equal(got_logprobs, want_logprobs)  # bit for bit the float16 cache's values


def test_special_values_round_trip() -> None:
    """−inf, 0 (a row of all the mass), −0, values below float16's range, subnormal magnitudes, and a
    peaked row whose mass would round above 1 (rounded toward −inf, as the float16 cache does)."""
    inf = float("-inf")
    logprobs = torch.tensor(
        [
            [0.0, inf, inf, inf],
            [-0.0, -7e4, inf, -1e5],  # below float16's range: −inf
            [-1e-3, -8.0, -30.0, -65504.0],
            # A softmax's top 4 (mass 1 in float64): to nearest in float16 its mass would exceed 1.
            [-7.175739205450218e-06, -14.503282217754174, -20.15936364669501, -11.917701668629332],
            [-5.960464477539063e-08, -17.0, -18.0, -100.0],  # float16's smallest subnormal
        ],
        dtype=torch.float64,
    )
    assert torch.exp(logprobs[3].to(torch.float16).double()).sum() > 1  # the case the rounding down is for
    ids = torch.tensor([[3, 1, 2, 0], [9, 0, 5, 7], [1, 2, 3, 4], [8, 6, 4, 2], [0, 9, 1, 8]])
    got_ids, got_logprobs = _round_trip(ids, logprobs, 10)
    want_ids, want_logprobs = _expected(ids, logprobs)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_logprobs, want_logprobs)
    assert not torch.signbit(got_logprobs[got_logprobs == 0]).any()  # 0 reads back as +0
    assert torch.exp(got_logprobs.double()).sum(dim=1).max() <= 1.0


def test_bit_layout() -> None:
    """V = 16, k = 2: l = 3, a 3-bit unary vector and two 3-bit low parts, each part little-endian
    from a byte boundary; the magnitudes of −1 (0x3C00) and −2 (0x4000) at bits 0 and 15."""
    plan = layout(2, 16)
    assert (plan.low_bits, plan.upper_bits, plan.id_bytes, plan.logprob_bytes) == (3, 3, 2, 4)
    stored = encode(torch.tensor([[12, 3]]), torch.tensor([[-2.0, -1.0]]), 16)
    # ids 3, 12: high parts 0, 1 → bits 0 and 2 (0b101); low parts 3, 4 → 3 | 4 << 3 = 35.
    assert stored["packed_ids"].tolist() == [[0b101, 35]]
    # 0x3C00 | 0x4000 << 15 = 0x20003C00, little-endian.
    assert stored["packed_logprobs"].tolist() == [[0x00, 0x3C, 0x00, 0x20]]
    ids, logprobs = decode(stored, 2, 16)
    assert ids.tolist() == [[3, 12]] and logprobs.tolist() == [[-1.0, -2.0]]


def test_bytes_per_token_at_k64() -> None:
    """Under 250 bytes a token at k = 64 for the realistic vocabularies, the safetensors header
    included (a shard of 4096 rows); 336 at V = 2³¹, for every id set alike."""
    from safetensors.torch import save

    sizes = {vocab: layout(64, vocab).row_bytes for vocab in (32000, 128256, 151936, 262144, 2**31)}
    assert sizes == {32000: 208, 128256: 224, 151936: 226, 262144: 232, 2**31: 336}
    generator = torch.Generator().manual_seed(0)
    rows = 4096
    logits = torch.randn(rows // 64, 262144, generator=generator).repeat(64, 1)
    top = torch.log_softmax(3.0 * logits, dim=1).topk(64, dim=1)
    stored = encode(top.indices, top.values, 262144)
    assert len(save(stored, {"vocab_size": "262144", "k": "64"})) / rows < 233


def test_blocks_and_repeats_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic: the same bytes twice, and whatever the rows per block."""
    generator = torch.Generator().manual_seed(1)
    ids = _id_sets(151936, 64, 40, generator)
    logprobs = _logprobs(ids.shape[0], 64, generator)
    whole = encode(ids, logprobs, 151936)
    assert all(torch.equal(whole[name], encode(ids, logprobs, 151936)[name]) for name in TENSORS)
    monkeypatch.setattr(compact, "BLOCK_ENTRIES", 3 * 64)  # blocks of 3 rows, the last shorter
    blocked = encode(ids, logprobs, 151936)
    assert all(torch.equal(whole[name], blocked[name]) for name in TENSORS)
    assert all(torch.equal(a, b) for a, b in zip(decode(blocked, 64, 151936), _expected(ids, logprobs)))
    empty = encode(ids[:0], logprobs[:0], 151936)
    assert [tuple(t.shape) for t in decode(empty, 64, 151936)] == [(0, 64), (0, 64)]


def _loss(ids: Tensor, logprobs: Tensor, inputs: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, ...]:
    """``student_ce + forward KL`` (uniform tail) and its gradients wrt the student's hidden states and head."""
    hidden, weight, labels = (inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_(), inputs[2])
    teacher = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail="uniform", topk_temperature=1.0)
    out = orda_tp.distillation_loss(hidden, weight, labels, teacher, kl_weight=1.0, backend="torch")
    out.loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return out.loss.detach(), hidden.grad, weight.grad


def _errors(result: tuple[Tensor, ...], reference: tuple[Tensor, ...]) -> list[float]:
    return [float((got - want).norm() / want.norm()) for got, want in zip(result, reference)]


def test_loss_through_the_codec_has_the_float16_caches_error() -> None:
    """The loss and gradients read through the codec: equal to the float16 cache's pairs in id order
    (bit for bit), and as far from the float32 cache's as the float16 cache is (up to the rounding of
    the sums, whose order changes)."""
    generator = torch.Generator().manual_seed(2)
    rows, width, vocab, k = 64, 32, 32000, 64
    teacher_hidden = torch.randn(rows, width, generator=generator)
    teacher_weight = torch.randn(vocab, width, generator=generator) * (3.0 / width**0.5)
    hidden = teacher_hidden + 0.5 * torch.randn(rows, width, generator=generator)
    inputs = (hidden, teacher_weight / 1.5, torch.randint(0, vocab, (rows,), generator=generator))
    topk = orda_tp.teacher_topk(teacher_hidden, teacher_weight, k, backend="torch")
    reference = _loss(topk.ids, topk.logprobs, inputs)
    float16 = _loss(topk.ids, stored_logprobs(topk.logprobs, torch.float16).float(), inputs)
    decoded = _round_trip(topk.ids, topk.logprobs, vocab)
    through = _loss(*decoded, inputs)
    assert all(torch.equal(a, b) for a, b in zip(through, _loss(*_expected(topk.ids, topk.logprobs), inputs)))
    float16_errors, codec_errors = _errors(float16, reference), _errors(through, reference)
    assert max(float16_errors) > 1e-7  # float16 rounding shows
    for codec, fp16 in zip(codec_errors, float16_errors):
        assert codec <= fp16 * 1.01 + 1e-7, (codec_errors, float16_errors)


@pytest.mark.parametrize(
    ("ids", "logprobs", "vocab", "error", "match"),
    [
        (torch.tensor([[0, 10]]), torch.tensor([[-1.0, -2]]), 10, ValueError, r"ids must lie in \[0, 10\); ids\[0, 1"),
        (torch.tensor([[0, -1]]), torch.tensor([[-1.0, -2.0]]), 10, ValueError, "ids must lie"),
        (torch.tensor([[0, 1]]), torch.tensor([[-1.0, 0.5]]), 10, ValueError, r"logprobs\[0, 1\]"),
        (torch.tensor([[0, 1]]), torch.tensor([[float("nan"), -1.0]]), 10, ValueError, r"logprobs\[0, 0\]"),
        (torch.tensor([[0, 1]]), torch.tensor([[-1.0]]), 10, ValueError, "must both be"),
        (torch.tensor([[0.0, 1.0]]), torch.tensor([[-1.0, -2.0]]), 10, TypeError, "integer tensor"),
        (torch.tensor([[0, 1]]), torch.tensor([[-1, -2]]), 10, TypeError, "floating-point"),
        (torch.tensor([[0, 1]]), torch.tensor([[-1.0, -2.0]]), 2**31 + 1, ValueError, r"vocab_size <= 2\*\*31"),
        (torch.tensor([[0, 1, 2]]), torch.tensor([[-1.0, -2.0, -3.0]]), 2, ValueError, "k <= vocab_size"),
    ],
)  # fmt: skip
def test_bad_inputs_raise(ids: Tensor, logprobs: Tensor, vocab: int, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        encode(ids, logprobs, vocab)


def test_corrupt_bits_raise() -> None:
    stored = encode(torch.tensor([[12, 1, 5]]), torch.tensor([[-1.0, -2.0, -3.0]]), 13)
    plan = layout(3, 13)  # l = 2: ids 1, 5, 12 have high parts 0, 1, 3, set bits 0, 2, 5 of 6
    assert (plan.low_bits, plan.upper_bits) == (2, 6) and stored["packed_ids"][0, 0] == 0b100101

    def corrupted(name: str, byte: int, value: int) -> dict[str, Tensor]:
        changed = {key: tensor.clone() for key, tensor in stored.items()}
        changed[name][0, byte] = value
        return changed

    with pytest.raises(ValueError, match="exactly k=3 set bits"):
        decode(corrupted("packed_ids", 0, 0b100111), 3, 13)
    with pytest.raises(ValueError, match="at or past vocab_size=13"):
        decode(corrupted("packed_ids", 1, 0xFF), 3, 13)  # every low part 3: ids 3, 7, 15
    with pytest.raises(ValueError, match="NaN pattern"):
        decode(corrupted("packed_logprobs", 1, 0x7F), 3, 13)  # the first magnitude's bits 8-14 all set
    with pytest.raises(ValueError, match=r"uint8 \(rows, 2\)"):
        decode({"packed_ids": stored["packed_ids"][:, :1], "packed_logprobs": stored["packed_logprobs"]}, 3, 13)
    with pytest.raises(ValueError, match=r"packed_ids'\] must be uint8"):
        decode(
            {"packed_ids": stored["packed_ids"].to(torch.int16), "packed_logprobs": stored["packed_logprobs"]}, 3, 13
        )
    with pytest.raises(ValueError, match="must be a dict of"):
        decode({"ids": stored["packed_ids"]}, 3, 13)
    with pytest.raises(ValueError, match="must be uint8"):
        decode(stored, 4, 13)  # another k: another layout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_cpu_bytes() -> None:
    generator = torch.Generator().manual_seed(3)
    ids = _id_sets(151936, 64, 100, generator)
    logprobs = _logprobs(ids.shape[0], 64, generator)
    on_cpu = encode(ids, logprobs, 151936)
    on_gpu = encode(ids.cuda(), logprobs.cuda(), 151936)
    assert all(torch.equal(on_cpu[name], on_gpu[name].cpu()) for name in TENSORS)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(decode(on_cpu, 64, 151936), decode(on_gpu, 64, 151936)))


def _write_cache(directory: object, topk: orda_tp.TeacherTopK, encoding: str) -> None:
    from orda_tp.topk_cache import CacheSettings, TopKCacheWriter

    settings = CacheSettings(
        vocab_size=int(topk.vocab_size or 0),
        k=topk.ids.shape[1],
        temperature=topk.temperature,
        teacher="t",
        encoding=encoding,
    )
    with TopKCacheWriter(directory, settings, rows_per_shard=7) as writer:  # type: ignore[arg-type]
        for begin in range(0, topk.ids.shape[0], 11):  # pieces across shard bounds
            writer.append((topk.ids[begin : begin + 11], topk.logprobs[begin : begin + 11]))


def test_a_compact_cache_reads_the_plain_float16_caches_rows_and_loss(tmp_path: Path) -> None:
    """Written and read through the cache: every row (by range and by gather, across shards) is the
    plain float16 cache's row sorted by id, the loss and gradients it gives are the plain cache's
    up to the order of the sums, and its shards are smaller by the layout's bytes."""
    from orda_tp.topk_cache import TopKCacheReader

    generator = torch.Generator().manual_seed(4)
    rows, width, vocab, k = 40, 16, 3000, 32
    teacher_hidden = torch.randn(rows, width, generator=generator)
    teacher_weight = torch.randn(vocab, width, generator=generator) * (3.0 / width**0.5)
    topk = orda_tp.teacher_topk(teacher_hidden, teacher_weight, k, temperature=2.0, backend="torch")
    _write_cache(tmp_path / "plain", topk, "plain")
    _write_cache(tmp_path / "compact", topk, "compact")
    plain, packed = TopKCacheReader(tmp_path / "plain"), TopKCacheReader(tmp_path / "compact")
    assert packed.settings.encoding == "compact" and packed.num_tokens == rows and len(packed.shards) == 6
    assert all(torch.equal(a, b) for a, b in zip(packed.rows(0, rows), _expected(*plain.rows(0, rows))))
    for start, stop in [(0, 0), (3, 9), (6, 22), (14, rows)]:
        assert all(torch.equal(a, b) for a, b in zip(packed.rows(start, stop), _expected(*plain.rows(start, stop))))
    offsets = torch.tensor([39, 0, 6, 7, 7, 20, 13])
    assert all(torch.equal(a, b) for a, b in zip(packed.gather(offsets), _expected(*plain.gather(offsets))))
    # Each row: the layout's bytes in place of int32 ids and float16 values.
    plan = layout(k, vocab)
    assert sum(end - begin for _, begin, end in packed.shards[0].payload.values()) == 7 * plan.row_bytes
    assert plan.row_bytes < k * 6
    inputs = (teacher_hidden + torch.randn(rows, width, generator=generator), teacher_weight / 2, topk.ids[:, 0])

    def loss(reader: TopKCacheReader) -> tuple[Tensor, ...]:
        hidden, weight = inputs[0].clone().requires_grad_(), inputs[1].clone().requires_grad_()
        teacher = reader.teacher(0, rows, tail="renormalize")
        out = orda_tp.distillation_loss(hidden, weight, inputs[2], teacher, kl_weight=1.0, kl_temperature=2.0)
        out.loss.backward()
        assert hidden.grad is not None and weight.grad is not None
        return out.loss.detach(), hidden.grad, weight.grad

    for got, want in zip(loss(packed), loss(plain)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * float(want.abs().max()))


def test_compact_cache_settings_are_checked(tmp_path: Path) -> None:
    from orda_tp.topk_cache import CacheSettings, TopKCacheReader

    with pytest.raises(ValueError, match=r"CacheSettings.encoding must be one of \['plain', 'compact'\]"):
        CacheSettings(vocab_size=10, k=2, encoding="packed")
    with pytest.raises(ValueError, match="encoding='compact' stores float16 log-probabilities"):
        CacheSettings(vocab_size=10, k=2, logprob_dtype=torch.bfloat16, encoding="compact")
    with pytest.raises(ValueError, match="vocab_size <= 2\\*\\*31"):
        CacheSettings(vocab_size=2**31 + 1, k=2, encoding="compact")
    # A writer of the other encoding does not resume another's cache: the settings differ.
    generator = torch.Generator().manual_seed(5)
    topk = orda_tp.teacher_topk(torch.randn(9, 8, generator=generator), torch.randn(50, 8, generator=generator), 4)
    _write_cache(tmp_path, topk, "compact")
    from orda_tp.topk_cache import TopKCacheWriter

    with pytest.raises(ValueError, match="encoding: 'compact' != 'plain'"):
        TopKCacheWriter(tmp_path, CacheSettings(vocab_size=50, k=4, teacher="t"), resume=True)
    assert TopKCacheReader(tmp_path).settings.encoding == "compact"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compact_cache_encodes_and_decodes_on_the_gpu(tmp_path: Path) -> None:
    """Rows on a GPU are encoded there (the same shards' tensors and checksums as from the CPU), and
    read onto a GPU they are decoded there (the CPU's rows)."""
    from orda_tp.topk_cache import TopKCacheReader

    generator = torch.Generator().manual_seed(6)
    topk = orda_tp.teacher_topk(
        torch.randn(30, 16, generator=generator), torch.randn(5000, 16, generator=generator), 64
    )
    on_gpu = topk._replace(ids=topk.ids.cuda(), logprobs=topk.logprobs.cuda())
    _write_cache(tmp_path / "cpu", topk, "compact")
    _write_cache(tmp_path / "gpu", on_gpu, "compact")
    from safetensors import safe_open

    # The same tensors and metadata (the header's key order is safetensors' own, not the bytes').
    shards = [sorted((tmp_path / side).glob("topk-*.safetensors")) for side in ("cpu", "gpu")]
    assert len(shards[0]) == len(shards[1]) == 5
    for a, b in zip(*shards):
        with safe_open(str(a), framework="pt") as one, safe_open(str(b), framework="pt") as other:
            assert one.metadata() == other.metadata() and set(one.keys()) == set(other.keys())
            assert all(torch.equal(one.get_tensor(name), other.get_tensor(name)) for name in one.keys())
    reader = TopKCacheReader(tmp_path / "gpu")
    ids, logprobs = reader.rows(0, 30, device="cuda")
    assert ids.is_cuda and all(torch.equal(a.cpu(), b) for a, b in zip((ids, logprobs), reader.rows(0, 30)))
