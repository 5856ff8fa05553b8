"""A whole training step (forward, backward, AdamW step) of Llama-style models with each loss.

Users judge a fused loss by their training step. The models are ``LlamaForCausalLM`` built from
``transformers`` configs (no download), vocabulary 128256, bf16 weights, sequence 4096, sdpa
attention:

- student (~0.49B): hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads, head tied to the
  embeddings (Qwen2-0.5B-like);
- teacher (~1.5B, frozen): hidden 1536, intermediate 8960, 28 layers, 12 heads, 2 KV heads, tied.

A step is the decoder's forward (``model.model``: embeddings, layers, final norm; for the KD methods
that read the teacher's states, the frozen teacher's too, under ``no_grad``), then the method's
*head and loss* on those final hidden states, backward, ``AdamW.step``. The head and loss is
exactly what each integration runs after the decoder:

CE methods (the student's next-token cross-entropy, labels shifted as ``ForCausalLMLoss`` does):
``hf`` (``model.loss_function(model.lm_head(hidden), labels)``: what ``LlamaForCausalLM.forward``
runs given ``labels``), ``liger`` (``LigerForCausalLMLoss``: what Liger-Kernel's Llama patch,
``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)``, runs in its forward), ``cce``
(cut-cross-entropy's ``linear_cross_entropy(shift=1, filter_eps=None)``, which its Hugging Face patch
calls; the patch itself is not in its PyPI wheel; ``filter_eps=None`` computes the whole gradient:
its default filter drops the gradient's entries below a threshold, and on these freshly initialized
models, whose softmax is near uniform, that changes the gradients by up to 100 %),
``orda`` (``DistillationHead.from_linear(lm_head)`` on ``(hidden[:, :-1], labels[:, 1:])``, as
``examples/hf_trainer_distill.py`` does) and ``orda_ws512``
(the same with ``KernelConfig(workspace_mib=512)`` instead of the default workspace).

KD methods (student CE + forward KL(teacher ‖ student), T = 1, weights 1 and 1):
``logits_kd`` (full student and teacher logits, log_softmax, KL, as TRL's GKD computes it at
beta = 0; the teacher's logits under no_grad), ``liger_jsd`` (Liger's chunked
``LigerFusedLinearJSDLoss`` at beta = 0, which is ``kl_div(student_logp, teacher_logp,
log_target=True)``: forward KL, with its own CE as the hard loss), ``orda_teacher_head``
(``TeacherHead(teacher_hidden, teacher.lm_head)``, ``teacher_ce_weight=0``), ``orda_topk`` (a top-k
cache of the same teacher from ``orda_tp.teacher_topk``, made before the step and not timed,
``tail="uniform"``; the teacher does not run in the step).

On-policy methods (TRL's ``DistillationTrainer`` loss, ``benchmarks/onpolicy.py``: the generalized
JSD at β = 0.5, T = 1, on the student's and the frozen teacher's final hidden states at the completion
positions, the last 3/4 of the sequence (the first 1/4 is the prompt), the loss mask the batch's labels
there, ``num_items_in_batch`` its count as the trainer passes it; the decoders read the whole sequence, as
in the KD methods): ``trl_onpolicy`` (TRL 1.16's ``_chunked_divergence_loss``, called as the trainer
calls it; its Triton kernels on a GPU, its torch tiles on the CPU) and ``orda_onpolicy``
(``orda_tp.integrations.trl.chunked_divergence_loss`` on the same arguments).

Each JSON line (one per method × compile setting) holds: the median step time over ``--steps``
timed steps after ``--warmup`` (and their min and max), tokens/s (``batch × seq`` tokens per step),
peak memory over the timed steps (``torch.cuda.max_memory_allocated``: weights, gradients, AdamW
state, activations); the head and loss alone (``loss_ms``: its forward and backward on the step's
hidden states, detached leaves, median over as many repeats; ``loss_share = loss_ms / step_ms``;
``loss_peak_mib``: the memory it adds; ``loss_kernels``: its ten costliest GPU kernels;
``loss_host_syncs``: the synchronizing CUDA calls it makes, by source line, from
``torch.cuda.set_sync_debug_mode``); the largest micro-batch that fits (doubling, then bisection,
catching ``torch.cuda.OutOfMemoryError``, up to ``--max-batch``) and the tokens/s at it. With
``--compile`` every method runs again compiled the way PyTorch recommends for repeated blocks:
each decoder layer (student and teacher) ``layer.compile()`` (one compiled graph shared by the
layers) and the head and loss ``torch.compile``d; the record adds the graph breaks (reasons, counts
and their total) and the graphs compiled by the first step and by the end of the timed steps (a growth is a
recompilation). ``--repeats R`` times each method's step R − 1 more times, in reversed order, in
lines with ``"pass"`` ≥ 1.

Every method starts from the same initial weights and batch; its first step's loss and gradients are
compared with the reference of its task (``hf`` for CE, ``logits_kd`` for KD, ``trl_onpolicy`` on-policy).

    python benchmarks/train_step.py                     # one GPU, eager
    python benchmarks/train_step.py --compile --out DIR # eager and torch.compile, DIR/train_step.jsonl
    python benchmarks/train_step.py --small             # CPU: tiny fp32 models, checked

``--small`` asserts that every method's loss (1e-5 relative) and gradients (1e-4 relative to the
largest entry) match its reference, with k = V for ``orda_topk`` (then exact), prints ``check PASS``
or ``check FAIL`` and exits 1 on FAIL. Methods whose package does not import are skipped, with the
reason printed and recorded. ``benchmarks/train_step_report.py`` turns the records into the table and
the plot of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The harness comes in before orda_tp: it sets the NCCL and Triton environment.
from benchmarks.harness import environment, recover_device, sync_device  # noqa: E402

# isort: split
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import orda_tp  # noqa: E402
from benchmarks.onpolicy import onpolicy_loss  # noqa: E402
from orda_tp.integrations.trl import chunked_divergence_loss  # noqa: E402

IGNORE_INDEX = -100
IGNORE_EVERY = 7  # 1 label in 7 is IGNORE_INDEX (prompt or padding)
CE_TOLERANCE = {"loss": 1e-5, "grad": 1e-4}  # fp32, --small
CHECKED_PARAMETERS = ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")
KD_OPTIONS: dict[str, Any] = dict(
    student_ce_weight=1.0, kl_weight=1.0, kl_temperature=1.0, kl_divergence="forward", teacher_ce_weight=0.0
)
PROFILED_KERNELS = 10  # loss_kernels: the costliest GPU kernels of the head and loss
MAX_BATCH_STEPS = 3  # timed steps at the largest micro-batch (after one untimed)


@dataclass(frozen=True)
class Sizes:
    vocab: int
    seq: int
    student: dict[str, int]
    teacher: dict[str, int]
    dtype: torch.dtype
    teacher_init_std: float  # the teacher's initializer_range


GPU_SIZES = Sizes(
    vocab=128256,
    seq=4096,
    student=dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    teacher=dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
    dtype=torch.bfloat16,
    teacher_init_std=0.02,  # transformers' default
)
SMALL_SIZES = Sizes(
    vocab=512,
    seq=32,
    student=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    teacher=dict(
        hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    dtype=torch.float32,
    teacher_init_std=0.2,  # logits of std ≈ 2: a teacher far from uniform, so the KL term weighs in the check
)


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # (B, T)
    labels: Tensor  # (B, T), unshifted as transformers takes them; IGNORE_INDEX ignored


@dataclass(frozen=True)
class Inputs:
    """What the head and loss reads: the student's final hidden states (B, T, H); the frozen
    teacher's (B, T, H_t) for a method that runs the teacher, else None; the batch's unshifted
    labels; what the method prepared for this batch before the step (the top-k teacher), else None."""

    hidden: Tensor
    teacher_hidden: Tensor | None
    labels: Tensor
    prepared: Any = None

    def detached(self) -> Inputs:
        """The same values as leaves: the student's states requiring a gradient, for the loss alone."""
        teacher = None if self.teacher_hidden is None else self.teacher_hidden.detach()
        return Inputs(self.hidden.detach().requires_grad_(), teacher, self.labels, self.prepared)


