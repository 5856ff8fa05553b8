"""What the loss's GEMMs alone cost on this GPU, as cuBLAS runs them: the bound under the loss's time.

    python3 benchmarks/gemm_bound.py        # the two benchmark shapes, bf16, one CUDA device

For each shape (BT, H, V) it times, with CUDA events (median of 5 after a warm-up):

- the four full-size GEMMs of a frozen-teacher KD step as torch.mm runs them: student and teacher
  logits ``h·Wᵀ`` (bf16 out), ``dh = dS·W`` and ``dW = dSᵀ·h``; their sum is the time of the GEMMs
  with nothing else, no chunking;
- the logits GEMM as the row walk runs it: the tied head's student and teacher rows stacked, fp32
  out, over chunks of 256 … 1024 rows;
- the gradient GEMMs per row group (dW summed into a bf16 or fp32 gradient in the GEMM's epilogue);
- an overlap probe: a memory-bound pass (``logsumexp`` of fp32 logits) on a side stream while the
  chunked logits GEMMs run, against the two run one after the other.

TFLOP/s are ``2·BT·H·V`` per GEMM over the measured time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch


def median_ms(step: Callable[[], object], repeats: int = 5) -> float:
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]


def repeat(count: int, op: Callable[..., object], *args: object, **kwargs: object) -> None:
    for _ in range(count):
        op(*args, **kwargs)


def shape_report(rows: int, hidden: int, vocab: int) -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as the loss runs them
    device = torch.device("cuda")
    student = torch.randn(rows, hidden, device=device).bfloat16()
    teacher = torch.randn(rows, hidden, device=device).bfloat16()
    weight = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).bfloat16()
    flop = 2 * rows * hidden * vocab
    print(f"== BT={rows} H={hidden} V={vocab}: one GEMM = {flop / 1e12:.2f} TFLOP")

    grad_logits = torch.randn(rows, vocab, device=device).bfloat16()
    logits_ms = median_ms(partial(torch.mm, student, weight.T))
    dh_ms = median_ms(partial(torch.mm, grad_logits, weight))
    dw_ms = median_ms(partial(torch.mm, grad_logits.T, student))
    del grad_logits
    total = 2 * logits_ms + dh_ms + dw_ms
    print(
        f"full-size GEMMs: logits {logits_ms:.2f} ms ({flop / logits_ms / 1e9:.0f} TFLOP/s), dh {dh_ms:.2f}, "
        f"dW {dw_ms:.2f}; KD's four (2 logits + dh + dW) {total:.1f} ms, CE's three {total - logits_ms:.1f} ms"
    )

    for chunk in (256, 384, 512, 1024):
        stacked = torch.cat([student[:chunk], teacher[:chunk]])
        count = rows // chunk
        ms = median_ms(partial(repeat, count, torch.mm, stacked, weight.T, out_dtype=torch.float32))
        ms *= rows / (count * chunk)  # per full batch
        print(f"logits, fp32 out, {chunk} rows × 2 sides stacked per chunk: {ms:.2f} ms ({2 * flop / ms / 1e9:.0f})")

    for group in (768, 1536, 3072):
        count = rows // group
        staged = torch.randn(group, vocab, device=device).bfloat16()
        grad_bf16 = torch.zeros(vocab, hidden, device=device).bfloat16()
        grad_fp32 = torch.zeros(vocab, hidden, device=device)
        scale = rows / (count * group)
        rows_of_group = student[:group]
        dh = median_ms(partial(repeat, count, torch.mm, staged, weight)) * scale
        dw = median_ms(partial(repeat, count, grad_bf16.addmm_, staged.T, rows_of_group)) * scale
        into_fp32 = partial(torch.addmm, grad_fp32, staged.T, rows_of_group, out_dtype=torch.float32, out=grad_fp32)
        dw32 = median_ms(partial(repeat, count, into_fp32)) * scale
        print(f"row groups of {group}: dh {dh:.2f} ms, dW into bf16 {dw:.2f} ms, dW into fp32 {dw32:.2f} ms")
        del staged, grad_bf16, grad_fp32

    chunk = 256
    stacked = torch.cat([student[:chunk], teacher[:chunk]])
    logits = torch.randn(2 * chunk, vocab, device=device)
    count = rows // chunk
    side = torch.cuda.Stream()
    gemms = median_ms(partial(repeat, count, torch.mm, stacked, weight.T, out_dtype=torch.float32))
    passes = median_ms(partial(repeat, 3 * count, torch.logsumexp, logits, dim=1))

    def together() -> None:
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(side):
            side.wait_event(ready)
            for _ in range(3 * count):
                torch.logsumexp(logits, dim=1)
        for _ in range(count):
            torch.mm(stacked, weight.T, out_dtype=torch.float32)
        torch.cuda.current_stream().wait_stream(side)

    both = median_ms(together)
    print(
        f"overlap probe ({chunk}-row chunks): GEMMs {gemms:.2f} ms, 3 logsumexp passes per chunk {passes:.2f} ms, "
        f"on two streams {both:.2f} ms (one after the other {gemms + passes:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8192x4096x128256,8192x2304x256000", help="BTxHxV, comma separated")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    for shape in args.shapes.split(","):
        rows, hidden, vocab = (int(x) for x in shape.split("x"))
        shape_report(rows, hidden, vocab)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
