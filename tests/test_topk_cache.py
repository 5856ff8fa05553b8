"""orda_tp.topk_cache: a teacher's top-k rows written to safetensors shards and read back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import orda_tp
from orda_tp.topk_cache import CacheSettings, TopKCacheReader, TopKCacheWriter, head_digest, shard_name
from orda_tp.topk_cache.extraction import TeacherTopK
from orda_tp.topk_cache.writer import stored_logprobs

pytest.importorskip("safetensors")

VOCAB, HIDDEN, ROWS, K = 300, 32, 40, 8


def _topk(rows: int = ROWS, seed: int = 0) -> TeacherTopK:
    """A teacher's top-k rows (logits of std ≈ 2: the top-k mass well below 1)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * (2.0 / HIDDEN**0.5)
    return orda_tp.teacher_topk(hidden, weight, K, backend="torch")


def _settings(**changes: object) -> CacheSettings:
    keywords: dict[str, object] = {"vocab_size": VOCAB, "k": K, "teacher": "test-teacher"} | changes
    return CacheSettings(**keywords)  # type: ignore[arg-type]


def _write(directory: Path, topk: TeacherTopK, settings: CacheSettings, start: int = 0, pieces: int = 3) -> None:
    """Write ``topk`` from ``start`` on, appended in uneven pieces, 7 rows a shard."""
    with TopKCacheWriter(directory, settings, start=start, rows_per_shard=7) as writer:
        bounds = torch.linspace(0, topk.ids.shape[0], pieces + 1).round().long().tolist()
        for begin, end in zip(bounds[:-1], bounds[1:]):
            writer.append((topk.ids[begin:end], topk.logprobs[begin:end]))
        assert writer.num_written == topk.ids.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_the_input_rounded_down_to_the_stored_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    topk = _topk()
    _write(tmp_path, topk, _settings(logprob_dtype=dtype))
    reader = TopKCacheReader(tmp_path)
    assert reader.num_tokens == ROWS and reader.settings == _settings(logprob_dtype=dtype)
    assert len(reader.shards) == 6  # 7 rows a shard, the last 5
    ids, logprobs = reader.rows(0, ROWS)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, topk.ids)
    assert torch.equal(logprobs, stored_logprobs(topk.logprobs, dtype).float())
    from safetensors import safe_open

    with safe_open(str(tmp_path / shard_name(7)), framework="pt") as handle:
        assert handle.get_tensor("ids").dtype == torch.int32 and handle.get_tensor("logprobs").dtype == dtype
        assert handle.metadata()["start"] == "7" and handle.metadata()["rows"] == "7"


def test_rows_and_gather_across_shards(tmp_path: Path) -> None:
    topk = _topk()
    _write(tmp_path, topk, _settings(logprob_dtype=torch.float32), pieces=5)
    reader = TopKCacheReader(tmp_path)
    for start, stop in [(0, 0), (3, 4), (5, 9), (6, 22), (13, 14), (14, ROWS), (0, ROWS), (ROWS, ROWS)]:
        ids, logprobs = reader.rows(start, stop)
        assert torch.equal(ids, topk.ids[start:stop]) and torch.equal(logprobs, topk.logprobs[start:stop])
    offsets = torch.tensor([39, 0, 6, 7, 7, 20, 13, 14, 1, 33])
    ids, logprobs = reader.gather(offsets)
    assert torch.equal(ids, topk.ids[offsets]) and torch.equal(logprobs, topk.logprobs[offsets])
    ids, logprobs = reader.gather(torch.empty(0, dtype=torch.int64))
    assert ids.shape == (0, K) and logprobs.shape == (0, K)


def test_disjoint_writers_make_one_cache(tmp_path: Path) -> None:
    topk = _topk()
    settings = _settings()
    second = TeacherTopK(topk.ids[17:], topk.logprobs[17:], topk.log_partition[17:])
    _write(tmp_path, second, settings, start=17)  # the later rank first: order does not matter
    with pytest.raises(ValueError, match=r"misses rows \[0, 17\)"):
        TopKCacheReader(tmp_path)
    _write(tmp_path, TeacherTopK(topk.ids[:17], topk.logprobs[:17], topk.log_partition[:17]), settings)
    ids, logprobs = TopKCacheReader(tmp_path).rows(0, ROWS)
    assert torch.equal(ids, topk.ids) and torch.equal(logprobs, stored_logprobs(topk.logprobs, torch.float16).float())