HeadLoss = Callable[[Inputs], Tensor]  # a method's head and loss
Bound = Callable[[], Tensor]  # the step's loss for one batch


@dataclass
class Context:
    """The run's settings and the frozen teacher, built when a KD method first reads it and released
    after each compile setting (the CE methods' steps and memory are the student's alone)."""

    sizes: Sizes
    device: torch.device
    topk: int
    seed: int
    compiled: bool = False
    _teacher: LlamaForCausalLM | None = None

    @property
    def teacher(self) -> LlamaForCausalLM:
        if self._teacher is None:
            self._teacher = build_llama(
                self.sizes, self.sizes.teacher, self.device, self.seed + 1, self.sizes.teacher_init_std
            )
            self._teacher.eval().requires_grad_(False)
            if self.compiled:
                compile_layers(self._teacher)
        return self._teacher

    def release_teacher(self) -> None:
        self._teacher = None
        recover_device()


class Skip(Exception):
    """A method that cannot run here (its package is missing, or it needs CUDA)."""


# ------------------------------------------------------------------------------------------------ models


def build_llama(
    sizes: Sizes, shape: dict[str, int], device: torch.device, seed: int, init_std: float = 0.02
) -> LlamaForCausalLM:
    """A randomly initialized tied-head Llama of ``shape``, the same for the same ``seed``."""
    config = LlamaConfig(
        initializer_range=init_std,
        vocab_size=sizes.vocab,
        max_position_embeddings=sizes.seq,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        **shape,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(sizes.dtype)


def compile_layers(model: LlamaForCausalLM) -> None:
    """Regional compilation: each decoder layer ``compile()``d; the layers share one compiled graph."""
    for layer in model.model.layers:
        layer.compile()


def make_batch(batch_size: int, sizes: Sizes, device: torch.device, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, sizes.vocab, (batch_size, sizes.seq), generator=generator)
    labels = input_ids.clone()
    labels[:, 3::IGNORE_EVERY] = IGNORE_INDEX
    return Batch(input_ids.to(device), labels.to(device))


def decoder_states(model: LlamaForCausalLM, input_ids: Tensor) -> Tensor:
    """The (B, T, H) final-norm output that ``lm_head`` reads (``model.model``'s forward)."""
    return model.model(input_ids=input_ids, use_cache=False).last_hidden_state


def teacher_states(ctx: Context, input_ids: Tensor) -> Tensor:
    with torch.no_grad():
        return decoder_states(ctx.teacher, input_ids)


def shifted_rows(states: Tensor) -> Tensor:
    """Position t's state, t < T - 1, as (B·(T - 1), H) rows: the rows that have a next-token label."""
    return states[:, :-1, :].reshape(-1, states.shape[-1])


def shifted_labels(labels: Tensor) -> Tensor:
    """Label t + 1 for position t, as ``ForCausalLMLoss`` shifts them, flattened."""
    return labels[:, 1:].reshape(-1)


# ------------------------------------------------------------------------------------------------ methods
# Each method's ``prepare(student, ctx)`` returns its head and loss (a function of the Inputs).


def hf_ce(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    def loss(x: Inputs) -> Tensor:
        return student.loss_function(logits=student.lm_head(x.hidden), labels=x.labels, vocab_size=ctx.sizes.vocab)

    return loss


def liger_ce(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    loss_utils = import_or_skip("liger_kernel.transformers.model.loss_utils", ctx)

    def loss(x: Inputs) -> Tensor:
        return loss_utils.LigerForCausalLMLoss(
            hidden_states=x.hidden,
            lm_head_weight=student.lm_head.weight,
            labels=x.labels,
            hidden_size=x.hidden.shape[-1],
        )

    return loss


def cce_ce(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    cce = import_or_skip("cut_cross_entropy", ctx)

    def loss(x: Inputs) -> Tensor:
        weight = student.lm_head.weight
        return cce.linear_cross_entropy(x.hidden, weight, x.labels, shift=1, reduction="mean", filter_eps=None)

    return loss


def orda_head_loss(head: orda_tp.DistillationHead, teacher: Callable[[Inputs], Any] | None) -> HeadLoss:
    def loss(x: Inputs) -> Tensor:
        rows, labels = x.hidden[:, :-1, :], x.labels[:, 1:]
        return head(rows, labels, teacher=None if teacher is None else teacher(x)).loss

    return loss


def orda_ce(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    head = orda_tp.DistillationHead.from_linear(student.lm_head, student_ce_weight=1.0, kl_weight=0.0)
    return orda_head_loss(head, None)


def orda_ce_ws512(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    config = orda_tp.KernelConfig(workspace_mib=512)
    head = orda_tp.DistillationHead.from_linear(student.lm_head, student_ce_weight=1.0, kl_weight=0.0, config=config)
    return orda_head_loss(head, None)


def logits_kd(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    """CE + KL(teacher ‖ student) from the full logits, as TRL's ``generalized_jsd_loss`` at beta=0
    (``kl_div(student_logp, teacher_logp, log_target=True)`` summed over the vocabulary, averaged
    over the rows whose label is not ignored)."""

    def loss(x: Inputs) -> Tensor:
        assert x.teacher_hidden is not None
        logits = student.lm_head(x.hidden)[:, :-1].float()
        with torch.no_grad():
            teacher_logits = ctx.teacher.lm_head(x.teacher_hidden)[:, :-1].float()
        labels = x.labels[:, 1:]
        mask = labels != IGNORE_INDEX
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        student_logp, teacher_logp = F.log_softmax(logits, dim=-1), F.log_softmax(teacher_logits, dim=-1)
        kl = F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True).sum(-1)
        return ce + kl[mask].sum() / mask.sum()

    return loss


def liger_jsd(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    chunked = import_or_skip("liger_kernel.chunked_loss", ctx)
    jsd = chunked.LigerFusedLinearJSDLoss(
        weight_hard_loss=1.0, weight_soft_loss=1.0, beta=0.0, ignore_index=IGNORE_INDEX, temperature=1.0
    )

    def loss(x: Inputs) -> Tensor:
        assert x.teacher_hidden is not None
        return jsd(
            shifted_rows(x.hidden),
            student.lm_head.weight,
            shifted_rows(x.teacher_hidden),
            ctx.teacher.lm_head.weight,
            shifted_labels(x.labels),
        )

    return loss


def orda_teacher_head(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    head = orda_tp.DistillationHead.from_linear(student.lm_head, **KD_OPTIONS)

    def teacher(x: Inputs) -> orda_tp.TeacherHead:
        assert x.teacher_hidden is not None
        return orda_tp.TeacherHead(shifted_rows(x.teacher_hidden), ctx.teacher.lm_head)

    return orda_head_loss(head, teacher)


def orda_topk(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    head = orda_tp.DistillationHead.from_linear(student.lm_head, **KD_OPTIONS)
    return orda_head_loss(head, lambda x: x.prepared)


def topk_teacher(ctx: Context, batch: Batch) -> Any:
    """The batch's top-k teacher (``teacher_topk`` on the teacher's rows), made before the step."""
    rows = shifted_rows(teacher_states(ctx, batch.input_ids))
    return orda_tp.teacher_topk(rows, ctx.teacher.lm_head.weight, ctx.topk).teacher(tail="uniform")


def trl_onpolicy(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    trainer = import_or_skip("trl.trainer.distillation_trainer", ctx, needs_cuda=False)
    return onpolicy_loss(trainer._chunked_divergence_loss, student, ctx)


def orda_onpolicy(student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    return onpolicy_loss(chunked_divergence_loss, student, ctx)


def import_or_skip(module: str, ctx: Context, needs_cuda: bool = True) -> Any:
    """``module``, or Skip when it does not import (or, for kernels that need CUDA, off a GPU)."""
    try:
        imported = __import__(module, fromlist=["_"])
    except ImportError as error:
        raise Skip(f"{type(error).__name__}: {error}") from None
    if needs_cuda and ctx.device.type != "cuda":
        raise Skip("its kernels need CUDA")
    return imported


@dataclass(frozen=True)
class Method:
    name: str
    task: str  # "CE", "KD" or "on-policy"
    prepare: Callable[[LlamaForCausalLM, Context], HeadLoss]
    runs_teacher: bool = False  # the teacher's forward is part of the step
    before_step: Callable[[Context, Batch], Any] | None = None  # Inputs.prepared, made untimed


METHODS = (
    Method("hf", "CE", hf_ce),  # the CE reference
    Method("liger", "CE", liger_ce),
    Method("cce", "CE", cce_ce),
    Method("orda", "CE", orda_ce),
    Method("orda_ws512", "CE", orda_ce_ws512),
    Method("logits_kd", "KD", logits_kd, runs_teacher=True),  # the KD reference
    Method("liger_jsd", "KD", liger_jsd, runs_teacher=True),
    Method("orda_teacher_head", "KD", orda_teacher_head, runs_teacher=True),
    Method("orda_topk", "KD", orda_topk, before_step=topk_teacher),
    Method("trl_onpolicy", "on-policy", trl_onpolicy, runs_teacher=True),  # the on-policy reference
    Method("orda_onpolicy", "on-policy", orda_onpolicy, runs_teacher=True),
)
REFERENCE = {"CE": "hf", "KD": "logits_kd", "on-policy": "trl_onpolicy"}


@dataclass(frozen=True)
class Prepared:
    """A method ready to run on a fresh student: its head and loss, and the step's inputs for a batch."""

    method: Method
    student: LlamaForCausalLM
    ctx: Context
    head_loss: HeadLoss

    def inputs(self, batch: Batch, prepared: Any) -> Inputs:
        teacher = teacher_states(self.ctx, batch.input_ids) if self.method.runs_teacher else None
        return Inputs(decoder_states(self.student, batch.input_ids), teacher, batch.labels, prepared)

    def bind(self, batch: Batch) -> Bound:
        """The step's loss on ``batch``; what the method prepares before the step is made here, untimed."""
        before = self.method.before_step
        prepared = None if before is None else before(self.ctx, batch)
        return lambda: self.head_loss(self.inputs(batch, prepared))


# ------------------------------------------------------------------------------------------------ measuring


def train_step(loss: Bound, optimizer: torch.optim.Optimizer) -> float:
    value = loss()
    value.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value.item()


def first_step(prep: Prepared, batch: Batch, optimizer: torch.optim.Optimizer) -> tuple[float, dict, Inputs]:
    """One step; its loss, the checked parameters' gradients (fp32, on the CPU, taken before the
    optimizer step) and its inputs as leaves (for the loss alone)."""
    before = prep.method.before_step
    inputs = prep.inputs(batch, None if before is None else before(prep.ctx, batch))
    value = prep.head_loss(inputs)
    value.backward()
    grads = {name: prep.student.get_parameter(name).grad.float().cpu() for name in CHECKED_PARAMETERS}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value.item(), grads, inputs.detached()


def timed_ms(run: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``run`` after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        run()
    sync_device(device)
    times: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
    return times


def step_times(loss: Bound, optimizer: torch.optim.Optimizer, device: torch.device, args: Any) -> dict[str, float]:
    times = timed_ms(lambda: train_step(loss, optimizer), device, args.warmup, args.steps)
    return {"step_ms": statistics.median(times), "step_ms_min": min(times), "step_ms_max": max(times)}


def loss_alone(prep: Prepared, inputs: Inputs, args: Any) -> dict[str, Any]:
    """The head and loss alone, forward and backward on ``inputs`` (leaves): median ms, the memory
    it adds, on a GPU its costliest kernels and its synchronizing calls. Each run drops the
    gradients it leaves."""

    def run() -> None:
        prep.head_loss(inputs).backward()
        inputs.hidden.grad = None
        prep.student.zero_grad(set_to_none=True)  # each run starts as a step does: no gradients

    device = prep.ctx.device
    record: dict[str, Any] = {}
    if device.type == "cuda":
        run()  # compiled before the memory baseline
        sync_device(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        record["loss_peak_mib"] = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
        record["loss_host_syncs"] = host_syncs(run)
        record["loss_kernels"] = costliest_kernels(run)
    record["loss_ms"] = statistics.median(timed_ms(run, device, 1, args.steps))
    return record


def host_syncs(run: Callable[[], None]) -> dict[str, int]:
    """The synchronizing CUDA calls of ``run``, counted by the source line that made them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return {line: lines.count(line) for line in sorted(set(lines))}


def costliest_kernels(run: Callable[[], None]) -> list[list[Any]]:
    """``[name, total ms, calls]`` of the :data:`PROFILED_KERNELS` GPU kernels of ``run`` that take
    the most time, and ``["(all kernels)", ms, calls]`` first."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = ["(all kernels)", sum(e.self_device_time_total for e in kernels) / 1e3, sum(e.count for e in kernels)]
    return [total] + [[e.key[:90], e.self_device_time_total / 1e3, e.count] for e in kernels[:PROFILED_KERNELS]]


def fits(prep: Prepared, optimizer: torch.optim.Optimizer, batch_size: int) -> bool:
    """Whether one step at ``batch_size`` runs without running out of GPU memory; memory freed after."""
    try:
        train_step(prep.bind(make_batch(batch_size, prep.ctx.sizes, prep.ctx.device, seed=batch_size)), optimizer)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:  # after the except block: the traceback, and the tensors its frames hold, are gone
        optimizer.zero_grad(set_to_none=True)
        recover_device()


def largest_batch(prep: Prepared, optimizer: torch.optim.Optimizer, cap: int) -> int:
    """Doubling from 1 up to ``cap``, then bisection between the last size that fits and the first
    that does not; 0 when even 1 does not fit."""
    good, bad = 0, None
    size = 1
    while size <= cap:
        if not fits(prep, optimizer, size):
            bad = size
            break
        good, size = size, size * 2
    if bad is None:  # every power of 2 up to cap fits
        if good == cap or fits(prep, optimizer, cap):
            return cap
        bad = cap
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(prep, optimizer, middle) else (good, middle)
    return good


def relative_error(value: Tensor, reference: Tensor) -> float:
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def compiled_graphs() -> dict[str, Any]:
    """Dynamo's counters so far: graphs compiled, graph breaks by reason (its first line) and their total."""
    from torch._dynamo.utils import counters

    breaks: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        breaks[reason.splitlines()[0]] = breaks.get(reason.splitlines()[0], 0) + count
    total = sum(breaks.values())
    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": breaks, "graph_break_count": total}


# ------------------------------------------------------------------------------------------------ running


@dataclass
class References:
    """The reference methods' first-step losses and gradients, by task."""

    loss: dict[str, float] = field(default_factory=dict)
    grads: dict[str, dict[str, Tensor]] = field(default_factory=dict)


def compare(record: dict[str, Any], method: Method, loss: float, grads: dict[str, Tensor], refs: References) -> None:
    if method.name == REFERENCE[method.task]:
        refs.loss.setdefault(method.task, loss)
        refs.grads.setdefault(method.task, grads)
    if method.task not in refs.loss:
        return
    reference = refs.loss[method.task]
    record["reference"] = REFERENCE[method.task]
    record["loss_rel_err"] = abs(loss - reference) / abs(reference)
    record["grad_rel_err"] = {name: relative_error(g, refs.grads[method.task][name]) for name, g in grads.items()}


def prepare(method: Method, compiled: bool, ctx: Context, args: Any) -> Prepared:
    """A fresh student (the same initial weights for every method) with the method's head and loss,
    compiled when asked (then Dynamo's counters start from zero)."""
    student = build_llama(ctx.sizes, ctx.sizes.student, ctx.device, seed=args.seed)
    head_loss = method.prepare(student, ctx)
    if compiled:
        from torch._dynamo.utils import counters

        counters.clear()
        compile_layers(student)
        head_loss = torch.compile(head_loss)
    return Prepared(method, student, ctx, head_loss)


def at_largest_batch(prep: Prepared, optimizer: torch.optim.Optimizer, args: Any) -> dict[str, Any]:
    """The largest micro-batch that fits, and the tokens/s of steps at it; where the allocator,
    fragmented by the search, no longer fits it, at one sample less (``max_batch_timed``)."""
    record: dict[str, Any] = {"max_batch": largest_batch(prep, optimizer, args.max_batch)}
    for size in range(record["max_batch"], max(record["max_batch"] - 2, 0), -1):
        try:
            step = functools.partial(
                train_step, prep.bind(make_batch(size, prep.ctx.sizes, prep.ctx.device, 0)), optimizer
            )
            times = timed_ms(step, prep.ctx.device, 1, MAX_BATCH_STEPS)
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            recover_device()
            continue
        tokens_per_s = size * prep.ctx.sizes.seq / (statistics.median(times) / 1e3)
        return record | {"max_batch_timed": size, "max_batch_tokens_per_s": tokens_per_s}
    return record


def run_method(method: Method, compiled: bool, ctx: Context, refs: References, args: Any) -> dict[str, Any]:
    """One JSON record: status, first-step loss (and its errors against the reference), timing,
    memory, the loss alone, compilation, the largest batch."""
    record: dict[str, Any] = {"method": method.name, "task": method.task, "compile": compiled, "batch": args.batch}
    try:
        prep = prepare(method, compiled, ctx, args)
    except Skip as reason:
        return record | {"status": "skipped", "reason": str(reason)}
    optimizer = torch.optim.AdamW(prep.student.parameters(), lr=1e-4)
    batch = make_batch(args.batch, ctx.sizes, ctx.device, seed=args.seed)
    try:
        record["loss"], grads, inputs = first_step(prep, batch, optimizer)
        compare(record, method, record["loss"], grads, refs)
        if compiled:
            record["compiled_by_first_step"] = compiled_graphs()
        loss = prep.bind(batch)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        record |= step_times(loss, optimizer, ctx.device, args)
        record["tokens_per_s"] = args.batch * ctx.sizes.seq / (record["step_ms"] / 1e3)
        if ctx.device.type == "cuda":
            record["peak_mib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
        del loss
        record |= loss_alone(prep, inputs, args)
        record["loss_share"] = record["loss_ms"] / record["step_ms"]
        if compiled:
            record["compiled_by_timing_end"] = compiled_graphs()
        del inputs
        if not args.no_search and ctx.device.type == "cuda":
            record |= at_largest_batch(prep, optimizer, args)
        record["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - a failing method is recorded, the others still run
        record |= {"status": "error", "reason": f"{type(error).__name__}: {error}"[:300]}
    finally:
        del prep, optimizer
        recover_device()
    return record


def time_again(method: Method, compiled: bool, ctx: Context, args: Any, pass_index: int) -> dict[str, Any]:
    """Another pass of the step timing alone, on a fresh student (``--repeats``)."""
    record: dict[str, Any] = {"method": method.name, "task": method.task, "compile": compiled, "pass": pass_index}
    try:
        prep = prepare(method, compiled, ctx, args)
        optimizer = torch.optim.AdamW(prep.student.parameters(), lr=1e-4)
        loss = prep.bind(make_batch(args.batch, ctx.sizes, ctx.device, seed=args.seed))
        train_step(loss, optimizer)  # compiles, and AdamW's state
        record |= step_times(loss, optimizer, ctx.device, args) | {"status": "ok"}
        del prep, optimizer, loss
    except Exception as error:  # noqa: BLE001 - recorded, the others still run
        record |= {"status": "error", "reason": f"{type(error).__name__}: {error}"[:300]}
    recover_device()
    return record


def check(records: list[dict[str, Any]]) -> list[str]:
    """The --small check: every method that ran matches its task's reference within fp32 tolerance."""
    failures = []
    for r in records:
        if r["status"] == "skipped" or "pass" in r:
            continue
        if r["status"] != "ok" or "loss_rel_err" not in r:
            failures.append(f"{r['method']} compile={r['compile']}: {r['status']} {r.get('reason', 'no reference')}")
            continue
        worst_grad = max(r["grad_rel_err"].values())
        if r["loss_rel_err"] > CE_TOLERANCE["loss"] or worst_grad > CE_TOLERANCE["grad"]:
            failures.append(f"{r['method']}: loss {r['loss_rel_err']:.1e}, grads {worst_grad:.1e}")
    return failures


def versions(device: torch.device) -> dict[str, Any]:
    info = environment(device)
    for distribution in ("transformers", "liger-kernel", "cut-cross-entropy", "trl"):
        try:
            info[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            info[distribution] = None
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU: tiny fp32 models, checked")
    parser.add_argument("--compile", action="store_true", help="also run every method compiled")
    parser.add_argument("--compile-only", action="store_true", help="run every method compiled only")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch of the timed steps (GPU 4, small 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (GPU 3, small 0)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (GPU 10, small 2)")
    parser.add_argument("--repeats", type=int, default=None, help="passes of the step timing (GPU 2, small 1)")
    parser.add_argument("--topk", type=int, default=None, help="orda_topk's k (GPU 64, small the vocabulary)")
    parser.add_argument("--max-batch", type=int, default=64, help="cap of the largest-batch search")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--methods", nargs="*", default=None, help="these methods, in this order (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for train_step.jsonl")
    args = parser.parse_args(argv)
    small = args.small
    args.batch = args.batch or (2 if small else 4)
    args.warmup = args.warmup if args.warmup is not None else (0 if small else 3)
    args.steps = args.steps or (2 if small else 10)
    args.repeats = args.repeats or (1 if small else 2)
    args.topk = args.topk or (SMALL_SIZES.vocab if small else 64)
    unknown = set(args.methods or ()) - {m.name for m in METHODS}
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; the methods are {[m.name for m in METHODS]}")
    return args


def emit(line: dict[str, Any], record_file: IO[str] | None) -> None:
    """One JSON line to stdout and, with ``--out``, to ``train_step.jsonl`` (flushed)."""
    text = json.dumps(line)
    print(text, flush=True)
    if record_file is not None:
        record_file.write(text + "\n")
        record_file.flush()


def run_setting(compiled: bool, methods: list[Method], ctx: Context, args: Any, emit_line: Callable) -> list[dict]:
    """Every method once with every measurement, then ``--repeats`` − 1 timing passes, each in the
    reverse order of the one before (a drift over the run shows as a difference between passes)."""
    ctx.compiled = compiled
    refs, records = References(), []
    for method in methods:
        started = time.perf_counter()
        record = run_method(method, compiled, ctx, refs, args) | {"wall_s": time.perf_counter() - started}
        if record["status"] == "skipped":
            print(f"skip {method.name}: {record['reason']}", flush=True)
        records.append(record)
        emit_line(record)
    ran = [m for m, r in zip(methods, records) if r["status"] != "skipped"]
    for pass_index in range(1, args.repeats):
        for method in ran[::-1] if pass_index % 2 else ran:
            records.append(time_again(method, compiled, ctx, args, pass_index))
            emit_line(records[-1])
    ctx.release_teacher()
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = SMALL_SIZES if args.small else GPU_SIZES
    device = torch.device("cpu" if args.small else "cuda")
    ctx = Context(sizes, device, args.topk, args.seed)
    by_name = {m.name: m for m in METHODS}
    methods = list(METHODS) if args.methods is None else [by_name[name] for name in args.methods]
    header = {"environment": versions(device), "vocab": sizes.vocab, "seq": sizes.seq, "args": vars(args)}
    record_file = None
    if args.out:  # each line written as it comes: a run stopped at a time limit keeps what it measured
        Path(args.out).mkdir(parents=True, exist_ok=True)
        record_file = (Path(args.out) / "train_step.jsonl").open("w")
    emit(header, record_file)
    settings = (True,) if args.compile_only else (False, True) if args.compile else (False,)
    records = [
        r
        for compiled in settings
        for r in run_setting(compiled, methods, ctx, args, lambda line: emit(line, record_file))
    ]
    if record_file is not None:
        record_file.close()
    if not args.small:
        return 0
    failures = check(records)
    for failure in failures:
        print(f"  mismatch {failure}")
    print("check FAIL" if failures else "check PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
