"""The fused loss against its row layout: what a chunk and a gradient group cost, per workspace.

    python3 benchmarks/layout_sweep.py --out $OUT/layout_sweep.jsonl     # one CUDA device, bf16

For each problem below (KD: student CE + forward KL with the tied frozen teacher; CE: the
student's CE alone; 1 label in 7 ignored) it times, with ``bench.py``'s ``measure`` (median of 10
calls back to back after 3 warm-ups, CUDA events; workspace = peak above the inputs less the
returned gradients):

- the default call, and the task's GEMMs alone in cuBLAS (``bench.py``'s GEMM-only row);
- the call under every row layout ``chunk/group`` of the grid: rows per chunk (one pass of logits
  GEMM and statistics kernels) and rows per gradient group (one ``dh`` and one ``dW`` GEMM), whose
  workspace (both sides' fp32 logits of a chunk and the bf16 logit gradients of a group) is at most
  ``--max-mib``. The script replaces the walk's layout rule (``engine.fused.row_layout``) for these
  rows.

The rows say, for any workspace, which layout is the fastest: the data behind
``orda_tp.workspace.LAYOUT_COSTS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench import BenchShape, Step, gemm_only_step, make_bench_inputs, measure, orda_step  # noqa: E402
from orda_tp.engine import fused  # noqa: E402
from orda_tp.engine.workspace import RowLayout  # noqa: E402

#: (shape, task, smallest chunk rows tried): the anchor shapes, and the first one at a long batch.
PROBLEMS = (
    (BenchShape(8192, 4096, 128256), "KD", 256),
    (BenchShape(8192, 2304, 256000), "KD", 256),
    (BenchShape(8192, 4096, 128256), "CE", 256),
    (BenchShape(32768, 4096, 128256), "KD", 512),
)
CHUNK_ROWS = (256, 512, 1024, 2048)
CHUNKS_PER_GROUP = (1, 2, 3, 4, 8)


def grid(shape: BenchShape, task: str, smallest: int, max_mib: float) -> list[tuple[int, int, float]]:
    """The (chunk rows, group rows, workspace MiB) tried: layouts of at most ``max_mib`` whose group
    is not longer than the batch."""
    logit_bytes = 8 if task == "KD" else 4
    layouts = []
    for chunk in CHUNK_ROWS:
        for chunks in CHUNKS_PER_GROUP:
            group = chunk * chunks
            mib = RowLayout(chunk, group).workspace_bytes(shape.vocab, logit_bytes, 2) / 2**20
            if chunk >= smallest and group <= shape.rows and mib <= max_mib:
                layouts.append((chunk, group, mib))
    return layouts


def layout_ms(step: Step, chunk: int, group: int, device: torch.device) -> tuple[float, float | None]:
    """``step`` timed with every call walking ``chunk``-row chunks and ``group``-row gradient groups."""
    default = fused.row_layout
    fused.row_layout = lambda *args, **kwargs: RowLayout(chunk_rows=chunk, group_rows=group)
    try:
        timing = measure(step, device)
    finally:
        fused.row_layout = default
    return timing.ms, timing.workspace_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the rows as JSON lines to this file")
    parser.add_argument("--max-mib", type=float, default=4200.0, help="the largest layout workspace tried")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    rows: list[dict[str, object]] = []

    def report(shape: BenchShape, task: str, case: str, ms: float, workspace: float | None, **layout: int) -> None:
        rows.append({"shape": shape.name, "task": task, "case": case, "ms": round(ms, 3), "workspace_mib": workspace})
        rows[-1].update(layout)
        memory = "" if workspace is None else f" | {workspace:.0f} MiB"
        print(f"| {shape.name} | {task} | {case} | {ms:.2f} ms{memory} |", flush=True)

    for shape, task, smallest in PROBLEMS:
        inputs = make_bench_inputs(shape, device, torch.bfloat16, None, seed=0)
        step = orda_step(inputs, task, "triton")
        timing = measure(step, device)
        report(shape, task, "default", timing.ms, timing.workspace_mib)
        report(shape, task, "GEMM-only", measure(gemm_only_step(inputs, task), device).ms, None)
        for chunk, group, _ in grid(shape, task, smallest, args.max_mib):
            ms, workspace = layout_ms(step, chunk, group, device)
            report(shape, task, f"layout {chunk}/{group}", ms, workspace, chunk_rows=chunk, group_rows=group)
        if args.out is not None:
            Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
        del inputs, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
