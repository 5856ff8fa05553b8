"""Time the generated kernels over candidate tile shapes on a CUDA device: how the entries of
``orda_tp/kernels/tiles.py`` were chosen.

    python3 benchmarks/tune_kernels.py [--rows 256,1024] [--cols 64128,128256,256000]

For each kernel (round-1 partition, round-2 sums and logit gradients of forward KL + CE, fp32
logits, bf16 gradients) and each (rows, columns) shape, every candidate's median time over 20
launches (``triton.testing.do_bench``) and the bandwidth it reaches (bytes read and written /
time); the best candidate of each kernel and column bucket is printed last.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orda_tp import TiedTeacher  # noqa: E402
from orda_tp.engine.logits import LogitGrads  # noqa: E402
from orda_tp.engine.stats import GradRows  # noqa: E402
from orda_tp.kernels import tiles  # noqa: E402
from orda_tp.kernels.ops import TritonBlockMath  # noqa: E402
from orda_tp.options import LossOptions  # noqa: E402
from orda_tp.plan import LossPlan  # noqa: E402

CANDIDATES = [
    tiles.Tiles(block_r=r, block_c=c, num_warps=w, programs=p)
    for r, c in ((1, 2048), (2, 1024), (4, 1024), (4, 512), (8, 512), (8, 256), (16, 256), (16, 128))
    for w in (4, 8)
    for p in (264, 528, 1056)
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,1024")
    parser.add_argument("--cols", default="64128,128256,256000")
    return parser.parse_args()


def launches(rows: int, cols: int) -> dict[str, tuple[object, float]]:
    """Each kernel's launch (a closure) and the bytes it moves: student CE + forward KL (T = 1),
    a frozen teacher, as the benchmark's KD call launches them."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    student = torch.randn(rows, cols, device="cuda", generator=generator) * 2
    teacher = torch.randn(rows, cols, device="cuda", generator=generator) * 2
    labels = torch.randint(0, cols, (rows,), device="cuda", generator=generator)
    plan = LossPlan.build(LossOptions(kl_weight=1.0, teacher_ce_weight=0.0), TiedTeacher(student[:, :1]), cols)
    lse_s = torch.logsumexp(student, 1)
    lse_t = torch.logsumexp(teacher, 1)
    grad = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    ones = torch.ones(rows, device="cuda")
    # The grad step's row constants of student CE + forward KL, in the order the kernel reads them.
    names = ("scale", "lse_s", "lse_u", "lse_v", "keep")
    packed = torch.stack([ones, lse_s, lse_s, lse_t, ones], dim=1).contiguous()
    row_constants = GradRows(packed, names, ones, lse_s, None, None, lse_s, lse_t, ones, {})
    math = TritonBlockMath()
    logits_bytes = 2 * rows * cols * 4
    return {
        "partition": (lambda: math.partition(student, teacher, labels, 0, plan.families), logits_bytes),
        "sums": (lambda: math.kl_sums(plan, student, teacher, labels, 0, lse_s, lse_t), logits_bytes),
        "grads": (
            lambda: math.stage_logit_grads(plan, row_constants, student, teacher, labels, 0, LogitGrads(grad, None)),
            logits_bytes + rows * cols * 2,
        ),
    }


def main() -> None:
    args = parse_args()
    best: dict[tuple[str, bool], list[tuple[float, tiles.Tiles]]] = defaultdict(list)
    for rows in (int(r) for r in args.rows.split(",")):
        for cols in (int(c) for c in args.cols.split(",")):
            for kind, (launch, moved) in launches(rows, cols).items():
                results = []
                for candidate in CANDIDATES:
                    tiles.CUDA_TILES[(kind, cols >= 1 << 15)] = candidate
                    try:
                        ms = triton.testing.do_bench(launch, warmup=5, rep=20, return_mode="median")
                    except Exception as error:  # noqa: BLE001  (a tile too large for this kernel)
                        print(f"  {kind} {candidate}: {type(error).__name__}")
                        continue
                    results.append((ms, candidate))
                results.sort(key=lambda item: item[0])
                for ms, candidate in results[:3]:
                    rate = moved / ms / 1e9  # bytes per millisecond / 1e9 = TB/s
                    print(f"{kind:<9} rows={rows:<5} cols={cols:<7} {ms * 1e3:8.1f} us {rate:5.2f} TB/s {candidate}")
                slowest = results[-1]
                print(f"{kind:<9} rows={rows:<5} cols={cols:<7} slowest {slowest[0] * 1e3:8.1f} us {slowest[1]}")
                for ms, candidate in results:
                    best[(kind, cols >= 1 << 15)].append((ms / moved, candidate))
    print("best per kernel and column bucket (summed relative time over the shapes):")
    for key, entries in sorted(best.items()):
        totals: dict[tiles.Tiles, list[float]] = defaultdict(list)
        for per_byte, candidate in entries:
            totals[candidate].append(per_byte)
        shapes = max(len(times) for times in totals.values())
        complete = {candidate: sum(times) for candidate, times in totals.items() if len(times) == shapes}
        winner = min(complete, key=complete.__getitem__)
        print(f"  {key}: {winner}")


if __name__ == "__main__":
    main()