def test_a_writer_never_writes_over_another_writers_shards(tmp_path: Path) -> None:
    topk = _topk()
    _write(tmp_path, topk, _settings(), start=10)
    with pytest.raises(FileExistsError, match="resume=True"):
        TopKCacheWriter(tmp_path, _settings(), start=10)
    writer = TopKCacheWriter(tmp_path, _settings(), start=5, rows_per_shard=7)
    with pytest.raises(FileExistsError, match=r"rows from 5 to 12 overlap rows \[10, 17\)"):
        writer.append(topk[:2])  # (ids, logprobs): rows [5, 45), the first shard [5, 12) over the one at 10
    assert writer.num_written == ROWS  # nothing was lost: the rows stay buffered


def test_resume_after_a_crash_equals_one_write(tmp_path: Path) -> None:
    topk = _topk()
    _write(tmp_path / "whole", topk, _settings())
    crashed = TopKCacheWriter(tmp_path / "resumed", _settings(), start=0, rows_per_shard=7)
    crashed.append((topk.ids[:20], topk.logprobs[:20]))  # 14 rows written, 6 buffered
    del crashed  # the job dies: never closed
    stale = tmp_path / "resumed" / f".{shard_name(14)}.tmp"
    stale.write_bytes(b"half a shard")
    assert TopKCacheReader(tmp_path / "resumed").num_tokens == 14  # the temporary file is no shard
    with TopKCacheWriter(tmp_path / "resumed", _settings(), start=0, rows_per_shard=7, resume=True) as writer:
        assert writer.num_written == 14 and not stale.exists()
        writer.append((topk.ids[writer.num_written :], topk.logprobs[writer.num_written :]))
        assert writer.num_written == ROWS
    whole, resumed = TopKCacheReader(tmp_path / "whole"), TopKCacheReader(tmp_path / "resumed")
    assert [shard.rows for shard in resumed.shards] == [7] * 5 + [5]
    for left, right in zip(whole.rows(0, ROWS), resumed.rows(0, ROWS)):
        assert torch.equal(left, right)
    with pytest.raises(ValueError, match=r"other settings.*k: 8 != 4"):
        TopKCacheWriter(tmp_path / "resumed", _settings(k=4), resume=True)


def test_an_exception_inside_with_still_writes_the_appended_rows(tmp_path: Path) -> None:
    topk = _topk()
    with pytest.raises(RuntimeError, match="job failed"):
        with TopKCacheWriter(tmp_path, _settings(), rows_per_shard=100) as writer:
            writer.append(topk)
            raise RuntimeError("job failed")
    assert TopKCacheReader(tmp_path).num_tokens == ROWS
    with pytest.raises(ValueError, match="closed"):
        writer.append(topk)


def test_reader_rejects_a_truncated_shard(tmp_path: Path) -> None:
    _write(tmp_path, _topk(), _settings())
    path = tmp_path / shard_name(14)
    data = path.read_bytes()
    for damaged in (data[:-10], data[:5], data + b"\0" * 4):
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match=rf"{shard_name(14)} .*truncated or corrupt"):
            TopKCacheReader(tmp_path)
    path.write_bytes(data)
    assert TopKCacheReader(tmp_path).num_tokens == ROWS


