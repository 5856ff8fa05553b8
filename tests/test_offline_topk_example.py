"""examples/offline_topk_distill.py: a tiny Hugging Face Llama teacher writes a top-k cache (its head split over
2 ranks), and a student with a vocabulary-parallel ``DistillationHead`` trains from it under torchrun on gloo.

The script checks itself; these tests read what it printed and check again: the cache holds the corpus's rows
with the settings asked for; every step's loss from the cache equals the loss of the same training with the
teacher online within the fp16 rounding of the cached log-probabilities; the job on 2 ranks (TP = 2) trains
as the same job in one process (TP = 1) and reports the same cost of the cache against the real teacher, which
is nothing but the fp16 rounding when the cache lists every id; and a cache directory that already holds
shards is refused, finished (``--resume``, the kept shards untouched) or written again (``--replace``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from orda_tp.topk_cache import TopKCacheReader

from .test_examples import torchrun
from .test_launch import REPO_ROOT, run

SCRIPT = "examples/offline_topk_distill.py"
SEQUENCES, SEQ, VOCAB, K, STEPS = 16, 32, 1024, 16, 5
ROWS_PER_SHARD = 96  # the corpus's 512 rows in 6 shards, their boundaries inside batches of 128 rows
SMALL_RUN = [
    "--sequences", str(SEQUENCES), "--batch", "4", "--seq", str(SEQ), "--vocab", str(VOCAB), "--k", str(K),
    "--steps", str(STEPS), "--teacher-steps", "40", "--rows-per-shard", str(ROWS_PER_SHARD),
]  # fmt: skip
FP16_ROUNDING = 2.0**-11  # relative rounding of a value stored in fp16
FLOAT = r"([0-9.eE+-]+)"


class Run(NamedTuple):
    """What a run of the script printed, its per-step losses (from the cache, with the teacher online), where
    its cache is, and what it reported of the cache against the real teacher (the KD term from each, the
    hidden-gradient cosine and size)."""

    stdout: str
    cached: torch.Tensor
    online: torch.Tensor
    cache_dir: Path
    against_teacher: tuple[float, float, float, float]


def parsed(stdout: str, cache_dir: Path, steps: int = STEPS) -> Run:
    """The run's per-step losses, after asserting that it passed its own checks."""
    assert re.search(r"^cache rows PASS", stdout, flags=re.MULTILINE), stdout
    assert re.search(r"^summary: .* check PASS$", stdout, flags=re.MULTILINE), stdout
    losses = re.findall(rf"^step +\d+ \| loss from cache {FLOAT} \| teacher online {FLOAT} \|", stdout, re.M)
    assert len(losses) == steps, stdout
    cached, online = (torch.tensor([float(pair[i]) for pair in losses], dtype=torch.float64) for i in (0, 1))
    cost = re.search(
        rf"^cache vs teacher: KD term {FLOAT} from the cache, {FLOAT} from the dense teacher \(rel {FLOAT}\) \| "
        rf"hidden-gradient cosine {FLOAT}, size {FLOAT} ",
        stdout,
        flags=re.MULTILINE,
    )
    assert cost is not None, stdout
    kd_cache, kd_teacher, _, cosine, size = (float(value) for value in cost.groups())
    return Run(stdout, cached, online, cache_dir, (kd_cache, kd_teacher, cosine, size))


def relative(value: torch.Tensor, expected: torch.Tensor) -> list[float]:
    """Per-step ``|value − expected| / |expected|``."""
    return ((value - expected).abs() / expected.abs()).tolist()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The script under torchrun, 2 ranks on gloo (TP = 2), with small settings."""
    cache_dir = tmp_path_factory.mktemp("tp2") / "cache"
    stdout = torchrun(2, SCRIPT, *SMALL_RUN, "--cache-dir", str(cache_dir))
    assert re.search(r"^offline top-k distillation: TP = 2 on cpu \| vocab 1024 \(512 head rows", stdout, re.M), stdout
    return parsed(stdout, cache_dir)


def test_losses_from_the_cache_equal_the_online_teacher_within_fp16_rounding(two_ranks: Run) -> None:
    errors = relative(two_ranks.cached, two_ranks.online)
    # The first step differs by the cache's rounding alone; the later ones also by the drift it causes.
    assert errors[0] <= FP16_ROUNDING, (errors, two_ranks.stdout)
    assert max(errors) <= 2 * FP16_ROUNDING, (errors, two_ranks.stdout)
    assert torch.isfinite(two_ranks.cached).all() and (two_ranks.cached > 0).all(), two_ranks.stdout


def test_the_cache_holds_the_corpus_rows(two_ranks: Run) -> None:
    reader = TopKCacheReader(two_ranks.cache_dir)  # the cache stays where it was asked to go
    assert reader.num_tokens == SEQUENCES * SEQ
    assert (reader.settings.vocab_size, reader.settings.k, reader.settings.logprob_dtype) == (VOCAB, K, torch.float16)
    ids, logprobs = reader.rows(0, reader.num_tokens)
    assert ids.shape == logprobs.shape == (SEQUENCES * SEQ, K)
    assert ids.min() >= 0 and ids.max() < VOCAB and (logprobs <= 0).all()
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct ids in every row
    assert (logprobs.diff(dim=1) <= 0).all()  # largest first
    assert (logprobs.exp().sum(dim=1) <= 1 + K * FP16_ROUNDING).all()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same job in one process (TP = 1)."""
    cache_dir = tmp_path_factory.mktemp("tp1") / "cache"
    one = parsed(run([sys.executable, str(REPO_ROOT / SCRIPT), *SMALL_RUN, "--cache-dir", str(cache_dir)]), cache_dir)
    assert re.search(r"^offline top-k distillation: TP = 1 on cpu ", one.stdout, flags=re.MULTILINE), one.stdout
    return one


