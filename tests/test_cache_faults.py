"""Teacher caches users can trust: a damaged byte is refused before a row of its shard is served
(and by ``python -m orda_tp.topk_cache verify``), a cache written without checksums reads with one
warning, writers' ranges never overlap (refused before anything is written), rows extracted at
another temperature or over another vocabulary are refused, and a writer killed mid-write resumes
to the rows of a clean run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import orda_tp

pytest.importorskip("safetensors")

from orda_tp.topk_cache import (  # noqa: E402
    CacheSettings,
    TopKCacheReader,
    TopKCacheWriter,
    UncheckedShardWarning,
    shard_name,
)
from orda_tp.topk_cache.__main__ import main as cache_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, ROWS, K = 300, 32, 40, 8


def topk(rows: int = ROWS, seed: int = 0, temperature: float = 1.0) -> orda_tp.TeacherTopK:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * (2.0 / HIDDEN**0.5)
    return orda_tp.teacher_topk(hidden, weight, K, temperature=temperature, backend="torch")


def settings(**changes: object) -> CacheSettings:
    return CacheSettings(**({"vocab_size": VOCAB, "k": K, "teacher": "t"} | changes))  # type: ignore[arg-type]


def write(
    directory: Path, rows: orda_tp.TeacherTopK, start: int = 0, encoding: str = "plain", **keywords: object
) -> None:
    cache = settings(encoding=encoding)
    with TopKCacheWriter(directory, cache, start=start, rows_per_shard=7, **keywords) as writer:  # type: ignore[arg-type]
        writer.append(rows)


def flip_byte(path: Path, tensor: str) -> None:
    """Flip one bit of ``tensor``'s payload in the shard at ``path`` (its header and size unchanged)."""
    from orda_tp.topk_cache.shards import open_shard

    shard = open_shard(str(path), int(path.name.split("-")[1].split(".")[0]), CacheSettings)
    _, begin, end = shard.payload[tensor]
    data = bytearray(path.read_bytes())
    data[(begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("encoding", "tensor"),
    [("plain", "ids"), ("plain", "logprobs"), ("compact", "packed_ids"), ("compact", "packed_logprobs")],
)
def test_a_flipped_byte_is_refused_naming_the_shard_and_the_tensor(tmp_path: Path, encoding: str, tensor: str) -> None:
    write(tmp_path, topk(), encoding=encoding)
    flip_byte(tmp_path / shard_name(14), tensor)
    reader = TopKCacheReader(tmp_path)  # headers and sizes: still consistent
    ids, _ = reader.rows(0, 14)  # the shards before it are intact and served
    assert ids.shape == (14, K)
    damaged = rf"{shard_name(14)}: the bytes of its tensor '{tensor}' do not match their checksum"
    with pytest.raises(ValueError, match=damaged):
        reader.rows(10, 20)
    with pytest.raises(ValueError, match=damaged):
        reader.gather(torch.tensor([16]))
    with pytest.raises(ValueError, match=damaged):
        TopKCacheReader(tmp_path).teacher(14, 21)
    assert cache_main(["verify", str(tmp_path)]) == 1


def test_verify_reads_a_whole_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, topk())
    assert cache_main(["verify", str(tmp_path)]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"OK   {tmp_path}: 6 shards, {ROWS} rows; 6 verified (") and "GB/s)" in line
    run = subprocess.run(
        [sys.executable, "-m", "orda_tp.topk_cache", "verify", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0 and "6 verified" in run.stdout, run.stderr


def test_a_cache_written_without_checksums_reads_with_one_warning(tmp_path: Path) -> None:
    """A cache as 41dfd16 wrote it: the same shards at format version 1, without the encoding and
    the checksum entries."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    rows = topk()
    write(tmp_path, rows)
    for path in sorted(tmp_path.glob("topk-*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            stated = handle.metadata() or {}
            metadata = {key: value for key, value in stated.items() if not key.startswith("checksum.")}
        assert metadata.pop("encoding") == "plain" and metadata["version"] == "2"
        metadata["version"] = "1"
        save_file(load_file(str(path)), str(path), metadata=metadata)
    reader = TopKCacheReader(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids, logprobs = reader.rows(0, ROWS)  # six shards, one warning
    assert [type(w.message) for w in caught] == [UncheckedShardWarning]
    assert "carries no checksums" in str(caught[0].message)
    assert torch.equal(ids, rows.ids)
    assert reader.verify().unchecked == 6


def test_a_writer_inside_another_writers_range_is_refused_before_it_writes(tmp_path: Path) -> None:
    rows = topk(rows=100)
    for start, stop in ((0, 50), (50, 100)):
        with TopKCacheWriter(tmp_path, settings(), start=start, rows_per_shard=50, stop=stop) as writer:
            writer.append((rows.ids[start:stop], rows.logprobs[start:stop]))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FileExistsError, match=r"rows from 60 on overlap rows \[50, 100\) that .*topk-000000000050"):
        TopKCacheWriter(tmp_path, settings(), start=60)
    with TopKCacheWriter(tmp_path, settings(), start=120, rows_per_shard=10) as writer:
        writer.append((rows.ids[:10], rows.logprobs[:10]))
    with pytest.raises(FileExistsError, match=r"rows from 100 to 130 overlap rows \[120, 130\)"):
        TopKCacheWriter(tmp_path, settings(), start=100, stop=130)
    assert sorted(os.listdir(tmp_path)) == before + [shard_name(120)]
    # A closed range stops appends past it, and resumes only its own shards.
    with TopKCacheWriter(tmp_path, settings(), start=0, stop=50, resume=True) as writer:
        assert writer.num_written == 50
        with pytest.raises(ValueError, match="would pass this writer's stop=50"):
            writer.append((rows.ids[:1], rows.logprobs[:1]))


def test_rows_of_another_extraction_are_refused(tmp_path: Path) -> None:
    with TopKCacheWriter(tmp_path, settings(temperature=2.0)) as writer:
        with pytest.raises(ValueError, match="extracted at temperature=1.0, the cache holds temperature=2.0"):
            writer.append(topk())
        writer.append(topk(temperature=2.0))
    # A rank's head shard passed without tp_group: its top-k ranks its own columns alone.
    generator = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator)
    shard_topk = orda_tp.teacher_topk(hidden, weight[: VOCAB // 2], K)
    with TopKCacheWriter(tmp_path / "other", settings()) as writer:
        with pytest.raises(
            ValueError, match=r"over a vocabulary of 150 ids, the cache is for vocab_size=300: a head shard"
        ):
            writer.append(shard_topk)
    with pytest.raises(ValueError, match="vocab_size must lie in"):
        orda_tp.teacher_topk(hidden, weight[: VOCAB // 2], K, vocab_size=VOCAB)


_SLOW_WRITER = """
import sys, time, torch, orda_tp
from orda_tp.topk_cache import CacheSettings, TopKCacheWriter
directory, resume = sys.argv[1], sys.argv[2] == "resume"
generator = torch.Generator().manual_seed(0)
rows = orda_tp.teacher_topk(torch.randn(60, 32, generator=generator), torch.randn(300, 32, generator=generator), 8)
settings = CacheSettings(vocab_size=300, k=8, teacher="t")
with TopKCacheWriter(directory, settings, rows_per_shard=5, resume=resume) as writer:
    for begin in range(writer.num_written, 60, 3):
        writer.append((rows.ids[begin:begin + 3], rows.logprobs[begin:begin + 3]))
        time.sleep(0.05 if not resume else 0.0)
"""


def test_a_killed_writer_resumes_to_a_clean_runs_rows(tmp_path: Path) -> None:
    for _ in range(3):  # killed three times, each after a few shards
        process = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(tmp_path / "killed"), "resume"], cwd=ROOT)
        deadline = time.monotonic() + 60
        start = len(list((tmp_path / "killed").glob("topk-*"))) if (tmp_path / "killed").exists() else 0
        while time.monotonic() < deadline and process.poll() is None:
            if (tmp_path / "killed").exists() and len(list((tmp_path / "killed").glob("topk-*"))) >= start + 2:
                break
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait()
    subprocess.run([sys.executable, "-c", _SLOW_WRITER, str(tmp_path / "killed"), "resume"], cwd=ROOT, check=True)
    subprocess.run([sys.executable, "-c", _SLOW_WRITER, str(tmp_path / "clean"), "fresh"], cwd=ROOT, check=True)
    killed, clean = TopKCacheReader(tmp_path / "killed"), TopKCacheReader(tmp_path / "clean")
    assert killed.num_tokens == clean.num_tokens == 60
    assert killed.verify().verified == len(killed.shards)
    for left, right in zip(killed.rows(0, 60), clean.rows(0, 60)):
        assert torch.equal(left, right)
