"""examples/hf_trainer_distill.py: a transformers ``Trainer`` whose ``compute_loss`` is a
``DistillationHead`` loss.

- The hidden states the example reads are the ones the model's own ``lm_head`` receives.
- ``compute_loss`` equals a float64 full-logits reference (``F.cross_entropy`` + ``T²·KL``), also
  with the Trainer's ``num_items_in_batch`` as denominator.
- One optimizer step over 4 sequences gives the same gradients with batch 4 × accumulation 1, batch
  2 × accumulation 2, and 2 DDP ranks × batch 2 (gloo), although the micro-batches hold different
  numbers of tokens.
- The replaced head keeps the model's behaviour: logits, tied embeddings, ``generate``, checkpoints.
- The script runs end to end and its loss falls.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaForCausalLM, TrainerCallback, default_data_collator

import orda_tp

from .support.distributed import run_distributed
from .support.examples import load_example

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PATH = REPO_ROOT / "examples" / "hf_trainer_distill.py"
FLOAT = r"([0-9.eE+-]+)"
# Real tokens per sequence: 13, 11, 6 and 2 prediction targets, so any two micro-batches of two
# sequences hold different numbers of tokens (24/8, 19/13 or 15/17).
UNEVEN_LENGTHS = (16, 14, 9, 5)


example = load_example("hf_trainer_distill.py")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: one thread is fastest, and the CI machine's 2 cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def uneven_batch() -> dict[str, Tensor]:
    """The 4 sequences of :data:`UNEVEN_LENGTHS`, collated as the Trainer collates them."""
    return default_data_collator(example.make_dataset(lengths=UNEVEN_LENGTHS))


def final_norm_hidden(model: LlamaForCausalLM, batch: dict[str, Tensor]) -> Tensor:
    """The decoder's output after its final norm, from the base model."""
    return model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state