def test_two_ranks_train_as_one_process(two_ranks: Run, one_process: Run) -> None:
    for ours, theirs in ((two_ranks.cached, one_process.cached), (two_ranks.online, one_process.online)):
        assert max(relative(ours, theirs)) <= 2 * FP16_ROUNDING, (ours, theirs)
    # The cache against the real teacher: the same on 2 ranks (each a shard of both heads) as in one process.
    assert two_ranks.against_teacher == pytest.approx(one_process.against_teacher, rel=1e-4), (
        two_ranks.against_teacher,
        one_process.against_teacher,
    )


def test_a_cache_of_every_id_is_the_teacher(tmp_path: Path) -> None:
    """With k = V the cache lists the whole teacher: against the dense teacher it differs by the fp16 rounding
    of its values alone (the top-16 cache is measurably another teacher: the next test)."""
    # The later --k and --steps win.
    every_id = [*SMALL_RUN, "--k", str(VOCAB), "--steps", "1", "--cache-dir", str(tmp_path / "cache")]
    every = parsed(run([sys.executable, str(REPO_ROOT / SCRIPT), *every_id]), tmp_path / "cache", steps=1)
    kd_cache, kd_teacher, cosine, size = every.against_teacher
    assert abs(kd_cache / kd_teacher - 1) <= 4 * FP16_ROUNDING, (kd_cache, kd_teacher)
    assert cosine >= 1 - 1e-5 and abs(size - 1) <= 4 * FP16_ROUNDING, (cosine, size)


def test_top_k_cache_against_the_teacher_is_reported(one_process: Run) -> None:
    kd_cache, kd_teacher, cosine, size = one_process.against_teacher
    assert kd_cache > 0 and kd_teacher > 0 and abs(kd_cache / kd_teacher - 1) > 1e-2, one_process.stdout
    assert 0 < cosine < 1 - 1e-4 and size > 0, one_process.stdout


def shard_files(directory: Path) -> dict[str, tuple[int, int]]:
    """Each shard file's name → (inode, modification time in ns): a rewritten file has a later time."""
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in sorted(directory.glob("topk-*"))}


def test_an_existing_cache_is_refused_resumed_or_replaced(one_process: Run, tmp_path: Path) -> None:
    """A directory with shards: refused without a flag (nothing written), finished by --resume after the
    shards it keeps (left as they are), written again by --replace; each time the rows of the first run."""
    directory = tmp_path / "cache"
    directory.mkdir()
    names = sorted(path.name for path in one_process.cache_dir.glob("topk-*"))
    assert len(names) == 6, names  # 5 shards of 96 rows and one of 32
    for name in names[:3]:  # as a run killed after its third shard leaves the directory: rows [0, 288)
        (directory / name).write_bytes((one_process.cache_dir / name).read_bytes())
    expected = TopKCacheReader(one_process.cache_dir).rows(0, SEQUENCES * SEQ)
    command = [sys.executable, str(REPO_ROOT / SCRIPT), *SMALL_RUN, "--cache-dir", str(directory)]
    kept = shard_files(directory)

    refused = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0, refused.stdout
    assert f"--cache-dir {directory} already holds 3 top-k cache shards" in refused.stderr, refused.stderr
    assert "--resume" in refused.stderr and "--replace" in refused.stderr, refused.stderr
    assert shard_files(directory) == kept  # nothing written, nothing deleted

    resumed = parsed(run([*command, "--resume"]), directory)
    # The batch of rows [256, 384) is extracted again, and its rows from 288 on appended.
    assert "(6 shards, " in resumed.stdout and "288 rows kept, 224 written now" in resumed.stdout, resumed.stdout
    files = shard_files(directory)
    assert {name: files[name] for name in kept} == kept  # the kept shards were not rewritten
    for got, want in zip(TopKCacheReader(directory).rows(0, SEQUENCES * SEQ), expected):
        assert torch.equal(got, want)

    # Kept shards of another extraction (k = 16, not 8) are refused: nothing is appended to them.
    other = subprocess.run(
        [*command, "--k", "8", "--resume"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert other.returncode != 0 and "written with other settings" in other.stderr, other.stderr
    assert re.search(r"k: 16 != 8", other.stderr), other.stderr
    assert shard_files(directory) == files

    replaced = parsed(run([*command, "--replace"]), directory)
    assert f"--replace: deleted the 6 shards in {directory}" in replaced.stdout, replaced.stdout
    assert "0 rows kept, 512 written now" in replaced.stdout, replaced.stdout
    rewritten = shard_files(directory)
    assert rewritten.keys() == files.keys() and all(rewritten[name] != files[name] for name in files)
    for got, want in zip(TopKCacheReader(directory).rows(0, SEQUENCES * SEQ), expected):
        assert torch.equal(got, want)
    assert not [name for name in os.listdir(directory) if name.endswith(".tmp")]
