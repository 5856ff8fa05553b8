"""examples/mixture_distill.py: two specialist teachers of different widths (tiny Hugging Face Llamas, each
pre-trained on its own domain) distil one student through one ``TeacherMixture``, the student's head and both
teachers' heads split over 2 ranks under torchrun on gloo.

The script checks every step against the same loss on one device; these tests read what it printed and check
again: the check passed, each teacher is the specialist of its domain, and the job on 2 ranks (TP = 2) trains as
the same job in one process (TP = 1), the same loss and KL at every step within 1e-5 relatively, for weights
routed by domain under ``combine="divergences"`` and dense weights under ``combine="probabilities"``.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from .test_examples import torchrun
from .test_launch import REPO_ROOT, run

SCRIPT = "examples/mixture_distill.py"
STEPS = 4
SMALL_RUN = ["--steps", str(STEPS), "--teacher-steps", "30", "--sequences", "16", "--batch", "4", "--vocab", "512"]
# The fp32 rounding of the split sums, and its drift through a few AdamW steps (measured: about 1e-7).
TOLERANCE = 1e-5
FLOAT = r"([0-9.eE+-]+)"


def step_values(stdout: str, ranks: int, mixing: str) -> torch.Tensor:
    """The run's ``(steps, 2)`` losses and KL terms, after asserting its settings (``mixing``: the combine mode
    and the weights, as its first line says them) and that it passed its check."""
    header = rf"^teacher mixture distillation: TP = {ranks} on cpu \| .* \| {re.escape(mixing)}\b"
    assert re.search(header, stdout, flags=re.MULTILINE), stdout
    assert re.search(rf"^check PASS max_rel_err {FLOAT} tol 1e-05 ", stdout, flags=re.MULTILINE), stdout
    values = re.findall(rf"^step +\d+ \| loss {FLOAT} \| kl {FLOAT} \|", stdout, flags=re.MULTILINE)
    assert len(values) == STEPS, stdout
    return torch.tensor([[float(value) for value in pair] for pair in values], dtype=torch.float64)


def held_out_ces(stdout: str) -> list[tuple[float, float]]:
    """Each teacher's held-out CE on domain 0 and on domain 1, teacher A first."""
    found = re.findall(rf"^teacher [AB]: .* held-out CE: domain 0 {FLOAT}, domain 1 {FLOAT} ", stdout, re.M)
    assert len(found) == 2, stdout
    return [(float(zero), float(one)) for zero, one in found]


@pytest.mark.parametrize(
    ("options", "mixing"),
    [
        (["--combine", "divergences"], "combine divergences, routed"),
        (["--combine", "probabilities", "--no-routing"], "combine probabilities, dense"),
    ],
    ids=["routed-divergences", "dense-probabilities"],
)
def test_two_ranks_train_as_one_process(options: list[str], mixing: str) -> None:
    two_ranks = torchrun(2, SCRIPT, *SMALL_RUN, *options)
    one_process = run([sys.executable, str(REPO_ROOT / SCRIPT), *SMALL_RUN, *options])
    (a_on_0, a_on_1), (b_on_0, b_on_1) = held_out_ces(two_ranks)
    assert a_on_0 < a_on_1 and b_on_1 < b_on_0, two_ranks  # teacher A knows domain 0, teacher B domain 1
    ours, theirs = step_values(two_ranks, 2, mixing), step_values(one_process, 1, mixing)
    assert torch.isfinite(ours).all() and (ours > 0).all(), two_ranks
    errors = (ours - theirs).abs() / theirs.abs()
    assert errors.max().item() <= TOLERANCE, (errors, two_ranks, one_process)
