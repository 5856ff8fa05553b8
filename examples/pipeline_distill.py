"""Distillation under pipeline parallelism: the loss on the last stage, per micro-batch, without logits.

    torchrun --standalone --nproc-per-node 2 examples/pipeline_distill.py                     # 2 stages
    torchrun --standalone --nproc-per-node 2 examples/pipeline_distill.py --teacher cached    # cached logits
    torchrun --standalone --nproc-per-node 4 examples/pipeline_distill.py --tp 2              # (pp=2, tp=2)

The student is split into two stages with ``torch.distributed.pipelining``: stage 0 holds the
embedding and the first blocks, stage 1 the last blocks, the final norm and the LM head, an
``orda_tp.DistillationHead``. ``Schedule1F1B`` (or ``--schedule gpipe``) runs 4 micro-batches per
step. For each micro-batch the last stage's loss reads

- the student's final hidden states (the last stage's output),
- that micro-batch's labels (global token ids),
- the teacher of the same rows: the frozen teacher's final hidden states with its head module
  (``--teacher pipelined``: the teacher is split over the same stages and its activations travel
  with the student's), or cached teacher logits (``--teacher cached``),
- ``num_valid_tokens``: the valid-token count of the *whole batch*.

How they reach it, each through the schedule's own arguments:

- labels: ``schedule.step(target=labels)``. The schedule splits ``target`` along dim 0 into the
  same micro-batches as the inputs and calls ``loss_fn(output, target_of_that_micro_batch)``.
- the teacher: ``loss_fn`` gets nothing else per micro-batch, so the teacher's tensors enter the
  last stage's forward and leave in its output, ``(student hidden, teacher tensor)``. A pipelined
  teacher's activations come through the pipe with the student's; cached logits are a keyword of
  the last stage's ``step(teacher_logits=...)``, split into micro-batches like the inputs
  (keywords of ``step`` reach each rank's own stage; positional inputs only the first stage).
- the count: ``schedule.step(loss_kwargs={"num_valid_tokens": n})``; ``loss_kwargs`` reaches every
  ``loss_fn`` call as it is, unsplit.

So ``loss_fn`` is where the head runs (``LastStage.loss``). The loss could also be computed inside
the last stage's forward, but the schedule would still call ``loss_fn(output, target)`` and
requires a ``target`` on the last stage: the labels would come twice. Every rank passes a
``loss_fn`` (a schedule without one runs no backward); only the last stage calls it.

Normalization: each micro-batch's loss is its token sum divided by the whole batch's count ``n``,
so the micro-batch losses add up to the batch mean, and so do the gradients that the schedule
accumulates. The schedule must then leave them alone: ``scale_grads=False`` (the default ``True``
divides the gradients by the number of micro-batches, which is right only for a ``loss_fn`` that
returns micro-batch means). ``--per-microbatch-mean`` shows that common setup: each micro-batch
divided by its own count, the schedule averaging; with uneven counts its gradients are not the
batch mean's, and the check fails.

The script trains a few steps; its first step is checked against the unsplit model run in one
process on the whole batch (float64): the loss and the gradients of both stages' parameters (the
vocabulary-parallel head's gathered), within 1e-12 relative. Rank 0 prints ``check PASS``; on a
failure every rank exits 1.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import orda_tp

VOCAB, SEQ, BATCH, MICROBATCHES = 101, 8, 8, 4
STUDENT_HIDDEN, TEACHER_HIDDEN, BLOCKS, SPLIT = 32, 48, 4, 2  # blocks [0, SPLIT) on stage 0
IGNORE_INDEX = -100
LOSS = {"kl_weight": 1.0, "kl_temperature": 2.0}  # + student CE; a separate teacher is not trained
SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class Front(nn.Module):
    """What stage 0 holds of a model: the embedding and the first residual blocks."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(SPLIT))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return x