def test_reader_rejects_a_gap_and_mixed_settings(tmp_path: Path) -> None:
    topk = _topk()
    _write(tmp_path, topk, _settings())
    os.remove(tmp_path / shard_name(14))
    with pytest.raises(ValueError, match=r"misses rows \[14, 21\)"):
        TopKCacheReader(tmp_path)
    with TopKCacheWriter(tmp_path, _settings(temperature=2.0), start=14, rows_per_shard=7) as writer:
        writer.append((topk.ids[14:21], topk.logprobs[14:21]))
    with pytest.raises(ValueError, match=rf"{shard_name(14)} has other settings.*temperature: 2.0 != 1.0"):
        TopKCacheReader(tmp_path)
    os.remove(tmp_path / shard_name(14))
    with TopKCacheWriter(tmp_path / "other", _settings(), start=14, rows_per_shard=8) as writer:
        writer.append((topk.ids[14:22], topk.logprobs[14:22]))  # one row into the next shard
    os.replace(tmp_path / "other" / shard_name(14), tmp_path / shard_name(14))
    with pytest.raises(ValueError, match=rf"{shard_name(21)} overlaps rows \[21, 22\)"):
        TopKCacheReader(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no cache shards \(topk-<offset>.safetensors\)"):
        TopKCacheReader(tmp_path / "empty")


def test_reader_check_and_ranges(tmp_path: Path) -> None:
    _write(tmp_path, _topk(), _settings(temperature=2.0, logit_softcap=30.0))
    reader = TopKCacheReader(tmp_path)
    reader.check(vocab_size=VOCAB, k=K, temperature=2.0, logit_softcap=30.0, teacher="test-teacher")
    reader.check()
    for keyword, value in [("vocab_size", 301), ("k", 4), ("temperature", 1.0), ("teacher", "other")]:
        with pytest.raises(ValueError, match=rf"{keyword}: the cache has .*, expected {value!r}"):
            reader.check(**{keyword: value})
    with pytest.raises(ValueError, match="vocab_size.*; k"):
        reader.check(vocab_size=1, k=1)
    for start, stop in [(-1, 3), (3, ROWS + 1), (5, 4)]:
        with pytest.raises(ValueError, match=rf"0 <= start <= stop <= num_tokens \({ROWS}\)"):
            reader.rows(start, stop)
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, num_tokens=40\)"):
        reader.gather(torch.tensor([0, ROWS]))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        reader.gather(torch.tensor([0.0]))


def test_appended_rows_are_checked(tmp_path: Path) -> None:
    topk = _topk(rows=4)
    writer = TopKCacheWriter(tmp_path, _settings())
    ids, logprobs = topk.ids.clone(), topk.logprobs.clone()
    ids[1, 2] = VOCAB
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, {VOCAB}\); ids\[1, 2\] = {VOCAB}"):
        writer.append((ids, logprobs))
    ids[1, 2] = ids[1, 0]
    with pytest.raises(ValueError, match="distinct in each row; row 1"):
        writer.append((ids, logprobs))
    for bad in (0.5, float("nan"), float("inf")):
        logprobs = topk.logprobs.clone()
        logprobs[2, 3] = bad
        with pytest.raises(ValueError, match=r"logprobs must be log-probabilities.*logprobs\[2, 3\]"):
            writer.append((topk.ids, logprobs))
    with pytest.raises(ValueError, match=r"\(rows, k=8\) on one device, got \(4, 7\) on cpu"):
        writer.append((topk.ids[:, :7], topk.logprobs[:, :7]))
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        writer.append((topk.ids.float(), topk.logprobs))
    with pytest.raises(TypeError, match="logprobs must be a floating-point tensor"):
        writer.append((topk.ids, topk.ids))
    with pytest.raises(TypeError, match="TeacherTopK or"):
        writer.append([topk.ids])  # type: ignore[arg-type]
    assert writer.num_written == 0
    logprobs = topk.logprobs.clone()
    logprobs[0, -1], logprobs[1, -1] = float("-inf"), -1e6  # no mass; below float16's range
    writer.append(topk.ids, logprobs)
    writer.close()
    stored = TopKCacheReader(tmp_path).rows(0, 4)[1]
    assert stored[0, -1] == float("-inf") and stored[1, -1] == float("-inf")


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="CacheSettings.k must be an int >= 1"):
        CacheSettings(vocab_size=10, k=0)
    with pytest.raises(ValueError, match="at most vocab_size"):
        CacheSettings(vocab_size=10, k=11)
    with pytest.raises(ValueError, match="CacheSettings.temperature"):
        CacheSettings(vocab_size=10, k=1, temperature=0.0)
    with pytest.raises(ValueError, match="logprob_dtype must be one of"):
        CacheSettings(vocab_size=10, k=1, logprob_dtype=torch.int8)
    with pytest.raises(TypeError, match="CacheSettings.teacher must be a str"):
        CacheSettings(vocab_size=10, k=1, teacher=3)  # type: ignore[arg-type]
    assert CacheSettings(vocab_size=2**31, k=1).ids_dtype == torch.int64


