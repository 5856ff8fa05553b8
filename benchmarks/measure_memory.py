"""Peak loss-time CPU memory of the chunked ``torch`` backend versus the full-logits ``reference`` backend.

The loss is a tied-teacher distillation loss, student CE + KL at temperature T (one row of the table
per ``--kl-divergence`` variant), forward and backward once. Each (variant, backend) pair runs in its
own fresh subprocess, which:

1. allocates and touches the inputs (hidden states, head weight, teacher hidden states, labels),
2. runs the same loss once on a tiny shape, so that one-time library and allocator set-up is not counted,
3. resets the kernel's RSS high-water mark (``/proc/self/clear_refs``) and reads the baseline ``VmRSS``,
4. runs the loss forward and backward and reads the high-water mark ``VmHWM``.

Workers run with a fixed glibc mmap threshold, so that freed blocks go back to the kernel at once.
The reported number is ``VmHWM − baseline``: everything the loss and its gradients added on top of the
inputs. The script exits non-zero when the chunked backend's peak exceeds ``--max-ratio`` (1/8) of the
reference's for any variant. Linux only (it reads ``/proc/self``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

# Run from a checkout without installing: the repository root holds `orda_tp`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orda_tp  # noqa: E402

BACKENDS = ("reference", "torch")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
RESULT_PREFIX = "RESULT "
RESET_SLACK_KIB = 1024  # RSS may grow a few pages between the reset and the read that checks it
# A fixed glibc mmap threshold: every block of 64 KiB or more is mapped on allocation and unmapped on free,
# so RSS follows live memory instead of freed blocks lingering in (and being reused from) the heap.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--worker`` is the internal per-subprocess mode."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bt", type=int, default=4096, help="rows (batch × sequence)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--kl-divergence", nargs="+", default=["forward", "reverse"], choices=orda_tp.KL_VARIANTS)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument(
        "--workspace-mib", type=int, default=None, help="KernelConfig.workspace_mib (default: profile's)"
    )
    parser.add_argument("--max-ratio", type=float, default=1 / 8, help="fail when torch/reference exceeds this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Worker: one backend, one variant, in a fresh process.
# --------------------------------------------------------------------------------------------------


def read_rss_kib() -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` in KiB from one read of ``/proc/self/status``: resident now, and its high-water mark."""
    status = Path("/proc/self/status").read_text()
    values = []
    for field in ("VmRSS", "VmHWM"):
        match = re.search(rf"^{field}:\s+(\d+) kB$", status, flags=re.MULTILINE)
        if match is None:
            raise RuntimeError(f"/proc/self/status has no {field} field")
        values.append(int(match.group(1)))
    return values[0], values[1]


def reset_peak_rss() -> int:
    """Reset the RSS high-water mark to the current RSS; returns that baseline in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    baseline, peak = read_rss_kib()
    if peak - baseline > RESET_SLACK_KIB:
        raise RuntimeError(f"could not reset VmHWM ({peak} kB) to VmRSS ({baseline} kB)")
    return baseline


def make_inputs(bt: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random leaf inputs of the loss; every page is written, so it is resident before the baseline."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "student_hidden": torch.randn(bt, hidden, generator=generator).to(dtype).requires_grad_(True),
        "weight": (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(dtype).requires_grad_(True),
        "teacher_hidden": torch.randn(bt, hidden, generator=generator).to(dtype),
        "labels": torch.randint(0, vocab, (bt,), generator=generator),
    }


def loss_and_backward(inputs: dict[str, torch.Tensor], args: argparse.Namespace, variant: str) -> None:
    """Tied-teacher KD loss (student CE + T²·KL, frozen teacher), forward and backward once."""
    config = None if args.workspace_mib is None else orda_tp.KernelConfig(workspace_mib=args.workspace_mib)
    output = orda_tp.distillation_loss(
        inputs["student_hidden"],
        inputs["weight"],
        inputs["labels"],
        orda_tp.TiedTeacher(inputs["teacher_hidden"]),
        teacher_ce_weight=0.0,
        kl_weight=1.0,
        kl_temperature=args.temperature,
        kl_divergence=variant,
        backend=args.worker,
        config=config,
    )
    output.loss.backward()


def run_worker(args: argparse.Namespace) -> None:
    """Measure one (backend, variant) pair and print it as one ``RESULT {json}`` line."""
    torch.manual_seed(args.seed)
    (variant,) = args.kl_divergence
    dtype = DTYPES[args.dtype]
    loss_and_backward(make_inputs(16, args.hidden, 256, dtype, args.seed), args, variant)  # warm-up
    inputs = make_inputs(args.bt, args.hidden, args.vocab, dtype, args.seed)
    baseline = reset_peak_rss()
    start = time.perf_counter()
    loss_and_backward(inputs, args, variant)
    seconds = time.perf_counter() - start
    _, peak = read_rss_kib()
    result = {
        "backend": args.worker,
        "variant": variant,
        "peak_mib": (peak - baseline) / 1024,
        "seconds": seconds,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------
# Driver: spawn the workers, print the table and the ratios.
# --------------------------------------------------------------------------------------------------


def worker_command(args: argparse.Namespace, backend: str, variant: str) -> list[str]:
    """The command line of a worker subprocess measuring ``backend`` on ``variant``."""
    options = {
        "--bt": args.bt,
        "--hidden": args.hidden,
        "--vocab": args.vocab,
        "--dtype": args.dtype,
        "--temperature": args.temperature,
        "--seed": args.seed,
    }
    if args.workspace_mib is not None:
        options["--workspace-mib"] = args.workspace_mib
    flags = [str(item) for option in options.items() for item in option]
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--worker", backend, "--kl-divergence", variant, *flags]


def run_json_worker(command: list[str], label: str) -> dict[str, float]:
    """Run a worker process (its own peak RSS) and parse the result it prints after
    ``RESULT_PREFIX``; a failed worker fails the script with its stderr."""
    completed = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **WORKER_ENV})
    if completed.returncode != 0:
        sys.stderr.write(completed.stderr)
        raise SystemExit(f"worker {label} failed with exit code {completed.returncode}")
    lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def measure(args: argparse.Namespace, backend: str, variant: str) -> dict[str, float]:
    return run_json_worker(worker_command(args, backend, variant), f"{backend}/{variant}")


def main(argv: list[str] | None = None) -> int:
    """Measure every variant on both backends; returns 1 when a ratio exceeds ``--max-ratio``."""
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return 0
    print(
        f"loss-time peak RSS above inputs: BT={args.bt} H={args.hidden} V={args.vocab} {args.dtype}, "
        f"tied teacher, student CE + KL (T={args.temperature}), forward + backward"
    )
    print(f"{'variant':<12} {'backend':<10} {'peak - baseline (MiB)':>22} {'time (s)':>9}")
    failed = False
    for variant in args.kl_divergence:
        results = {backend: measure(args, backend, variant) for backend in BACKENDS}
        for backend, result in results.items():
            print(f"{variant:<12} {backend:<10} {result['peak_mib']:>22.1f} {result['seconds']:>9.2f}")
        ratio = results["torch"]["peak_mib"] / results["reference"]["peak_mib"]
        verdict = "OK" if ratio <= args.max_ratio else "FAIL"
        print(f"ratio {variant}: torch/reference = {ratio:.4f} (limit {args.max_ratio:.4f}) {verdict}")
        failed |= verdict == "FAIL"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