class Back(nn.Module):
    """What the last stage holds of a model before its head: the last blocks and the final norm."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(BLOCKS - SPLIT))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


class TinyLM(nn.Module):
    """A small causal-LM stand-in: ``front`` (stage 0), ``back`` and ``lm_head`` (the last stage)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.front = Front(hidden)
        self.back = Back(hidden)
        self.lm_head = orda_tp.DistillationHead(hidden, VOCAB, **LOSS)

    def hidden_states(self, tokens: Tensor) -> Tensor:
        """What the LM head receives: ``[batch, seq, hidden]``."""
        return self.back(self.front(tokens))


class FirstStage(nn.Module):
    """Stage 0: the student's front; with a pipelined teacher also the frozen teacher's front,
    whose activations are sent on with the student's."""

    def __init__(self, student: TinyLM, teacher: TinyLM | None) -> None:
        super().__init__()
        self.student = student.front
        self.teacher = teacher.front if teacher is not None else None

    def forward(self, tokens: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        x = self.student(tokens)
        if self.teacher is None:
            return x
        with torch.no_grad():
            return x, self.teacher(tokens)


class LastStage(nn.Module):
    """The last stage: the student's back and its ``DistillationHead``; with a pipelined teacher
    also the frozen teacher's back and head.

    ``forward`` returns what the loss reads of one micro-batch besides its labels: the student's
    final hidden states and the teacher's tensor for the same rows (its final hidden states, or
    the cached logits given as the ``teacher_logits`` keyword of this rank's ``step``).
    """

    def __init__(self, student: TinyLM, teacher: TinyLM | None) -> None:
        super().__init__()
        self.student = student.back
        self.lm_head = student.lm_head
        self.teacher = teacher.back if teacher is not None else None
        self.teacher_head = teacher.lm_head if teacher is not None else None

    def forward(
        self, x: Tensor, teacher_x: Tensor | None = None, *, teacher_logits: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        hidden = self.student(x)
        if self.teacher is None:
            if teacher_logits is None:
                raise ValueError("without a pipelined teacher, pass teacher_logits= to the last stage's step()")
            return hidden, teacher_logits
        with torch.no_grad():
            return hidden, self.teacher(teacher_x)

    def teacher_of(self, teacher_tensor: Tensor) -> orda_tp.TeacherHead | orda_tp.PrecomputedTeacher:
        """The orda_tp teacher of a micro-batch's rows, flattened like the student's."""
        rows = teacher_tensor.reshape(-1, teacher_tensor.shape[-1])
        if self.teacher_head is None:
            return orda_tp.PrecomputedTeacher(logits=rows)  # cached logits: [rows, V] (this tp rank's columns)
        return orda_tp.TeacherHead(rows, self.teacher_head)  # final hidden states, read through its head

    def loss(self, output: tuple[Tensor, Tensor], labels: Tensor, *, num_valid_tokens: Tensor | None) -> Tensor:
        """The schedule's ``loss_fn`` for one micro-batch: its token sum divided by
        ``num_valid_tokens``, the batch's count (or by its own count when None)."""
        hidden, teacher_tensor = output
        teacher = self.teacher_of(teacher_tensor)
        return self.lm_head(hidden, labels=labels, teacher=teacher, num_valid_tokens=num_valid_tokens).loss


def loss_runs_on_the_last_stage(output: object, target: object, **loss_kwargs: object) -> Tensor:
    """Stage 0's ``loss_fn``: never called. A schedule needs one on every rank (without a
    ``loss_fn`` it runs forward only), but only the last stage computes the loss."""
    raise RuntimeError("the loss is computed on the last pipeline stage only")


def build(hidden: int, seed: int) -> TinyLM:
    """The same float64 model on every rank (seeded); each rank keeps its stage's part."""
    torch.manual_seed(seed)
    return TinyLM(hidden).to(torch.float64)  # float64 for the exact check; train in bf16/fp32 as usual


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The step's tokens and next-token labels. The first positions of each sequence (a prompt of
    random length) and the last are ignored, so the micro-batches hold uneven valid counts."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    prompt = torch.randint(0, SEQ - 1, (BATCH, 1), generator=generator)
    labels[torch.arange(SEQ) < prompt] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    return tokens, labels


def cached_logits(teacher: TinyLM, tokens: Tensor, tp: DeviceMesh | None) -> Tensor:
    """The frozen teacher's logits, as an offline job would have cached them: ``[batch, seq, V]``,
    or this tp rank's columns (``torch.chunk`` order, as ``VocabParallel`` shards the head)."""
    with torch.no_grad():
        logits = teacher.lm_head(teacher.hidden_states(tokens))
    if tp is None:
        return logits
    return logits.chunk(tp.size(), dim=-1)[tp.get_local_rank()]


def make_stage(student: TinyLM, teacher: TinyLM, mesh: DeviceMesh, args: argparse.Namespace) -> PipelineStage:
    """This rank's stage module in a ``PipelineStage`` over the pp group; on the last stage the
    heads are vocabulary-parallel over the tp ranks (stage 0 is replicated over them here)."""
    pp_rank = mesh.get_local_rank("pp")
    pipelined = teacher if args.teacher == "pipelined" else None
    if pp_rank == 0:
        module: nn.Module = FirstStage(student, pipelined)
    else:
        module = LastStage(student, pipelined)
        if args.tp > 1:
            plan = {"lm_head": orda_tp.VocabParallel()}
            if pipelined is not None:
                plan["teacher_head"] = orda_tp.VocabParallel()
            parallelize_module(module, mesh["tp"], plan)
    return PipelineStage(module, pp_rank, mesh["pp"].size(), torch.device("cpu"), group=mesh["pp"].get_group())


def make_schedule(stage: PipelineStage, args: argparse.Namespace) -> PipelineScheduleSingle:
    """The schedule, with ``scale_grads=False``: each micro-batch's loss is already divided by the
    batch's count, so the summed gradients are the batch mean's as they are."""
    module = stage.submod
    loss_fn = module.loss if isinstance(module, LastStage) else loss_runs_on_the_last_stage
    schedule = SCHEDULES[args.schedule]
    if args.per_microbatch_mean:  # the wrong normalization: micro-batch means, averaged by the schedule
        return schedule(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=True)
    return schedule(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)


def valid_tokens(labels: Tensor) -> Tensor:
    """The batch's valid-token count: one device tensor, never read on the host. With data
    parallelism, all-reduce it over the dp group (never over tp or pp)."""
    return (labels != IGNORE_INDEX).sum()


def last_stage_step(
    schedule: PipelineScheduleSingle, labels: Tensor, num_valid_tokens: Tensor | None, teacher_logits: Tensor | None
) -> list[Tensor]:
    """The last stage's part of one step; returns the micro-batches' losses. The schedule splits
    ``target`` and the stage's keywords (``teacher_logits``) into micro-batches along dim 0, like
    the first stage's inputs, and passes ``loss_kwargs`` to every ``loss_fn`` call as it is."""
    losses: list[Tensor] = []
    keywords = {} if teacher_logits is None else {"teacher_logits": teacher_logits}
    schedule.step(
        target=labels,
        losses=losses,
        loss_kwargs={"num_valid_tokens": num_valid_tokens},
        return_outputs=False,  # the outputs are the loss's inputs; nothing to merge
        **keywords,
    )
    return losses


def pipelined_step(
    schedule: PipelineScheduleSingle,
    stage: PipelineStage,
    tokens: Tensor,
    labels: Tensor,
    teacher_logits: Tensor | None,
    per_microbatch_mean: bool,
) -> Tensor | None:
    """One forward and backward of the whole batch through the pipeline. Returns the batch's loss
    on the last stage (the sum of its micro-batches' losses), None on stage 0."""
    if stage.is_first:
        schedule.step(tokens)
        return None
    if per_microbatch_mean:  # the mistake that --per-microbatch-mean shows: each micro-batch's own mean
        return torch.stack(last_stage_step(schedule, labels, None, teacher_logits)).mean().detach()
    return torch.stack(last_stage_step(schedule, labels, valid_tokens(labels), teacher_logits)).sum().detach()


def reference_step(student: TinyLM, teacher: TinyLM, tokens: Tensor, labels: Tensor) -> Tensor:
    """The unsplit student on the whole batch in one process: loss (mean over its valid tokens) and
    gradients in ``student``'s parameters."""
    hidden = teacher.hidden_states(tokens).detach()
    teacher_head = orda_tp.TeacherHead(hidden.reshape(-1, hidden.shape[-1]), teacher.lm_head)
    out = student.lm_head(student.hidden_states(tokens), labels=labels, teacher=teacher_head)
    out.loss.backward()
    return out.loss.detach()


def full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative_error(got: Tensor, want: Tensor) -> float:
    return float((full(got) - want).norm() / want.norm())


def check_errors(stage: PipelineStage, student: TinyLM, reference: TinyLM, loss: Tensor | None, want: Tensor) -> float:
    """Worst relative error over all ranks: the pipelined loss (last stage) and the gradient of
    every parameter this rank's stage holds, against the reference."""
    mine = {id(param) for param in stage.submod.parameters()}
    errors = [relative_error(loss, want)] if loss is not None else []
    for param, ref in zip(student.parameters(), reference.parameters()):
        if id(param) in mine and param.requires_grad:
            errors.append(relative_error(param.grad, ref.grad))
    worst = torch.tensor(max(errors), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", choices=("pipelined", "cached"), default="pipelined")
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the last stage's heads")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--per-microbatch-mean", action="store_true", help="the wrong normalization (the check fails)")
    return parser.parse_args()


def say(line: str) -> None:
    """One line on stdout in one write: the ranks that print (the first and the last stage) share
    torchrun's stdout, and ``print`` writes a line's text and its newline separately."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, args.tp), mesh_dim_names=("pp", "tp"))
    is_last, tp = mesh.get_local_rank("pp") == 1, (mesh["tp"] if args.tp > 1 else None)

    student, teacher = build(STUDENT_HIDDEN, seed=0), build(TEACHER_HIDDEN, seed=1).requires_grad_(False)
    reference, ref_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    stage = make_stage(student, teacher, mesh, args)
    schedule = make_schedule(stage, args)
    optimizer = torch.optim.AdamW([p for p in stage.submod.parameters() if p.requires_grad], lr=1e-2)

    error = float("inf")
    for step in range(1, args.steps + 1):
        tokens, labels = batch(step)
        logits = cached_logits(teacher, tokens, tp) if args.teacher == "cached" and is_last else None
        optimizer.zero_grad()
        loss = pipelined_step(schedule, stage, tokens, labels, logits, args.per_microbatch_mean)
        if step == 1:  # before the optimizer moves the weights: against the unsplit model
            want = reference_step(reference, ref_teacher, tokens, labels)
            error = check_errors(stage, student, reference, loss, want)
        if loss is not None and mesh.get_local_rank("tp") == 0 and step in (1, args.steps):
            say(f"step {step}: loss {loss.item():.4f} (last stage, {MICROBATCHES} micro-batches)")
        optimizer.step()

    passed = error <= 1e-12
    if dist.get_rank() == 0:
        say(
            f"pp=2 tp={args.tp} teacher={args.teacher} schedule={args.schedule}: "
            f"check {'PASS' if passed else 'FAIL'} max_rel_err {error:.2e}"
        )
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    code = main()
    # Leave without interpreter shutdown: gloo's worker threads release a finished collective's tensors
    # only after wait() has returned, and a release during shutdown aborts the process ("terminate
    # called without an active exception"; docs/integrations.md §10).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