def test_head_digest_is_stable_and_tells_heads_apart() -> None:
    weight = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    digest = head_digest(weight)
    assert len(digest) == 16 and digest == head_digest(weight.clone()) == head_digest(weight.t().contiguous().t())
    changed = weight.clone()
    changed[3, 4] += 1e-3
    assert len({digest, head_digest(changed), head_digest(weight.double()), head_digest(weight.reshape(25, 32))}) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_cached_teacher_gives_the_in_memory_teachers_loss(tmp_path: Path, dtype: torch.dtype) -> None:
    topk = _topk()
    _write(tmp_path, topk, _settings(logprob_dtype=dtype))
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)

    def loss(teacher: orda_tp.PrecomputedTeacher) -> tuple[torch.Tensor, ...]:
        student_hidden, student_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = orda_tp.distillation_loss(student_hidden, student_weight, labels, teacher, kl_weight=1.0)
        out.loss.backward()
        assert student_hidden.grad is not None and student_weight.grad is not None
        return out.loss.detach(), student_hidden.grad, student_weight.grad

    reader = TopKCacheReader(tmp_path)
    cached = loss(reader.teacher(0, ROWS, tail="uniform"))
    in_memory = loss(topk.teacher("uniform"))
    tolerance = 0.0 if dtype == torch.float32 else 1e-3
    for got, expected in zip(cached, in_memory):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))
    if dtype == torch.float16:
        assert not torch.equal(cached[0], in_memory[0])  # the fp16 rounding is seen, and small


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_peaked_teacher_is_stored_without_mass_above_one(tmp_path: Path, dtype: torch.dtype) -> None:
    """A teacher whose top 8 hold nearly all the mass: its rows whose rounding to nearest would
    hold more than the whole mass are stored rounded toward −inf (each value within one unit of
    ``dtype`` below the input), the others to nearest, and the loss reads the cache."""
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(50, 32, generator=generator), 2 * torch.randn(300, 32, generator=generator)
    top = orda_tp.teacher_topk(hidden, weight, 8)
    settings = CacheSettings(vocab_size=300, k=8, logprob_dtype=dtype)
    with TopKCacheWriter(tmp_path, settings) as writer:
        writer.append(top)
    ids, logprobs = TopKCacheReader(tmp_path).rows(0, 50)
    assert torch.equal(ids, top.ids)
    nearest = top.logprobs.to(dtype).float()
    over = torch.exp(nearest.double()).sum(1) > 1
    assert bool(over.any()) and bool((~over).any())
    assert torch.equal(logprobs[~over], nearest[~over])
    assert bool((logprobs[over] <= top.logprobs[over]).all())
    gap = top.logprobs[over] - logprobs[over]
    assert bool((gap <= top.logprobs[over].abs() * torch.finfo(dtype).eps + 6e-8).all())
    assert float(torch.exp(logprobs.double()).sum(1).max()) <= 1 + 8 * torch.finfo(torch.float32).eps
    assert float(torch.exp(top.logprobs.to(dtype).double()).sum(1).max()) > 1 + 8 * torch.finfo(torch.float32).eps
    labels = torch.randint(0, 300, (50,), generator=generator)
    teacher = TopKCacheReader(tmp_path).teacher(0, 50)
    assert torch.isfinite(orda_tp.distillation_loss(hidden, weight / 2, labels, teacher, kl_weight=1.0).loss)
