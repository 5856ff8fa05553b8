"""A whole training step (forward, backward, AdamW step) of Llama-style models with each loss.

Users judge a fused loss by their training step. The models are ``LlamaForCausalLM`` built from
``transformers`` configs (no download), vocabulary 128256, bf16 weights, sequence 4096, sdpa
attention:

- student (~0.47B): hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads, head tied to the
  embeddings (Qwen2-0.5B-like);
- teacher (~1.5B, frozen): hidden 1536, intermediate 8960, 28 layers, 12 heads, 2 KV heads, tied.

CE methods (the student's next-token cross-entropy):
``hf`` (``model(input_ids, labels=labels).loss``), ``liger`` (Liger-Kernel's Llama patch, its fused
linear CE only: RoPE, RMSNorm and SwiGLU stay transformers', so only the loss differs), ``cce``
(cut-cross-entropy's ``cce_patch``), ``orda`` (``DistillationHead.from_linear(model.lm_head)``, the
loss from the head on the final hidden states, as ``examples/hf_trainer_distill.py`` does).

KD methods (student CE + forward KL(teacher ‖ student), T = 1, weights 1 and 1):
``logits_kd`` (full student and teacher logits, log_softmax, KL, as TRL's GKD computes it at
beta = 0; the teacher under no_grad), ``liger_jsd`` (Liger's chunked ``LigerFusedLinearJSDLoss``
at beta = 0, which is ``kl_div(student_logp, teacher_logp, log_target=True)``: forward KL, with its
own CE as the hard loss), ``orda_teacher_head`` (``TeacherHead(teacher_hidden, teacher.lm_head)``,
``teacher_ce_weight=0``), ``orda_topk`` (a top-k cache of the same teacher from
``orda_tp.teacher_topk``, made before the step and not timed, ``tail="uniform"``).

Each JSON line (one per method × compile setting): the median step time over ``--steps`` timed
steps after ``--warmup``, tokens/s, peak memory (``torch.cuda.max_memory_allocated`` over the
timed steps: weights, gradients, AdamW state and activations), the largest micro-batch that fits
(doubling, then bisection, catching ``torch.cuda.OutOfMemoryError``; ``--max-batch``,
``--no-search``) and the loss share: the step is timed again with the head and loss replaced by a
trivial loss on the decoder's output (``mean(hidden²)``, the teacher's forward kept where the method
runs it), and ``loss_share = 1 − trivial_ms / step_ms`` (head GEMMs, loss, their backward).
With ``--compile`` every method runs again with the student compiled (``student.compile()`` and
``student.model.compile()``; the frozen teacher stays eager). Every method starts from the same
initial weights and batch; its first step's loss and gradients
are compared with the reference of its task (``hf`` for CE, ``logits_kd`` for KD).

    python benchmarks/train_step.py                     # one GPU, eager
    python benchmarks/train_step.py --compile --out DIR # eager and torch.compile, DIR/train_step.jsonl
    python benchmarks/train_step.py --small             # CPU: tiny fp32 models, one step each, checked

``--small`` asserts that every method's loss (1e-5 relative) and gradients (1e-4 relative to the
largest entry) match its reference, with k = V for ``orda_topk`` (then exact), prints ``check PASS``
or ``check FAIL`` and exits 1 on FAIL. Methods whose package does not import are skipped, with the
reason printed and recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
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

IGNORE_INDEX = -100
IGNORE_EVERY = 7  # 1 label in 7 is IGNORE_INDEX (prompt or padding)
CE_TOLERANCE = {"loss": 1e-5, "grad": 1e-4}  # fp32, --small
CHECKED_PARAMETERS = ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")
KD_OPTIONS: dict[str, Any] = dict(
    student_ce_weight=1.0, kl_weight=1.0, kl_temperature=1.0, kl_divergence="forward", teacher_ce_weight=0.0
)

Bound = Callable[[], Tensor]  # the step's loss for one batch


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


@dataclass
class Context:
    sizes: Sizes
    device: torch.device
    teacher: LlamaForCausalLM
    topk: int


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


def make_batch(batch_size: int, sizes: Sizes, device: torch.device, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, sizes.vocab, (batch_size, sizes.seq), generator=generator)
    labels = input_ids.clone()
    labels[:, 3::IGNORE_EVERY] = IGNORE_INDEX
    return Batch(input_ids.to(device), labels.to(device))


def final_hidden_states(model: LlamaForCausalLM, input_ids: Tensor) -> Tensor:
    """The (B, T, H) states ``lm_head`` reads, through the model's own forward; an empty
    ``logits_to_keep`` builds no logits (``examples/hf_trainer_distill.py``)."""
    no_position = torch.empty(0, dtype=torch.long, device=input_ids.device)
    outputs = model(input_ids=input_ids, output_hidden_states=True, logits_to_keep=no_position, use_cache=False)
    return outputs.hidden_states[-1]


def next_token_rows(hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Position t's state with label t + 1, as ``ForCausalLMLoss`` shifts them."""
    return hidden[:, :-1, :], labels[:, 1:]


