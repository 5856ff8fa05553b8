"""Profile one forward+backward of the loss on a CUDA device: where the time goes.

    python3 benchmarks/profile_loss.py --backend triton --bt 8192 --hidden 4096 --vocab 128256

Prints the wall time of a warm call, the number of kernel launches, the profiled call's wall time
split into the host's time before its first kernel, the device timeline (first kernel to last, with
its idle gaps) and the time after its last kernel, and the top operations by self CUDA time and by
self CPU time (torch.profiler), for the tied-frozen-teacher KD task of the benchmarks (bf16,
student CE + forward KL, 1 label in 7 ignored), or with ``--kd-loss`` for ``KDLoss`` on (BT, V)
bf16 logits of std 2 (forward KL, T = 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orda_tp  # noqa: E402

CALL = "orda_tp call"  # the profiled call's range (its forward, backward and synchronization)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton", choices=("triton", "torch"))
    parser.add_argument("--bt", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--workspace-mib", type=int, default=None, help="KernelConfig.workspace_mib")
    parser.add_argument("--vocab-block", type=int, default=None, help="KernelConfig.vocab_block")
    parser.add_argument("--profile", default="balanced", choices=("balanced", "fast"), help="the loss's profile")
    parser.add_argument("--ce", action="store_true", help="student CE alone (no KL term)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (the median is printed)")
    parser.add_argument("--rows", type=int, default=10, help="rows of each table")
    parser.add_argument(
        "--kd-loss", action="store_true", help="KDLoss on (BT, V) bf16 logits of std 2 instead (forward KL, T = 1)"
    )
    return parser.parse_args()


def fused_step(args: argparse.Namespace) -> Callable[[], None]:
    """One forward and backward of the benchmarks' KD (or CE) task on bf16 hidden states and head."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    scale = args.hidden**-0.5
    hidden = (torch.randn(args.bt, args.hidden, device=device, generator=generator)).bfloat16().requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=device, generator=generator) * scale).bfloat16()
    weight.requires_grad_()
    teacher = torch.randn(args.bt, args.hidden, device=device, generator=generator).bfloat16()
    labels = torch.randint(0, args.vocab, (args.bt,), device=device, generator=generator)
    labels[::7] = -100
    config_kwargs = {}
    if args.workspace_mib is not None:
        config_kwargs["workspace_mib"] = args.workspace_mib
    if args.vocab_block is not None:
        config_kwargs["vocab_block"] = args.vocab_block
    config = orda_tp.KernelConfig(**config_kwargs) if config_kwargs else None

    def step() -> None:
        out = orda_tp.distillation_loss(
            hidden,
            weight,
            labels,
            orda_tp.TiedTeacher(teacher),
            teacher_ce_weight=0.0,
            kl_weight=0.0 if args.ce else 1.0,
            backend=args.backend,
            profile=args.profile,
            config=config,
        )
        torch.autograd.grad(out.loss, [hidden, weight])

    return step


def kd_loss_step(args: argparse.Namespace) -> Callable[[], None]:
    """One forward and backward of ``KDLoss`` (forward KL, T = 1) on (BT, V) bf16 logits of std 2."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    student = (2 * torch.randn(args.bt, args.vocab, device=device, generator=generator)).bfloat16().requires_grad_()
    teacher = (2 * torch.randn(args.bt, args.vocab, device=device, generator=generator)).bfloat16()
    labels = torch.randint(0, args.vocab, (args.bt,), device=device, generator=generator)
    labels[::7] = -100
    kd_loss = orda_tp.KDLoss(backend=args.backend)

    def step() -> None:
        torch.autograd.grad(kd_loss(student, teacher, labels), [student])

    return step


def main() -> None:
    args = parse_args()
    step = kd_loss_step(args) if args.kd_loss else fused_step(args)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    grads = (args.bt * args.vocab if args.kd_loss else (args.bt + args.vocab) * args.hidden) * 2 / 2**20
    task = "KDLoss" if args.kd_loss else "CE" if args.ce else "KD"
    print(
        f"BT={args.bt} H={args.hidden} V={args.vocab} {task} profile={args.profile}: "
        f"median {sorted(times)[len(times) // 2]:.2f} ms of {args.repeats} (min {min(times):.2f}); "
        f"peak above inputs {peak:.0f} MiB, less the returned gradients {peak - grads:.0f} MiB"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(CALL):
            step()
            torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"CUDA kernel executions in one call: {launches}")
    print_timeline(prof.events(), args.rows)
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


def print_timeline(events: list, rows: int) -> None:
    """The device's timeline of one call: from its first kernel's start to its last kernel's end,
    the time kernels ran and the idle gaps between them (the largest ``rows``, with the kernels on
    either side and when they occur)."""
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != CALL),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return
    first = kernels[0].time_range.start
    busy_until, gaps = first, []
    previous = kernels[0].name
    for kernel in kernels:
        if kernel.time_range.start > busy_until:
            gaps.append((kernel.time_range.start - busy_until, busy_until - first, previous, kernel.name))
        if kernel.time_range.end >= busy_until:
            busy_until, previous = kernel.time_range.end, kernel.name
    idle = sum(gap for gap, *_ in gaps)
    span = busy_until - first
    call = next(e for e in events if e.name == CALL and e.device_type == torch.autograd.DeviceType.CPU)
    wall = call.time_range.end - call.time_range.start
    print(
        f"the profiled call: wall {wall / 1e3:.2f} ms (its start to the synchronization's return) = host before "
        f"the first kernel {(first - call.time_range.start) / 1e3:.2f} ms + device timeline {span / 1e3:.2f} ms + "
        f"after the last kernel {(call.time_range.end - busy_until) / 1e3:.2f} ms; wall / timeline {wall / span:.3f}"
    )
    print(
        f"device timeline: first kernel to last {span / 1e3:.2f} ms, kernels running {(span - idle) / 1e3:.2f} ms, "
        f"idle between kernels {idle / 1e3:.2f} ms in {len(gaps)} gaps; the largest:"
    )
    for gap, at, before, after in sorted(gaps, reverse=True)[:rows]:
        print(f"  {gap:8.1f} us at {at / 1e3:6.2f} ms, between {before[:48]} and {after[:48]}")


if __name__ == "__main__":
    main()
