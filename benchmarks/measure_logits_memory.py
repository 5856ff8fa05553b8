"""Peak memory of ``orda_tp.KDLoss`` with ``chunk_size`` set, against one fp32 copy of the logits.

``KDLoss`` reads logits the caller already holds, so the inputs (student and teacher logits) and
the student's gradient exist whatever the loss does; what the loss adds on top is its workspace.
This script measures that workspace, forward and backward, and compares it with ``BT × V × 4``
bytes, one fp32 copy of the logits (what an unchunked loss makes several of: NeMo's ``KDLoss``
upcasts both sides to fp32 and keeps their log-softmax for backward). For context it also measures
the textbook full-logits forward KL (fp32 log-softmax of both sides, autograd).

Each (loss, dtype) pair runs in a fresh subprocess, which:

1. allocates and touches the inputs (student logits requiring grad, teacher logits, labels),
2. runs the loss once on a tiny shape, so that one-time library and allocator set-up is not counted,
3. resets the peak (CPU: the RSS high-water mark, as ``measure_memory.py`` does; CUDA:
   ``torch.cuda.reset_peak_memory_stats``) and reads the baseline,
4. runs the forward pass and reads the peak, then the backward pass and reads the peak again.

Reported: the forward peak above the baseline, and the backward peak above the baseline, each minus
the gradient of the student logits (``BT × V`` in the logits' dtype, which backward must return)
once it exists: ``KDLoss`` forms it in forward (for a unit upstream gradient, scaled in place by
backward), the textbook loss in backward. The
script exits non-zero when KDLoss's forward or backward workspace reaches one fp32 copy of the
logits. Linux only on CPU (it reads ``/proc/self``); ``--device cuda`` measures on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Run from a checkout without installing: the repository root holds `orda_tp`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orda_tp  # noqa: E402
from benchmarks.measure_memory import DTYPES, RESULT_PREFIX, read_rss_kib, reset_peak_rss, run_json_worker  # noqa: E402

LOSSES = ("kdloss", "textbook")
MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--worker`` is the internal per-subprocess mode."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bt", type=int, default=4096, help="rows (batch × sequence)")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--chunk-size", type=int, default=256, help="KDLoss(chunk_size=...): rows per chunk")
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=LOSSES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Worker: one loss, one dtype, in a fresh process.
# --------------------------------------------------------------------------------------------------


def make_inputs(bt: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Random leaf inputs; every page is written, so it is resident before the baseline."""
    generator = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(0, vocab, (bt,), generator=generator, device=device)
    labels[::7] = -100
    return {
        "student": (2 * torch.randn(bt, vocab, generator=generator, device=device)).to(dtype).requires_grad_(),
        "teacher": (2 * torch.randn(bt, vocab, generator=generator, device=device)).to(dtype),
        "labels": labels,
    }


def textbook_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float):
    """``T²·KL(q‖p)`` averaged over valid rows, on full fp32 log-probabilities."""
    valid = labels != -100
    logq = F.log_softmax(teacher[valid].float() / temperature, dim=-1)
    logp = F.log_softmax(student[valid].float() / temperature, dim=-1)
    return temperature**2 * (logq.exp() * (logq - logp)).sum(-1).mean()


class Peak:
    """The peak memory since :meth:`reset`, in MiB above the baseline read there."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.baseline = 0

    def reset(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            self.baseline = reset_peak_rss() * 1024

    def read_mib(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.baseline) / MIB
        return (read_rss_kib()[1] * 1024 - self.baseline) / MIB


def run_worker(args: argparse.Namespace) -> None:
    """Measure one (loss, dtype) pair and print it as one ``RESULT {json}`` line."""
    (dtype_name,) = args.dtype
    dtype = DTYPES[dtype_name]
    if args.worker == "kdloss":
        criterion = orda_tp.KDLoss(temperature=args.temperature, chunk_size=args.chunk_size)
    else:

        def criterion(student, teacher, labels):
            return textbook_loss(student, teacher, labels, args.temperature)

    warm = make_inputs(16, 256, dtype, args.device, args.seed)
    criterion(warm["student"], warm["teacher"], warm["labels"]).backward()
    inputs = make_inputs(args.bt, args.vocab, dtype, args.device, args.seed)
    peak = Peak(args.device)
    peak.reset()
    start = time.perf_counter()
    loss = criterion(inputs["student"], inputs["teacher"], inputs["labels"])
    forward_mib = peak.read_mib()
    loss.backward()
    backward_mib = peak.read_mib()
    seconds = time.perf_counter() - start
    gradient_mib = inputs["student"].grad.numel() * inputs["student"].grad.element_size() / MIB
    if args.worker == "kdloss":  # its forward holds the student's gradient already
        forward_mib -= gradient_mib
    result = {
        "loss": args.worker,
        "dtype": dtype_name,
        "value": float(loss),
        "forward_mib": forward_mib,
        "backward_mib": backward_mib - gradient_mib,
        "gradient_mib": gradient_mib,
        "seconds": seconds,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------
# Driver: spawn the workers, print the table and the verdict.
# --------------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, loss: str, dtype: str) -> dict[str, float]:
    """One worker's result (:func:`measure_memory.run_json_worker`)."""
    script = str(Path(__file__).resolve())
    options = {
        "--bt": args.bt,
        "--vocab": args.vocab,
        "--dtype": dtype,
        "--chunk-size": args.chunk_size,
        "--temperature": args.temperature,
        "--device": args.device,
        "--seed": args.seed,
    }
    flags = [str(item) for option in options.items() for item in option]
    return run_json_worker([sys.executable, script, "--worker", loss, *flags], f"{loss}/{dtype}")


def main(argv: list[str] | None = None) -> int:
    """Measure both losses for every dtype; returns 1 when KDLoss reaches one fp32 copy."""
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return 0
    fp32_copy = args.bt * args.vocab * 4 / MIB
    print(
        f"loss-time peak memory ({args.device}) above the inputs: BT={args.bt} V={args.vocab}, forward KL at "
        f"T={args.temperature}, KDLoss(chunk_size={args.chunk_size}); one fp32 copy of the logits = "
        f"{fp32_copy:.1f} MiB"
    )
    print(
        f"{'loss':<9} {'dtype':<9} {'forward (MiB)':>14} {'backward - grad (MiB)':>22} {'grad (MiB)':>11} "
        f"{'time (s)':>9} {'loss value':>12}"
    )
    failed = False
    for dtype in args.dtype:
        results = {loss: measure(args, loss, dtype) for loss in LOSSES}
        for loss, r in results.items():
            print(
                f"{loss:<9} {dtype:<9} {r['forward_mib']:>14.1f} {r['backward_mib']:>22.1f} "
                f"{r['gradient_mib']:>11.1f} {r['seconds']:>9.2f} {r['value']:>12.6f}"
            )
        workspace = max(results["kdloss"]["forward_mib"], results["kdloss"]["backward_mib"])
        verdict = "OK" if workspace < fp32_copy else "FAIL"
        print(f"KDLoss {dtype}: workspace {workspace:.1f} MiB = {workspace / fp32_copy:.3f} fp32 copies {verdict}")
        failed |= verdict == "FAIL"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
