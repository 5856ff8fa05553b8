"""Speed and memory of the logits-level losses (``orda_tp.KDLoss``, ``orda_tp.flash_ce_kd_loss``)
against the memory floor, in one command. Correctness is the tests' and ``checks/gpu_check.py``'s.

What is timed: forward and backward of ``KDLoss`` (forward KL, T = 1) on logits the caller holds,
``torch.autograd.grad(loss, student_logits)``; and ``flash_ce_kd_loss``'s per-token scores (no
gradient; its teacher is ``hidden · weightᵀ`` formed block by block). bf16 logits of standard
deviation 2 (fp32 with ``--small``), BT = 8192 rows, 1 label in 7 ignored; the library's default
chunking and ``chunk_size=1024`` beside it; a NeMo-style KD on full fp32 copies for reference.

Floors (HBM traffic at ``--bandwidth`` TB/s, 4.3 on an H200): ``one pass`` = one read of both
logits and one write of the gradient (``3·BT·V·2`` bytes in bf16); ``two passes`` = what a
statistics pass and a gradient pass need at least (``5·BT·V·2``). ``flash_ce_kd_loss`` also forms
its teacher's logits, a ``2·BT·H·V`` FLOP GEMM (printed as its GEMM floor at 788 TFLOP/s). The
issue's target for KDLoss is 1.5 × the two-pass floor, and a workspace (peak above the inputs and
the returned gradient) of at most 64 MiB. Median of 10 timed calls after 3 warm-ups (CUDA events); on the CPU 2 after 1.

Outputs in ``--out`` (default $OUT, else ./bench_logits_out): bench_logits.log, bench_logits.json.

Commands:
  python3 benchmarks/bench_logits.py --out $OUT           # one GPU
  python3 benchmarks/bench_logits.py --small --device cpu  # the CPU: tiny shapes
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orda_tp  # noqa: E402
from benchmarks.bench import MATMUL_TFLOPS, Timing, measure  # noqa: E402
from benchmarks.harness import IGNORE_EVERY, IGNORE_INDEX, Reporter, Runtime, add_common_args, run_script  # noqa: E402

SHAPES = ((8192, 128256), (8192, 256000))
SMALL_SHAPES = ((64, 203),)
HIDDEN = 4096  # flash_ce_kd_loss's teacher hidden size
TARGET_FLOOR_RATIO, TARGET_WORKSPACE_MIB = 1.5, 64.0
Step = Callable[[], tuple[Tensor, tuple[Tensor, ...]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_out="bench_logits_out")
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM TB/s of the floors (H200: 4.3)")
    return parser.parse_args(argv)


def inputs(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    student = (torch.randn(rows, vocab, generator=generator, device=device) * 2).to(dtype)
    teacher = (torch.randn(rows, vocab, generator=generator, device=device) * 2).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator, device=device)
    labels[::IGNORE_EVERY] = IGNORE_INDEX
    return student.requires_grad_(), teacher, labels


def kd_step(student: Tensor, teacher: Tensor, labels: Tensor, **keywords: object) -> Step:
    criterion = orda_tp.KDLoss(**keywords)  # type: ignore[arg-type]

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        loss = criterion(student, teacher, labels)
        return loss.detach(), torch.autograd.grad(loss, student)

    return step


def nemo_step(student: Tensor, teacher: Tensor, labels: Tensor) -> Step:
    """NeMo AutoModel's KDLoss: fp32 copies, log-softmax of both sides, masked mean."""

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        valid = labels != IGNORE_INDEX
        log_p = torch.log_softmax(student.float(), dim=-1)
        q = torch.softmax(teacher.float(), dim=-1)
        per_row = (q * (torch.log(q.clamp_min(1e-30)) - log_p)).sum(-1)
        loss = (per_row * valid).sum() / valid.sum()
        return loss.detach(), torch.autograd.grad(loss, student)

    return step


def flash_step(student: Tensor, labels: Tensor, device: torch.device, hidden: int) -> Step:
    generator = torch.Generator(device=device).manual_seed(1)
    rows, vocab = student.shape
    teacher_hidden = torch.randn(rows, hidden, generator=generator, device=device).to(student.dtype)
    weight = (torch.randn(vocab, hidden, generator=generator, device=device) * (2 / hidden**0.5)).to(student.dtype)
    logits = student.detach()

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        ce, kd = orda_tp.flash_ce_kd_loss(logits, teacher_hidden, weight, labels, ignore_index=IGNORE_INDEX)
        return kd.sum(), ()

    return step


def report(
    reporter: Reporter, label: str, timing: Timing, floors: tuple[float, float], target: bool, gemm_ms: float = 0.0
) -> None:
    one, two = floors
    ratio = timing.ms / two
    verdict = ""
    if target:
        met = ratio <= TARGET_FLOOR_RATIO and (timing.workspace_mib or 0.0) <= TARGET_WORKSPACE_MIB
        limits = f"<= {TARGET_FLOOR_RATIO} × two-pass, <= {TARGET_WORKSPACE_MIB:g} MiB"
        verdict = f"  target {limits}: {'met' if met else 'misses'}"
    workspace = "-" if timing.workspace_mib is None else f"{timing.workspace_mib:.0f}"
    if gemm_ms:
        verdict = f"  + its teacher GEMM: floor {gemm_ms:.2f} ms"
    reporter.line(
        f"{label:<44} {timing.ms:8.2f} ms  spread {timing.spread_ms:5.2f}  one-pass {one:5.2f}  "
        f"two-pass {two:5.2f}  ÷ two-pass {ratio:5.2f}  workspace {workspace:>6} MiB{verdict}"
    )
    reporter.data.setdefault("rows", []).append(
        {"case": label, "ms": timing.ms, "spread_ms": timing.spread_ms, "workspace_mib": timing.workspace_mib,
         "one_pass_ms": one, "two_pass_ms": two, "ratio_two_pass": ratio, "gemm_floor_ms": gemm_ms}
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def body(reporter: Reporter, runtime: Runtime) -> None:
        device = runtime.device
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        hidden = 64 if args.small else HIDDEN
        reporter.line(f"== logits-level losses, {dtype}, floors at {args.bandwidth} TB/s")
        for rows, vocab in SMALL_SHAPES if args.small else SHAPES:
            student, teacher, labels = inputs(rows, vocab, dtype, device)
            size = rows * vocab * student.element_size()
            floors = (3 * size / args.bandwidth / 1e9, 5 * size / args.bandwidth / 1e9)
            shape = f"BT{rows}_V{vocab}"
            gemm_ms = 2 * rows * hidden * vocab / MATMUL_TFLOPS / 1e9
            cases: list[tuple[str, Step, bool, float]] = [
                (f"{shape} KDLoss default", kd_step(student, teacher, labels), True, 0.0),
                (f"{shape} KDLoss chunk_size=1024", kd_step(student, teacher, labels, chunk_size=1024), False, 0.0),
                (f"{shape} NeMo-style KD (fp32 copies)", nemo_step(student, teacher, labels), False, 0.0),
                (f"{shape} flash_ce_kd_loss (no grad)", flash_step(student, labels, device, hidden), False, gemm_ms),
            ]  # fmt: skip
            for label, step, target, gemm in cases:
                try:
                    report(reporter, label, measure(step, device), floors, target, gemm)
                except torch.OutOfMemoryError:
                    reporter.line(f"{label:<44} out of memory")
                reporter.dump()
            del student, teacher, labels

    return run_script(args, "bench_logits", body)


if __name__ == "__main__":
    sys.exit(main())
