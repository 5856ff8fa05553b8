"""Time the generated kernels over candidate tile shapes on a CUDA device: how the entries of
``orda_tp/kernels/tiles.py`` were chosen.

    python3 benchmarks/tune_kernels.py [--rows 256,1024] [--cols 64128,128256,256000]
    python3 benchmarks/tune_kernels.py --dtype bf16 --rows 8192 --cols 128256,256000 --kinds partition

For each kernel (round-1 partition, round-2 sums and logit gradients of forward KL + CE; fp32
logits as the fused path forms them, or with ``--dtype bf16`` bf16 logits as ``KDLoss`` is given
them, whose tiles go to ``HALF_PRECISION_TILES``; bf16 gradients) and each (rows, columns) shape,
every candidate's median time over 20 launches (``triton.testing.do_bench``) and the bandwidth it
reaches (bytes read and written / time); the best candidate of each kernel and column bucket is
printed last.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orda_tp import TiedTeacher  # noqa: E402
from orda_tp.arguments.options import LossOptions  # noqa: E402
from orda_tp.arguments.plan import LossPlan  # noqa: E402
from orda_tp.engine.logits import LogitGrads  # noqa: E402
from orda_tp.engine.row_formulas import grad_step  # noqa: E402
from orda_tp.engine.stats import GradRows  # noqa: E402
from orda_tp.engine.triton_math import TritonBlockMath  # noqa: E402
from orda_tp.kernels import tiles  # noqa: E402

CANDIDATES = [
    tiles.Tiles(block_r=r, block_c=c, num_warps=w, programs=p)
    for r, c in (
        (1, 4096),
        (1, 2048),
        (2, 2048),
        (2, 1024),
        (4, 1024),
        (4, 512),
        (8, 512),
        (8, 256),
        (16, 256),
        (16, 128),
    )
    for w in (4, 8)
    for p in (264, 528, 1056)
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,1024")
    parser.add_argument("--cols", default="64128,128256,256000")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the logits' dtype")
    parser.add_argument("--kinds", default="partition,sums,grads", help="the kernels to tune")
    parser.add_argument("--programs", default="264,528,1056", help="candidate program targets")
    return parser.parse_args()


def launches(rows: int, cols: int, dtype: torch.dtype) -> dict[str, tuple[object, float]]:
    """Each kernel's launch (a closure) and the bytes it moves: student CE + forward KL (T = 1),
    a frozen teacher, as the benchmark's KD call launches them, on ``dtype`` logits."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    student = (torch.randn(rows, cols, device="cuda", generator=generator) * 2).to(dtype)
    teacher = (torch.randn(rows, cols, device="cuda", generator=generator) * 2).to(dtype)
    labels = torch.randint(0, cols, (rows,), device="cuda", generator=generator)
    plan = LossPlan.build(LossOptions(kl_weight=1.0, teacher_ce_weight=0.0), TiedTeacher(student[:, :1]), cols)
    if dtype == torch.bfloat16:  # given logits (KDLoss) may hold -inf: round 1 counts the unsupported columns
        plan = replace(plan, student_logits_finite=False)
    lse_s = torch.logsumexp(student.float(), 1)
    lse_t = torch.logsumexp(teacher.float(), 1)
    grad = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    ones = torch.ones(rows, device="cuda")
    # The grad step's row constants of student CE + forward KL, in the order the kernel reads them
    # (the CE's coefficients c_p = c_y = 1, c_u = 0).
    values = {"scale": ones, "lse_s": lse_s, "c_p": ones, "c_y": ones, "c_u": 0 * ones}
    values.update(lse_u=lse_s, lse_v=lse_t, keep=ones)
    names = grad_step(plan.step_key).outputs
    assert names == tuple(values)
    packed = torch.stack(list(values.values()), dim=1).contiguous()
    row_constants = GradRows(**values, lse_t=None, c_ce_t=None, consts={}, packed=packed, names=names)
    math = TritonBlockMath()
    assert plan.kl_sums_in_gradient_pass and plan.divergence is not None  # forward KL: round 2 in the gradients
    out, sums = LogitGrads(grad, None), torch.zeros(rows, plan.divergence.num_sums, device="cuda")
    logits_bytes = 2 * rows * cols * student.element_size()
    return {
        "partition": (
            lambda: math.partition(student, teacher, labels, 0, plan.families, plan.column_sums),
            logits_bytes,
        ),
        "sums": (lambda: math.kl_sums(plan, student, teacher, labels, 0, lse_s, lse_t), logits_bytes),
        "grads": (
            lambda: math.stage_logit_grads(plan, row_constants, student, teacher, labels, 0, out, sums),
            logits_bytes + rows * cols * 2,
        ),
    }


def main() -> None:
    args = parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    table = tiles.HALF_PRECISION_TILES if dtype == torch.bfloat16 else tiles.CUDA_TILES
    programs = {int(p) for p in args.programs.split(",")}
    candidates = [candidate for candidate in CANDIDATES if candidate.programs in programs]
    best: dict[tuple[str, bool], list[tuple[float, tiles.Tiles]]] = defaultdict(list)
    for rows in (int(r) for r in args.rows.split(",")):
        for cols in (int(c) for c in args.cols.split(",")):
            for kind, (launch, moved) in launches(rows, cols, dtype).items():
                if kind not in args.kinds.split(","):
                    continue
                results = []
                for candidate in candidates:
                    table[(kind, cols >= 1 << 15)] = candidate
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