# ------------------------------------------------------------------------------------------------ methods
# Each method's ``prepare(student, ctx)`` patches the fresh student if it needs to and returns
# ``bind(batch)``: the untimed preparation of one batch (the top-k cache), giving the step's loss.


def hf_ce(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    return lambda b: lambda: student(input_ids=b.input_ids, labels=b.labels, use_cache=False).loss


def liger_ce(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    liger = import_or_skip("liger_kernel.transformers", ctx)
    liger.apply_liger_kernel_to_llama(
        rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False, swiglu=False, model=student
    )
    return hf_ce(student, ctx)


def cce_ce(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    cce = import_or_skip("cut_cross_entropy.transformers", ctx)
    student = cce.cce_patch(student, reduction="mean")
    return hf_ce(student, ctx)


def orda_ce(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    head = orda_tp.DistillationHead.from_linear(student.lm_head, student_ce_weight=1.0, kl_weight=0.0)
    student.lm_head = head

    def bind(b: Batch) -> Bound:
        return lambda: head(*next_token_rows(final_hidden_states(student, b.input_ids), b.labels)).loss

    return bind


def logits_kd(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    """CE + KL(teacher ‖ student) from the full logits, as TRL's ``generalized_jsd_loss`` at beta=0
    (``kl_div(student_logp, teacher_logp, log_target=True)`` summed over the vocabulary, averaged
    over the rows whose label is not ignored)."""

    def loss(b: Batch) -> Tensor:
        logits = student(input_ids=b.input_ids, use_cache=False).logits[:, :-1].float()
        with torch.no_grad():
            teacher_logits = ctx.teacher(input_ids=b.input_ids, use_cache=False).logits[:, :-1].float()
        labels = b.labels[:, 1:]
        mask = labels != IGNORE_INDEX
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        student_logp, teacher_logp = F.log_softmax(logits, dim=-1), F.log_softmax(teacher_logits, dim=-1)
        kl = F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True).sum(-1)
        return ce + kl[mask].sum() / mask.sum()

    return lambda b: lambda: loss(b)


def teacher_rows(ctx: Context, b: Batch) -> Tensor:
    """The frozen teacher's final hidden states, one row per student row."""
    with torch.no_grad():
        hidden, _ = next_token_rows(final_hidden_states(ctx.teacher, b.input_ids), b.labels)
    return hidden.reshape(-1, hidden.shape[-1])


def liger_jsd(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    chunked = import_or_skip("liger_kernel.chunked_loss", ctx)
    jsd = chunked.LigerFusedLinearJSDLoss(
        weight_hard_loss=1.0, weight_soft_loss=1.0, beta=0.0, ignore_index=IGNORE_INDEX, temperature=1.0
    )

    def loss(b: Batch) -> Tensor:
        hidden, labels = next_token_rows(final_hidden_states(student, b.input_ids), b.labels)
        rows = hidden.reshape(-1, hidden.shape[-1])
        return jsd(rows, student.lm_head.weight, teacher_rows(ctx, b), ctx.teacher.lm_head.weight, labels.reshape(-1))

    return lambda b: lambda: loss(b)


def orda_teacher_head(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    head = orda_tp.DistillationHead.from_linear(student.lm_head, **KD_OPTIONS)
    student.lm_head = head

    def loss(b: Batch) -> Tensor:
        hidden, labels = next_token_rows(final_hidden_states(student, b.input_ids), b.labels)
        return head(hidden, labels, teacher=orda_tp.TeacherHead(teacher_rows(ctx, b), ctx.teacher.lm_head)).loss

    return lambda b: lambda: loss(b)


def orda_topk(student: LlamaForCausalLM, ctx: Context) -> Callable[[Batch], Bound]:
    head = orda_tp.DistillationHead.from_linear(student.lm_head, **KD_OPTIONS)
    student.lm_head = head

    def bind(b: Batch) -> Bound:
        cache = orda_tp.teacher_topk(teacher_rows(ctx, b), ctx.teacher.lm_head.weight, ctx.topk)  # not timed
        teacher = cache.teacher(tail="uniform")

        def loss() -> Tensor:
            hidden, labels = next_token_rows(final_hidden_states(student, b.input_ids), b.labels)
            return head(hidden, labels, teacher=teacher).loss

        return loss

    return bind


def import_or_skip(module: str, ctx: Context) -> Any:
    try:
        imported = __import__(module, fromlist=["_"])
    except ImportError as error:
        raise Skip(f"{type(error).__name__}: {error}") from None
    if ctx.device.type != "cuda":
        raise Skip("its kernels need CUDA")
    return imported


@dataclass(frozen=True)
class Method:
    name: str
    task: str  # "CE" or "KD"
    prepare: Callable[[LlamaForCausalLM, Context], Callable[[Batch], Bound]]
    runs_teacher: bool  # the teacher's forward is part of the step


METHODS = (
    Method("hf", "CE", hf_ce, False),  # the CE reference
    Method("liger", "CE", liger_ce, False),
    Method("cce", "CE", cce_ce, False),
    Method("orda", "CE", orda_ce, False),
    Method("logits_kd", "KD", logits_kd, True),  # the KD reference
    Method("liger_jsd", "KD", liger_jsd, True),
    Method("orda_teacher_head", "KD", orda_teacher_head, True),
    Method("orda_topk", "KD", orda_topk, False),
)
REFERENCE = {"CE": "hf", "KD": "logits_kd"}


def trivial_loss(student: LlamaForCausalLM, ctx: Context, runs_teacher: bool) -> Callable[[Batch], Bound]:
    """The step without head and loss: ``mean(hidden²)`` of the decoder's output (and the teacher's
    forward when the method runs it), for the loss share."""

    def loss(b: Batch) -> Tensor:
        hidden = student.model(input_ids=b.input_ids, use_cache=False).last_hidden_state
        if runs_teacher:
            teacher_rows(ctx, b)
        return hidden.float().square().mean()

    return lambda b: lambda: loss(b)


# ------------------------------------------------------------------------------------------------ measuring


def train_step(loss: Bound, optimizer: torch.optim.Optimizer) -> float:
    value = loss()
    value.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value.item()


def first_step(loss: Bound, student: LlamaForCausalLM, optimizer: torch.optim.Optimizer) -> tuple[float, dict]:
    """One step; its loss and the checked parameters' gradients (fp32, on the CPU), taken before
    the optimizer step."""
    value = loss()
    value.backward()
    grads = {name: student.get_parameter(name).grad.float().cpu() for name in CHECKED_PARAMETERS}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value.item(), grads


def median_step_ms(loss: Bound, optimizer: torch.optim.Optimizer, device: torch.device, args: Any) -> float:
    """The median of ``args.steps`` timed steps after ``args.warmup`` (CUDA events on a GPU)."""
    for _ in range(args.warmup):
        train_step(loss, optimizer)
    sync_device(device)
    times: list[float] = []
    for _ in range(args.steps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            train_step(loss, optimizer)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            started = time.perf_counter()
            train_step(loss, optimizer)
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def fits(bind: Callable[[Batch], Bound], optimizer: torch.optim.Optimizer, ctx: Context, batch_size: int) -> bool:
    """Whether one step at ``batch_size`` runs without running out of GPU memory; memory freed after."""
    try:
        train_step(bind(make_batch(batch_size, ctx.sizes, ctx.device, seed=batch_size)), optimizer)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:  # after the except block: the traceback, and the tensors its frames hold, are gone
        optimizer.zero_grad(set_to_none=True)
        recover_device()


def largest_batch(bind: Callable[[Batch], Bound], optimizer: torch.optim.Optimizer, ctx: Context, cap: int) -> int:
    """Doubling from 1 up to ``cap``, then bisection between the last size that fits and the first
    that does not; 0 when even 1 does not fit."""
    good, bad = 0, None
    size = 1
    while size <= cap:
        if not fits(bind, optimizer, ctx, size):
            bad = size
            break
        good, size = size, size * 2
    if bad is None:  # every power of 2 up to cap fits
        if good == cap or fits(bind, optimizer, ctx, cap):
            return cap
        bad = cap
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(bind, optimizer, ctx, middle) else (good, middle)
    return good


def relative_error(value: Tensor, reference: Tensor) -> float:
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


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


def run_method(method: Method, compiled: bool, ctx: Context, refs: References, args: Any) -> dict[str, Any]:
    """One JSON record: status, first-step loss (and its errors against the reference), timing,
    memory, loss share, largest batch."""
    record: dict[str, Any] = {"method": method.name, "task": method.task, "compile": compiled, "batch": args.batch}
    student = build_llama(ctx.sizes, ctx.sizes.student, ctx.device, seed=args.seed)
    try:
        bind = method.prepare(student, ctx)
    except Skip as reason:
        return record | {"status": "skipped", "reason": str(reason)}
    if compiled:
        student.compile()
        student.model.compile()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    batch = make_batch(args.batch, ctx.sizes, ctx.device, seed=args.seed)
    tokens = args.batch * ctx.sizes.seq
    try:
        loss = bind(batch)
        record["loss"], grads = first_step(loss, student, optimizer)
        compare(record, method, record["loss"], grads, refs)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        record["step_ms"] = median_step_ms(loss, optimizer, ctx.device, args)
        record["tokens_per_s"] = tokens / (record["step_ms"] / 1e3)
        if ctx.device.type == "cuda":
            record["peak_mib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
        trivial = trivial_loss(student, ctx, method.runs_teacher)(batch)
        record["trivial_step_ms"] = median_step_ms(trivial, optimizer, ctx.device, args)
        record["loss_share"] = 1.0 - record["trivial_step_ms"] / record["step_ms"]
        del loss, trivial
        if not args.no_search and ctx.device.type == "cuda":
            record["max_batch"] = largest_batch(bind, optimizer, ctx, args.max_batch)
        record["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - a failing method is recorded, the others still run
        record |= {"status": "error", "reason": f"{type(error).__name__}: {error}"[:300]}
    finally:
        del student, optimizer, bind
        recover_device()
    return record


def check(records: list[dict[str, Any]]) -> list[str]:
    """The --small check: every method that ran matches its task's reference within fp32 tolerance."""
    failures = []
    for r in records:
        if r["status"] == "skipped":
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
    for distribution in ("transformers", "liger-kernel", "cut-cross-entropy"):
        try:
            info[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            info[distribution] = None
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU: tiny fp32 models, one step each, checked")
    parser.add_argument("--compile", action="store_true", help="also run every method under torch.compile")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch of the timed steps (GPU 2, small 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (GPU 3, small 0)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (GPU 10, small 1)")
    parser.add_argument("--topk", type=int, default=None, help="orda_topk's k (GPU 64, small the vocabulary)")
    parser.add_argument("--max-batch", type=int, default=64, help="cap of the largest-batch search")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--methods", nargs="*", default=None, help="a subset of the methods (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for train_step.jsonl")
    args = parser.parse_args(argv)
    small = args.small
    args.batch = args.batch or 2
    args.warmup = args.warmup if args.warmup is not None else (0 if small else 3)
    args.steps = args.steps or (1 if small else 10)
    args.topk = args.topk or (SMALL_SIZES.vocab if small else 64)
    return args


def emit(line: dict[str, Any], record_file: IO[str] | None) -> None:
    """One JSON line to stdout and, with ``--out``, to ``train_step.jsonl`` (flushed)."""
    text = json.dumps(line)
    print(text, flush=True)
    if record_file is not None:
        record_file.write(text + "\n")
        record_file.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = SMALL_SIZES if args.small else GPU_SIZES
    device = torch.device("cpu" if args.small else "cuda")
    teacher = build_llama(sizes, sizes.teacher, device, args.seed + 1, sizes.teacher_init_std)
    teacher.eval().requires_grad_(False)
    ctx = Context(sizes, device, teacher, args.topk)
    methods = [m for m in METHODS if args.methods is None or m.name in args.methods]
    lines: list[dict[str, Any]] = [{"environment": versions(device), "vocab": sizes.vocab, "seq": sizes.seq}]
    record_file = None
    if args.out:  # each line written as it comes: a run stopped at a time limit keeps what it measured
        Path(args.out).mkdir(parents=True, exist_ok=True)
        record_file = (Path(args.out) / "train_step.jsonl").open("w")
    emit(lines[0], record_file)
    refs = References()
    for compiled in (False, True) if args.compile else (False,):
        for method in methods:
            record = run_method(method, compiled, ctx, refs, args)
            if record["status"] == "skipped":
                print(f"skip {method.name}: {record['reason']}", flush=True)
            lines.append(record)
            emit(record, record_file)
    if record_file is not None:
        record_file.close()
    if not args.small:
        return 0
    failures = check(lines[1:])
    for failure in failures:
        print(f"  mismatch {failure}")
    print("check FAIL" if failures else "check PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
