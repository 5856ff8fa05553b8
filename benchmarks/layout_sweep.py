"""The fused loss against its row layout, and as a CUDA graph: what a chunk and a gradient group cost.

    python3 benchmarks/layout_sweep.py            # the two anchor shapes, bf16, one CUDA device

For each anchor shape of ``bench.py`` and each task (KD: student CE + forward KL with the tied
frozen teacher; CE: the student's CE alone) it times, with ``bench.py``'s ``measure`` (median of
10 calls back to back, CUDA events; workspace = peak above the inputs less the returned gradients):

- the default call, and the task's GEMMs alone in cuBLAS (``bench.py``'s GEMM-only row);
- the default call captured once in a CUDA graph and replayed (no host work, launches back to
  back): against the eager call it shows what the host and the launches cost;
- the call under other row layouts, ``chunk/group``: rows per chunk (one pass of logits GEMM and
  statistics kernels) and rows per gradient group (one ``dh`` and one ``dW`` GEMM). The library has
  no keyword for the group rows (``config.CHUNKS_PER_GROUP`` chunks, or fewer, make a group), so
  the script replaces the walk's ``row_layout`` for these rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench import ANCHORS, Step, gemm_only_step, make_bench_inputs, measure, orda_step  # noqa: E402
from orda_tp.engine import fused  # noqa: E402
from orda_tp.engine.row_walk import RowLayout  # noqa: E402

# (shape index, task) -> (chunk rows, group rows) tried besides the default.
LAYOUTS = {
    (0, "KD"): [(192, 960), (128, 1280), (128, 1536), (256, 1536), (384, 1152), (512, 1536), (1024, 3072)],
    (1, "KD"): [(192, 1152), (128, 1280), (128, 1536), (256, 1536), (512, 1536)],
    (0, "CE"): [(256, 768), (192, 1152), (128, 1280), (256, 1536), (512, 1536)],
    (1, "CE"): [(256, 512), (128, 768), (192, 576), (128, 640), (64, 896), (512, 1536)],
}


def graph_ms(step: Step, repeats: int = 10) -> float:
    """Median of ``repeats`` replays of ``step`` captured once in a CUDA graph (CUDA events)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # kernels compiled, allocator pools filled
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, stop in events:
        start.record()
        graph.replay()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)


def layout_ms(step: Step, chunk: int, group: int, device: torch.device) -> tuple[float, float | None]:
    """``step`` timed with every call walking ``chunk``-row chunks and ``group``-row gradient groups."""
    default = fused.row_layout
    fused.row_layout = lambda *args: RowLayout(chunk_rows=chunk, group_rows=group)
    try:
        timing = measure(step, device)
    finally:
        fused.row_layout = default
    return timing.ms, timing.workspace_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the rows as JSON lines to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows: list[dict[str, object]] = []

    def report(shape: str, task: str, case: str, ms: float, workspace: float | None = None) -> None:
        rows.append({"shape": shape, "task": task, "case": case, "ms": round(ms, 2), "workspace_mib": workspace})
        memory = "" if workspace is None else f" | {workspace:.0f} MiB"
        print(f"| {shape} | {task} | {case} | {ms:.2f} ms{memory} |", flush=True)

    for index, shape in enumerate(ANCHORS.shapes):
        inputs = make_bench_inputs(shape, device, torch.bfloat16, None, seed=0)
        for task in ("KD", "CE"):
            step = orda_step(inputs, task, "triton")
            timing = measure(step, device)
            report(shape.name, task, "default", timing.ms, timing.workspace_mib)
            report(shape.name, task, "GEMM-only", measure(gemm_only_step(inputs, task), device).ms)
            report(shape.name, task, "default, CUDA graph replayed", graph_ms(step))
            for chunk, group in LAYOUTS[(index, task)]:
                report(shape.name, task, f"layout {chunk}/{group}", *layout_ms(step, chunk, group, device))
        del inputs
        torch.cuda.empty_cache()
    if args.out is not None:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
