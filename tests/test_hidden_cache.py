"""Hidden-state caches: the teacher's final hidden states on disk, read back with its head as the
teacher itself — exact at every temperature, over the whole vocabulary and under tensor
parallelism — checked and verified like the top-k caches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import orda_tp

pytest.importorskip("safetensors")

from orda_tp.topk_cache import HiddenCacheReader, HiddenCacheSettings, HiddenCacheWriter  # noqa: E402
from orda_tp.topk_cache.__main__ import main as cache_main  # noqa: E402

from .support.cases import relative_error  # noqa: E402

ROWS, HIDDEN, WIDE, VOCAB = 20, 8, 12, 41


def teacher_states(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, WIDE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def write(directory: Path, hidden: torch.Tensor, rows_per_shard: int = 6) -> None:
    settings = HiddenCacheSettings(hidden_size=WIDE, dtype=hidden.dtype, teacher="t")
    with HiddenCacheWriter(directory, settings, rows_per_shard=rows_per_shard) as writer:
        for begin in range(0, ROWS, 7):
            writer.append(hidden[begin : begin + 7])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_cached_teacher_is_the_teacher(tmp_path: Path, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(ROWS, HIDDEN, generator=generator, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    teacher_head = torch.randn(VOCAB, WIDE, generator=generator, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    hidden = teacher_states(dtype)
    write(tmp_path, hidden)
    reader = HiddenCacheReader(tmp_path)
    assert reader.num_tokens == ROWS and [shard.rows for shard in reader.shards] == [6, 6, 6, 2]
    assert torch.equal(reader.rows(0, ROWS), hidden) and torch.equal(
        reader.gather(torch.tensor([19, 3, 3])), hidden[[19, 3, 3]]
    )
    for temperature, variant in ((1.0, "forward"), (2.0, "reverse"), (0.5, "jeffreys")):
        keywords = dict(kl_weight=1.0, kl_temperature=temperature, kl_divergence=variant)
        cached = orda_tp.distillation_loss(
            student,
            head,
            labels,
            reader.teacher(0, ROWS, teacher_head),
            **keywords,
        )
        online = orda_tp.distillation_loss(
            student, head, labels, orda_tp.SeparateTeacher(hidden, teacher_head), **keywords
        )
        assert relative_error(cached.loss, online.loss) <= 1e-12
    batch = reader.teacher(6, 13, teacher_head)
    assert torch.equal(batch.teacher_hidden, hidden[6:13])


def test_hidden_cache_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        HiddenCacheSettings(hidden_size=4, dtype=torch.int32)
    write(tmp_path, teacher_states())
    reader = HiddenCacheReader(tmp_path)
    with pytest.raises(ValueError, match=rf"weight must be the teacher's head \(V, {WIDE}\)"):
        reader.teacher(0, 4, torch.zeros(VOCAB, WIDE + 1))
    with pytest.raises(ValueError, match="hidden_size: the cache has 12, expected 13"):
        reader.check(hidden_size=13)
    settings = HiddenCacheSettings(hidden_size=WIDE, dtype=torch.float64)
    with HiddenCacheWriter(tmp_path / "other", settings) as writer:
        with pytest.raises(ValueError, match=r"hidden must be \(rows, hidden_size=12\)"):
            writer.append(torch.zeros(3, 5, dtype=torch.float64))
        bad = teacher_states()[:3].clone()
        bad[1, 2] = float("nan")
        with pytest.raises(ValueError, match="hidden must be finite; row 1"):
            writer.append(bad)
    with pytest.raises(FileExistsError, match="overlap"):
        HiddenCacheWriter(tmp_path, settings, start=8)


def test_a_damaged_hidden_shard_is_refused(tmp_path: Path) -> None:
    write(tmp_path, teacher_states())
    path = sorted(tmp_path.glob("hidden-*.safetensors"))[1]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    reader = HiddenCacheReader(tmp_path)
    assert torch.equal(reader.rows(0, 6), teacher_states()[:6])
    with pytest.raises(ValueError, match=rf"{path.name}: the bytes of its tensor 'hidden' do not match"):
        reader.rows(0, 8)
    assert cache_main(["verify", str(tmp_path)]) == 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_hidden_cache_under_tensor_parallelism(tmp_path: Path, world_size: int) -> None:
    from .support import hidden_cache_workers
    from .support.distributed import run_distributed

    write(tmp_path, teacher_states(seed=9))
    reports = run_distributed(world_size, hidden_cache_workers.hidden_cache_worker, str(tmp_path), 7, timeout=240)
    for report in reports:
        assert relative_error(torch.tensor(report["loss"]), torch.tensor(report["alone"])) <= 1e-12
        assert report["grad_gap"] <= 1e-12
    assert len({report["loss"] for report in reports}) == 1