def reference_loss(
    student: LlamaForCausalLM, teacher: LlamaForCausalLM, batch: dict[str, Tensor], denominator: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, student CE, KL)`` from the full shifted logits, in plain torch:
    ``loss = (Σ CE + kl_weight · T² · Σ KL(q‖p)) / N`` over the positions whose next label is not -100,
    ``p = softmax(s / T)`` the student's, ``q = softmax(t / T)`` the teacher's; N = ``denominator``
    or the number of such positions."""
    options = example.LOSS_OPTIONS
    temperature = options["kl_temperature"]
    student_logits = final_norm_hidden(student, batch)[:, :-1] @ student.lm_head.weight.T
    teacher_logits = final_norm_hidden(teacher, batch)[:, :-1] @ teacher.lm_head.weight.T
    labels = batch["labels"][:, 1:]
    valid = labels != -100
    ce = F.cross_entropy(student_logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    log_p = torch.log_softmax(student_logits / temperature, dim=-1)
    log_q = torch.log_softmax(teacher_logits / temperature, dim=-1)
    kl_rows = (log_q.exp() * (log_q - log_p)).sum(dim=-1)
    kl = temperature**2 * kl_rows[valid].sum()
    n = valid.sum() if denominator is None else denominator
    loss = (options["student_ce_weight"] * ce + options["kl_weight"] * kl) / n
    return loss, ce / n, kl / n


def relative_error(got: Tensor, want: Tensor) -> float:
    """``‖got − want‖ / ‖want‖``."""
    return float((got.detach() - want.detach()).norm() / want.detach().norm())


def float64_trainer(output_dir: Path) -> tuple[Any, LlamaForCausalLM, LlamaForCausalLM]:
    """``(DistillationTrainer, teacher, student)`` of float64 models, not trained."""
    teacher, student = example.build_models(torch.float64)
    trainer = example.DistillationTrainer(
        model=student, args=example.training_arguments(str(output_dir)), teacher=teacher
    )
    return trainer, teacher, student


class GradientRecorder(TrainerCallback):
    """Keeps a copy of every parameter's gradient just before the first optimizer step."""

    def __init__(self) -> None:
        self.gradients: dict[str, Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        if not self.gradients:
            self.gradients = {
                name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
            }


class FirstStep(NamedTuple):
    """What :func:`first_step` observed."""

    gradients: dict[str, Tensor]  # every parameter's gradient, before the optimizer step
    logged_loss: float  # the training loss the Trainer logged for the step
    world_size: int  # data-parallel ranks
    wrapper: str  # the class of the module the Trainer ran (DistributedDataParallel under DDP)


def first_step(output_dir: str, per_device_batch: int, accumulation: int) -> FirstStep:
    """The first optimizer step of a float64 distillation over the :data:`UNEVEN_LENGTHS`
    sequences (gradient clipping off)."""
    teacher, student = example.build_models(torch.float64)
    recorder = GradientRecorder()
    trainer = example.DistillationTrainer(
        model=student,
        args=example.training_arguments(
            output_dir,
            max_steps=1,
            per_device_train_batch_size=per_device_batch,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=0.0,
            logging_steps=1,
        ),
        train_dataset=example.make_dataset(lengths=UNEVEN_LENGTHS),
        teacher=teacher,
        callbacks=[recorder],
    )
    trainer.train()
    loss = example.logged_losses(trainer)[0]
    return FirstStep(recorder.gradients, loss, trainer.args.world_size, type(trainer.model_wrapped).__name__)


def data_parallel_first_step(rank: int, world_size: int, output_dir: str) -> FirstStep:
    """Worker: :func:`first_step` with batch 2 per rank, on an already joined gloo group (which
    accelerate adopts; it reads the rank layout from these variables)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    return first_step(os.path.join(output_dir, str(rank)), per_device_batch=2, accumulation=1)


def input_recorder(store: dict[str, Tensor], name: str) -> Callable[[nn.Module, tuple[Tensor, ...], object], None]:
    """A forward hook that keeps the module's first input under ``store[name]`` (and returns None:
    a forward hook's return value would replace the module's output)."""

    def hook(module: nn.Module, args: tuple[Tensor, ...], output: object) -> None:
        store[name] = args[0]

    return hook


def test_lm_head_input_is_the_final_norm_output() -> None:
    teacher, student = example.build_models()
    batch = uneven_batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    received: dict[str, Tensor] = {}
    hooks = [
        module.register_forward_hook(input_recorder(received, name))
        for name, module in [("head", student.lm_head), ("norm", student.model.norm)]
    ]
    try:
        student(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        read = example.final_hidden_states(student, inputs)
    assert torch.equal(read, received["head"])
    assert torch.equal(read, final_norm_hidden(student, batch))
    assert not torch.equal(read, received["norm"]) and torch.equal(read, student.model.norm(received["norm"]))


@pytest.mark.parametrize("num_items_in_batch", [None, 45])
def test_compute_loss_matches_full_logits_reference(tmp_path: Path, num_items_in_batch: int | None) -> None:
    # 45 stands for the count of an accumulated batch larger than this one (32 tokens).
    trainer, teacher, student = float64_trainer(tmp_path)
    batch = uneven_batch()
    count = None if num_items_in_batch is None else torch.tensor(num_items_in_batch)
    loss, out = trainer.compute_loss(student, batch, return_outputs=True, num_items_in_batch=count)
    with torch.no_grad():
        want_loss, want_ce, want_kl = reference_loss(student, teacher, batch, num_items_in_batch)
    assert loss.dtype == torch.float64 and want_kl > 0
    assert relative_error(loss, want_loss) < 1e-12
    assert relative_error(out.student_ce, want_ce) < 1e-12
    assert relative_error(out.kl, want_kl) < 1e-12


def test_compute_loss_gradients_match_full_logits_reference(tmp_path: Path) -> None:
    trainer, teacher, student = float64_trainer(tmp_path)
    batch = uneven_batch()
    trainer.compute_loss(student, batch, num_items_in_batch=torch.tensor(45)).backward()
    got = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad()
    reference_loss(student, teacher, batch, 45)[0].backward()
    assert got.keys() == {name for name, p in student.named_parameters() if p.grad is not None}
    # LlamaRMSNorm computes in float32 whatever the dtype, so the gradients below the final norm
    # carry float32 roundings of float64 values that agree to ~1e-15.
    for name, p in student.named_parameters():
        assert relative_error(got[name], p.grad) < 1e-6, name


def test_micro_batch_token_counts_differ() -> None:
    counts = [int((example.make_example(n, 0, 1)["labels"][1:] != -100).sum()) for n in UNEVEN_LENGTHS]
    assert counts == [13, 11, 6, 2]
    for pair in itertools.combinations(range(4), 2):
        rest = [i for i in range(4) if i not in pair]
        assert sum(counts[i] for i in pair) != sum(counts[i] for i in rest), pair


def test_gradient_accumulation_matches_one_large_batch(tmp_path: Path) -> None:
    whole = first_step(str(tmp_path / "whole"), per_device_batch=4, accumulation=1)
    accumulated = first_step(str(tmp_path / "accumulated"), per_device_batch=2, accumulation=2)
    assert whole.gradients.keys() == accumulated.gradients.keys()
    assert len(whole.gradients) == 20  # embedding (= head), 2 layers × 9, final norm
    for name, want in whole.gradients.items():
        assert want.abs().max() > 0, name
        assert relative_error(accumulated.gradients[name], want) < 1e-12, name
    # The Trainer logs the sum of the micro-batch losses: the mean over the 32 tokens, not half of it.
    teacher, student = example.build_models(torch.float64)
    with torch.no_grad():
        want_loss = float(reference_loss(student, teacher, uneven_batch())[0])
    for loss in (whole.logged_loss, accumulated.logged_loss):
        assert abs(loss - want_loss) < 1e-6 * want_loss


def test_data_parallel_matches_one_large_batch(tmp_path: Path) -> None:
    whole = first_step(str(tmp_path / "whole"), per_device_batch=4, accumulation=1)
    assert (whole.world_size, whole.wrapper) == (1, "LlamaForCausalLM")
    for rank in run_distributed(2, data_parallel_first_step, str(tmp_path), timeout=240.0):
        assert (rank.world_size, rank.wrapper) == (2, "DistributedDataParallel")
        assert rank.gradients.keys() == whole.gradients.keys()
        for name, want in whole.gradients.items():
            assert relative_error(rank.gradients[name], want) < 1e-12, name


def test_evaluate_reports_the_distillation_loss(tmp_path: Path) -> None:
    trainer, teacher, student = float64_trainer(tmp_path)
    metrics = trainer.evaluate(example.make_dataset(lengths=UNEVEN_LENGTHS))  # one batch of 4
    with torch.no_grad():
        want = float(reference_loss(student, teacher, uneven_batch())[0])
    assert abs(metrics["eval_loss"] - want) < 1e-12 * want


def test_distillation_head_keeps_the_model_behaviour(tmp_path: Path) -> None:
    student = example.build_student()
    original_head = student.lm_head
    input_ids = uneven_batch()["input_ids"]
    prompt = input_ids[:, : example.PROMPT_LEN]
    with torch.no_grad():
        want_logits = student(input_ids).logits
    want_tokens = student.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=example.PAD_TOKEN_ID)
    keys = list(student.state_dict())

    head = example.install_distillation_head(student, **example.LOSS_OPTIONS)
    assert isinstance(student.lm_head, orda_tp.DistillationHead) and student.lm_head is not original_head
    assert head.weight is original_head.weight is student.get_input_embeddings().weight
    assert list(student.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(student(input_ids).logits, want_logits)
    tokens = student.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=example.PAD_TOKEN_ID)
    assert torch.equal(tokens, want_tokens)

    # transformers re-ties through the head's `weight`, and plain transformers loads the checkpoint.
    student.tie_weights()
    assert student.lm_head is head and head.weight is student.get_input_embeddings().weight
    student.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded.lm_head) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, want_logits)


def test_script_runs_and_its_loss_falls() -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, str(EXAMPLE_PATH), "--teacher-steps", "40", "--steps", "40"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=environment,
    )  # fmt: skip
    stdout = completed.stdout
    assert completed.returncode == 0, f"{stdout}\n{completed.stderr}"
    losses = [float(value) for value in re.findall(rf"^student step +\d+ \| loss {FLOAT}$", stdout, flags=re.M)]
    assert len(losses) == 4, stdout
    assert losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert "lm_head DistillationHead, tied to the embeddings: True" in stdout, stdout
    assert re.search(r"^greedy continuation of \[.*\]: \[(\d+, ){7}\d+\]$", stdout, flags=re.M), stdout
