"""The orda-kernel README examples run unchanged against orda_tp.

The example code below is the seed README's, verbatim, except that ``device="cuda"`` reads
``device="cpu"`` and the sizes are smaller (CPU test time). ``orda_kernel`` is orda_tp itself.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import orda_tp

FUNCTIONAL = """
import torch
from orda_kernel import distillation_loss, TiedTeacher

bt, hidden, vocab = 4096, 2048, 32000
student_hidden = torch.randn(bt, hidden, device="cuda", requires_grad=True)
weight = torch.randn(vocab, hidden, device="cuda", requires_grad=True)
labels = torch.randint(0, vocab, (bt,), device="cuda")

teacher_hidden = torch.randn(bt, hidden, device="cuda")

out = distillation_loss(
    student_hidden,
    weight,
    labels,
    TiedTeacher(hidden=teacher_hidden),
    student_ce_weight=1.0,
    kl_weight=1.0,
    kl_temperature=2.0,
    kl_divergence="forward",
)

out.loss.backward()
print(out.loss, out.student_ce, out.kl)
"""

MODULE = """
from orda_kernel import DistillationLoss, SeparateTeacher

criterion = DistillationLoss(
    student_ce_weight=1.0,
    teacher_ce_weight=0.0,
    kl_weight=1.0,
    kl_temperature=2.0,
    kl_divergence="jeffreys",
    reduction="mean",
)

out = criterion(
    student_hidden,
    weight,
    labels,
    SeparateTeacher(hidden=teacher_hidden, weight=teacher_weight),
)
out.loss.backward()
"""

SPANS = """
from orda_kernel import (
    AlignedLikelihoodConfig, AlignedSpanPairs,
    aligned_span_distillation_loss, build_precomputed_span_teacher,
)

pairs = AlignedSpanPairs(student_ranges, teacher_ranges)  # int [C, 2] half-open

span_teacher = build_precomputed_span_teacher(
    teacher_hidden, teacher_weight, teacher_labels, pairs.teacher_ranges,
)
out = aligned_span_distillation_loss(
    student_hidden, student_weight, student_labels,
    span_teacher, pairs,
    AlignedLikelihoodConfig(span_kl_weight=0.7),
)
out.loss.backward()
"""


def run(source: str, namespace: dict[str, object]) -> dict[str, object]:
    code = source.replace('device="cuda"', 'device="cpu"').replace("4096, 2048, 32000", "64, 32, 500")
    exec(compile(textwrap.dedent(code), "<seed example>", "exec"), namespace)
    return namespace


@pytest.fixture(autouse=True)
def orda_kernel_is_orda_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "orda_kernel", orda_tp)


def test_functional_example() -> None:
    ns = run(FUNCTIONAL, {})
    out, hidden, weight, labels = ns["out"], ns["student_hidden"], ns["weight"], ns["labels"]
    logits = (hidden @ weight.T).detach()
    assert torch.allclose(out.student_ce, torch.nn.functional.cross_entropy(logits, labels), rtol=1e-5)
    assert hidden.grad is not None and weight.grad is not None and out.kl > 0


def test_module_example() -> None:
    generator = torch.Generator().manual_seed(0)
    ns: dict[str, object] = {
        "student_hidden": torch.randn(64, 32, generator=generator, requires_grad=True),
        "weight": torch.randn(500, 32, generator=generator, requires_grad=True),
        "labels": torch.randint(0, 500, (64,), generator=generator),
        "teacher_hidden": torch.randn(64, 48, generator=generator),
        "teacher_weight": torch.randn(500, 48, generator=generator),
    }
    ns = run(MODULE, ns)
    out = ns["out"]
    expected = orda_tp.distillation_loss(
        ns["student_hidden"],
        ns["weight"],
        ns["labels"],
        orda_tp.SeparateTeacher(ns["teacher_hidden"], ns["teacher_weight"]),
        teacher_ce_weight=0.0,
        kl_weight=1.0,
        kl_temperature=2.0,
        kl_divergence="jeffreys",
        backend="reference",
    )
    assert torch.allclose(out.loss, expected.loss, rtol=1e-5)
    assert ns["student_hidden"].grad is not None


def test_span_example() -> None:
    generator = torch.Generator().manual_seed(1)
    ns: dict[str, object] = {
        "student_hidden": torch.randn(12, 16, generator=generator, requires_grad=True),
        "student_weight": torch.randn(50, 16, generator=generator, requires_grad=True),
        "student_labels": torch.randint(0, 50, (12,), generator=generator),
        "teacher_hidden": torch.randn(10, 8, generator=generator),
        "teacher_weight": torch.randn(70, 8, generator=generator),
        "teacher_labels": torch.randint(0, 70, (10,), generator=generator),
        "student_ranges": torch.tensor([[0, 3], [3, 7], [7, 12]]),
        "teacher_ranges": torch.tensor([[0, 2], [2, 6], [6, 10]]),
    }
    ns = run(SPANS, ns)
    assert torch.isfinite(ns["out"].loss) and ns["student_hidden"].grad is not None
