"""examples/offline_topk_distill.py: a tiny Hugging Face Llama teacher writes a top-k cache (its head split over
2 ranks), and a student with a vocabulary-parallel ``DistillationHead`` trains from it under torchrun on gloo.

The script checks itself; this test reads what it printed and checks again: the cache holds the corpus's rows
with the settings asked for, and every step's loss from the cache equals the loss of the same training with the
teacher online within the fp16 rounding of the cached log-probabilities.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from orda_tp.topk_cache import TopKCacheReader

from .test_examples import torchrun

SEQUENCES, SEQ, VOCAB, K, STEPS = 16, 32, 1024, 16, 5
SMALL_RUN = [
    "--sequences", str(SEQUENCES), "--batch", "4", "--seq", str(SEQ), "--vocab", str(VOCAB), "--k", str(K),
    "--steps", str(STEPS), "--teacher-steps", "40",
]  # fmt: skip
FP16_ROUNDING = 2.0**-11  # relative rounding of a value stored in fp16
FLOAT = r"([0-9.eE+-]+)"


def test_student_trained_from_the_cache_matches_the_online_teacher(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    stdout = torchrun(2, "examples/offline_topk_distill.py", *SMALL_RUN, "--cache-dir", str(cache_dir))
    assert re.search(r"^offline top-k distillation: TP = 2 on cpu \| vocab 1024 \(512 head rows", stdout, re.M), stdout
    assert re.search(r"^cache rows PASS", stdout, flags=re.MULTILINE), stdout
    assert re.search(r"^summary: .* check PASS$", stdout, flags=re.MULTILINE), stdout

    steps = re.findall(rf"^step +\d+ \| loss from cache {FLOAT} \| teacher online {FLOAT} \|", stdout, re.M)
    assert len(steps) == STEPS, stdout
    cached, online = (torch.tensor([float(pair[i]) for pair in steps], dtype=torch.float64) for i in (0, 1))
    relative = ((cached - online).abs() / online.abs()).tolist()
    # The first step differs by the cache's rounding alone; the later ones also by the drift it causes.
    assert relative[0] <= FP16_ROUNDING, (relative, stdout)
    assert max(relative) <= 2 * FP16_ROUNDING, (relative, stdout)
    assert torch.isfinite(cached).all() and (cached > 0).all(), stdout

    reader = TopKCacheReader(cache_dir)  # the cache stays where it was asked to go
    assert reader.num_tokens == SEQUENCES * SEQ
    assert (reader.settings.vocab_size, reader.settings.k, reader.settings.logprob_dtype) == (VOCAB, K, torch.float16)
    ids, logprobs = reader.rows(0, reader.num_tokens)
    assert ids.shape == logprobs.shape == (SEQUENCES * SEQ, K)
    assert ids.min() >= 0 and ids.max() < VOCAB and (logprobs <= 0).all()
    assert (logprobs.exp().sum(dim=1) <= 1 + K * FP16_ROUNDING).all()
