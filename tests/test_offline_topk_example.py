"""examples/offline_topk_distill.py: a tiny Hugging Face Llama teacher writes a top-k cache (its head split over
2 ranks), and a student with a vocabulary-parallel ``DistillationHead`` trains from it under torchrun on gloo.

The script checks itself; these tests read what it printed and check again: the cache holds the corpus's rows
with the settings asked for; every step's loss from the cache equals the loss of the same training with the
teacher online within the fp16 rounding of the cached log-probabilities; and the job on 2 ranks (TP = 2) trains
as the same job in one process (TP = 1).
"""

from __future__ import annotations

import re
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
SMALL_RUN = [
    "--sequences", str(SEQUENCES), "--batch", "4", "--seq", str(SEQ), "--vocab", str(VOCAB), "--k", str(K),
    "--steps", str(STEPS), "--teacher-steps", "40",
]  # fmt: skip
FP16_ROUNDING = 2.0**-11  # relative rounding of a value stored in fp16
FLOAT = r"([0-9.eE+-]+)"


class Run(NamedTuple):
    """What a run of the script printed, its per-step losses (from the cache, with the teacher online) and
    where its cache is."""

    stdout: str
    cached: torch.Tensor
    online: torch.Tensor
    cache_dir: Path


def parsed(stdout: str, cache_dir: Path) -> Run:
    """The run's per-step losses, after asserting that it passed its own checks."""
    assert re.search(r"^cache rows PASS", stdout, flags=re.MULTILINE), stdout
    assert re.search(r"^summary: .* check PASS$", stdout, flags=re.MULTILINE), stdout
    steps = re.findall(rf"^step +\d+ \| loss from cache {FLOAT} \| teacher online {FLOAT} \|", stdout, re.M)
    assert len(steps) == STEPS, stdout
    cached, online = (torch.tensor([float(pair[i]) for pair in steps], dtype=torch.float64) for i in (0, 1))
    return Run(stdout, cached, online, cache_dir)


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


def test_two_ranks_train_as_one_process(two_ranks: Run, tmp_path: Path) -> None:
    one = parsed(
        run([sys.executable, str(REPO_ROOT / SCRIPT), *SMALL_RUN, "--cache-dir", str(tmp_path / "cache")]),
        tmp_path / "cache",
    )
    assert re.search(r"^offline top-k distillation: TP = 1 on cpu ", one.stdout, flags=re.MULTILINE), one.stdout
    for ours, theirs in ((two_ranks.cached, one.cached), (two_ranks.online, one.online)):
        assert max(relative(ours, theirs)) <= 2 * FP16_ROUNDING, (ours, theirs)
