"""orda_tp.integrations.trl against the real trl 1.16.0 package, on the CPU (TRL's loss runs there
with its torch tiles).

- ``chunked_divergence_loss`` equals TRL's ``_chunked_divergence_loss`` on the same inputs: the
  loss, the entropy sum, the count, and the gradients of the student's hidden states, head weight
  and bias (fp32, 1e-5), over β ∈ {0, 0.1, 0.5, 1}, T ∈ {1, 2, 0.7}, logit scales ≠ 1, soft-caps
  on either side, biases, masks (one all masked), ``num_items_in_batch`` None / int / tensor, and
  student and teacher of different widths; the teacher gets no gradient, as in TRL.
- TRL's ``DistillationTrainer`` end to end (examples/trl_distill.py: tiny Llama student and teacher
  built from configs, completions from ``generate``, two optimizer steps with gradient
  accumulation): with TRL's loss and with :class:`OrdaDistillationTrainer`, the logged losses and
  entropies and the student's parameters after the steps agree within fp32 rounding, for β = 0, 0.5
  and 1 with biased heads, a configured logit scale and a final soft-cap; the example's own
  ``--compare`` run prints the same agreement.
- Under autocast both run their GEMMs in its dtype (bf16) and agree within its rounding.
- The swap is undone after its block, and a TRL whose loss takes other arguments is refused.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip("trl")

import trl.trainer.distillation_trainer as trl_distillation  # noqa: E402
from trl import DistillationTrainer  # noqa: E402

from orda_tp.integrations import trl as orda_trl  # noqa: E402

from .support.examples import load_example  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PATH = REPO_ROOT / "examples" / "trl_distill.py"
TRL_LOSS = trl_distillation._chunked_divergence_loss
BATCH, POSITIONS, STUDENT_WIDTH, TEACHER_WIDTH, VOCAB = 3, 7, 16, 24, 301
# Per case: logit scales, final soft-caps and which heads carry a bias (student, teacher).
HEAD_SETTINGS = {
    "plain": ((1.0, 1.0), (None, None), (False, False)),
    "scaled, capped, biased": ((0.7, 1.3), (5.0, 4.0), (True, True)),
    "teacher capped, student biased": ((1.25, 1.0), (None, 3.0), (True, False)),
}


def make_inputs(seed: int, settings: str, all_masked: bool = False) -> dict[str, Any]:
    """TRL's keyword arguments for one random case (the student's tensors require gradients)."""
    generator = torch.Generator().manual_seed(seed)
    scales, caps, biased = HEAD_SETTINGS[settings]

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=generator) * scale

    mask = (torch.rand(BATCH, POSITIONS, generator=generator) < 0.7).long()
    if all_masked:
        mask.zero_()
    student_bias = randn(VOCAB, scale=0.2).requires_grad_() if biased[0] else None
    return {
        "student_hidden_states": randn(BATCH, POSITIONS, STUDENT_WIDTH).requires_grad_(),
        "teacher_hidden_states": randn(BATCH, POSITIONS, TEACHER_WIDTH),
        "student_lm_head_weight": randn(VOCAB, STUDENT_WIDTH, scale=0.4).requires_grad_(),
        "teacher_lm_head_weight": randn(VOCAB, TEACHER_WIDTH, scale=0.4),
        "completion_mask": mask,
        "student_lm_head_bias": student_bias,
        "teacher_lm_head_bias": randn(VOCAB, scale=0.2) if biased[1] else None,
        "student_logit_scale": scales[0],
        "teacher_logit_scale": scales[1],
        "student_final_logit_softcapping": caps[0],
        "teacher_final_logit_softcapping": caps[1],
    }


def outputs_and_grads(loss_fn: Any, inputs: dict[str, Any], **call: Any) -> dict[str, Tensor]:
    """``loss_fn``'s three outputs and the student's gradients, on fresh copies of ``inputs``."""
    copies = {
        name: value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, Tensor) else value
        for name, value in inputs.items()
    }
    loss, entropy_sum, n_valid = loss_fn(**copies, **call)
    loss.backward()
    found = {"loss": loss.detach(), "entropy_sum": entropy_sum, "n_valid": n_valid}
    for name in ("student_hidden_states", "student_lm_head_weight", "student_lm_head_bias"):
        tensor = copies[name]
        if tensor is not None:
            found[f"grad {name}"] = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
    return found


CASES = [
    pytest.param(beta, temperature, settings, items, id=f"beta={beta}-T={temperature}-{settings}-items={items}")
    for beta, temperature, settings, items in itertools.product(
        (0.0, 0.1, 0.5, 1.0), (1.0, 2.0, 0.7), HEAD_SETTINGS, ("none", "int", "tensor")
    )
    # Every β, T and head setting; each count kind with every β.
    if (temperature, settings) in {(1.0, "plain"), (2.0, "scaled, capped, biased")}
    or (items == "int" and settings != "plain")
]


@pytest.mark.parametrize("beta, temperature, settings, items", CASES)
def test_equals_trl_loss(beta: float, temperature: float, settings: str, items: str) -> None:
    # A seed of its own per case, the same in every process (str hashes are salted per process).
    seed = int(1000 * beta) + 10 * int(10 * temperature) + list(HEAD_SETTINGS).index(settings) + 3 * len(items)
    inputs = make_inputs(seed=seed, settings=settings)
    count = {"none": None, "int": 11, "tensor": torch.tensor(9.0)}[items]
    call = {"beta": beta, "temperature": temperature, "num_items_in_batch": count}
    expected = outputs_and_grads(TRL_LOSS, inputs, **call)
    found = outputs_and_grads(orda_trl.chunked_divergence_loss, inputs, **call)
    assert found.keys() == expected.keys()
    assert found["n_valid"].dtype == expected["n_valid"].dtype == torch.int64
    assert not found["entropy_sum"].requires_grad
    for name, value in expected.items():
        # fp32 rounding, relative to the tensor's largest entry (a gradient's tiny entries cancel).
        scale = value.abs().max().item() if value.is_floating_point() else 0.0
        message = lambda text, n=name: f"{n}: {text}"  # noqa: E731
        torch.testing.assert_close(found[name], value, rtol=1e-5, atol=1e-5 * scale, msg=message)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_masked_batch_is_zero_like_trl(beta: float) -> None:
    inputs = make_inputs(seed=3, settings="scaled, capped, biased", all_masked=True)
    expected = outputs_and_grads(TRL_LOSS, inputs, beta=beta)
    found = outputs_and_grads(orda_trl.chunked_divergence_loss, inputs, beta=beta)
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=0, atol=0)


def test_under_autocast_the_gemms_run_in_its_dtype_as_trl() -> None:
    inputs = make_inputs(seed=7, settings="scaled, capped, biased")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = outputs_and_grads(TRL_LOSS, inputs, beta=0.5)
        found = outputs_and_grads(orda_trl.chunked_divergence_loss, inputs, beta=0.5)
    exact = outputs_and_grads(orda_trl.chunked_divergence_loss, inputs, beta=0.5)
    for name, value in expected.items():
        assert found[name].dtype == value.dtype, name  # gradients in the fp32 leaves' dtype
        if value.is_floating_point():
            # Both within bf16's rounding of each other, and ours off the fp32 result (it ran in bf16).
            assert (found[name] - value).norm() / value.norm() < 5e-3, name
            assert (found[name] - exact[name]).norm() / exact[name].norm() > 1e-6, name


def test_teacher_gets_no_gradient() -> None:
    inputs = make_inputs(seed=5, settings="scaled, capped, biased")
    inputs["teacher_lm_head_weight"].requires_grad_()
    loss, _, _ = orda_trl.chunked_divergence_loss(**inputs, beta=0.5, temperature=2.0)
    loss.backward()
    assert inputs["teacher_lm_head_weight"].grad is None
    assert inputs["student_lm_head_weight"].grad is not None


def test_the_swap_is_undone_after_its_block() -> None:
    with orda_trl.orda_divergence_loss():
        assert trl_distillation._chunked_divergence_loss is orda_trl.chunked_divergence_loss
        with pytest.raises(KeyError):
            with orda_trl.orda_divergence_loss():
                raise KeyError("inside")
        assert trl_distillation._chunked_divergence_loss is orda_trl.chunked_divergence_loss
    assert trl_distillation._chunked_divergence_loss is TRL_LOSS


def test_a_trl_loss_with_other_arguments_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def renamed(student_hidden_states: Tensor, teacher_hidden_states: Tensor, mask: Tensor) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(trl_distillation, "_chunked_divergence_loss", renamed)
    with pytest.raises(RuntimeError, match=r"tested with trl==1\.16\.0"):
        with orda_trl.orda_divergence_loss():
            pass
    assert trl_distillation._chunked_divergence_loss is renamed


# --- TRL's DistillationTrainer end to end ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_trainer_end_to_end_equals_trl(
    beta: float, temperature: float, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_example("trl_distill.py")
    args = argparse.Namespace(beta=beta, temperature=temperature, steps=2)
    expected_log, expected_params = example.train(DistillationTrainer, args, str(tmp_path))
    calls = []
    orda_loss = orda_trl.chunked_divergence_loss

    @functools.wraps(orda_loss)  # the swap checks the signature it stands in with
    def counted(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
        calls.append(kwargs["beta"] if "beta" in kwargs else args[5])
        return orda_loss(*args, **kwargs)

    monkeypatch.setattr(orda_trl, "chunked_divergence_loss", counted)
    found_log, found_params = example.train(orda_trl.OrdaDistillationTrainer, args, str(tmp_path))
    assert calls == [beta] * 4  # 2 steps × 2 micro-batches went through orda_tp
    assert len(found_log) == len(expected_log) == 2
    for found, expected in zip(found_log, expected_log):
        assert found["loss"] == pytest.approx(expected["loss"], rel=2e-5)
        assert found["entropy"] == pytest.approx(expected["entropy"], rel=1e-5)
    assert found_params.keys() == expected_params.keys()
    for name, value in expected_params.items():
        torch.testing.assert_close(
            found_params[name], value, rtol=0, atol=1e-6, msg=lambda text, n=name: f"{n}: {text}"
        )
    assert trl_distillation._chunked_divergence_loss is TRL_LOSS


def test_the_example_runs_and_matches_trl() -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE_PATH), "--compare", "--steps", "3"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    ours = re.findall(r"^step (\d+): loss (\S+) entropy (\S+)$", run.stdout, re.M)
    theirs = re.findall(r"^TRL's loss, step (\d+): loss (\S+) entropy (\S+)$", run.stdout, re.M)
    assert [step for step, _, _ in ours] == [step for step, _, _ in theirs] == ["1", "2", "3"]
    for (_, loss, entropy), (_, trl_loss, trl_entropy) in zip(ours, theirs):
        assert float(loss) == pytest.approx(float(trl_loss), rel=1e-4)
        assert float(entropy) == pytest.approx(float(trl_entropy), rel=1e-5)
    largest = re.search(r"largest parameter difference after 3 steps: (\S+)", run.stdout)
    assert largest is not None and float(largest.group(1)) <= 1e-6, run.stdout
