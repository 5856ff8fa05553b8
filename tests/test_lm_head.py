"""orda_tp.DistillationHead on one process: an nn.Linear LM head whose forward with labels is the loss.

Compared, in fp64, with nn.Linear (state dict, logits) and with orda_tp.distillation_loss on the
flattened rows (values and gradients); under torch.compile against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orda_tp

HIDDEN, VOCAB = 8, 37
LOSS = {"kl_weight": 0.5, "kl_temperature": 2.0, "teacher_ce_weight": 0.0, "kl_divergence": "reverse"}


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [2, 5, H], labels [2, 5] with ignored positions, teacher hidden [2, 5, H]), fp64."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, 5), generator=generator)
    labels[0, -1] = labels[1, 2] = -100
    return hidden, labels, torch.randn(2, 5, HIDDEN, generator=generator, dtype=torch.float64)


def test_state_dict_and_logits_match_nn_linear() -> None:
    linear = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, **LOSS)
    assert head.state_dict().keys() == linear.state_dict().keys() == {"weight"}
    head.load_state_dict(linear.state_dict())
    hidden, _, _ = batch()
    assert torch.equal(head(hidden), linear(hidden))
    linear.load_state_dict(head.state_dict())
    assert torch.equal(linear.weight, head.weight)


def test_from_linear_keeps_the_parameter_so_tied_weights_stay_tied() -> None:
    embedding = nn.Embedding(VOCAB, HIDDEN)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False)
    linear.weight = embedding.weight
    head = orda_tp.DistillationHead.from_linear(linear, **LOSS)
    assert head.weight is embedding.weight
    with pytest.raises(ValueError, match="has a bias"):
        orda_tp.DistillationHead.from_linear(nn.Linear(HIDDEN, VOCAB))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_equals_distillation_loss_on_flattened_rows(reduction: str) -> None:
    hidden, labels, teacher_hidden = batch()
    head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, reduction=reduction, **LOSS)
    got_hidden = hidden.clone().requires_grad_()
    out = head(got_hidden, labels=labels, teacher=orda_tp.TiedTeacher(teacher_hidden.reshape(-1, HIDDEN)))
    assert isinstance(out, orda_tp.HeadOutput) and isinstance(out, orda_tp.DistillationLossOutput)
    out.loss.sum().backward()

    weight = head.weight.detach().clone().requires_grad_()
    want_hidden = hidden.clone().requires_grad_()
    want = orda_tp.distillation_loss(
        want_hidden.reshape(-1, HIDDEN), weight, labels.reshape(-1),
        orda_tp.TiedTeacher(teacher_hidden.reshape(-1, HIDDEN)), backend="reference", reduction=reduction, **LOSS,
    )  # fmt: skip
    want.loss.sum().backward()
    for got_value, want_value in zip(out, want):
        assert got_value.shape == (labels.shape if reduction == "none" else ())
        torch.testing.assert_close(got_value, want_value.reshape(got_value.shape), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_hidden.grad, want_hidden.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(head.weight.grad, weight.grad, rtol=1e-12, atol=1e-14)


def test_without_teacher_a_head_with_no_teacher_term_is_the_student_cross_entropy() -> None:
    hidden, labels, _ = batch()
    head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, kl_weight=0.0, teacher_ce_weight=0.0)
    out = head(hidden, labels=labels)
    expected = F.cross_entropy(head(hidden).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"needs teacher=.*kl_weight=0.0, teacher_ce_weight=1.0"):
        orda_tp.DistillationHead(HIDDEN, VOCAB, teacher_ce_weight=1.0)(hidden.float(), labels=labels)


def test_teacher_head_module_equals_separate_teacher() -> None:
    hidden, labels, _ = batch()
    teacher_hidden = torch.randn(10, HIDDEN + 3, dtype=torch.float64)
    teacher_head = nn.Linear(HIDDEN + 3, VOCAB, bias=False, dtype=torch.float64).requires_grad_(False)
    head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, **LOSS)
    got = head(hidden, labels=labels, teacher=orda_tp.TeacherHead(teacher_hidden, teacher_head))
    want = head(hidden, labels=labels, teacher=orda_tp.SeparateTeacher(teacher_hidden, teacher_head.weight))
    assert torch.equal(got.loss, want.loss) and torch.equal(got.kl, want.kl)


def test_under_torch_compile_equals_eager() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
            self.lm_head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, **LOSS)

        def forward(self, inputs: torch.Tensor, labels: torch.Tensor, teacher_hidden: torch.Tensor) -> object:
            teacher = orda_tp.TiedTeacher(teacher_hidden.reshape(-1, HIDDEN))
            return self.lm_head(torch.tanh(self.body(inputs)), labels=labels, teacher=teacher)

    torch.manual_seed(0)
    model = Model()
    hidden, labels, teacher_hidden = batch()
    eager = model(hidden, labels, teacher_hidden)
    eager.loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model)(hidden, labels, teacher_hidden)
    compiled.loss.backward()
    assert isinstance(compiled, orda_tp.HeadOutput)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-12, atol=0)
    for parameter, grad in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-12, atol=1e-15)


def test_bad_calls_raise() -> None:
    hidden, labels, teacher_hidden = batch()
    teacher = orda_tp.TiedTeacher(teacher_hidden.reshape(-1, HIDDEN))
    head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, **LOSS)
    with pytest.raises(ValueError, match=r"labels must have hidden's leading shape \(2, 5\)"):
        head(hidden, labels=labels.reshape(-1), teacher=teacher)
    with pytest.raises(ValueError, match="needs teacher="):
        head(hidden, labels=labels)
    with pytest.raises(ValueError, match="need labels="):
        head(hidden, teacher=teacher)
    with pytest.raises(TypeError):
        head(hidden, labels, teacher)  # labels and teacher are keyword-only
    with pytest.raises(ValueError, match="kl_temperature must be a finite real number > 0"):
        orda_tp.DistillationHead(HIDDEN, VOCAB, kl_temperature=0.0)
    with pytest.raises(TypeError, match="TeacherHead.head must have a 2-D weight"):
        orda_tp.TeacherHead(teacher_hidden.reshape(-1, HIDDEN), nn.ReLU())
    assert torch.equal(head(hidden), F.linear(hidden, head.weight))
