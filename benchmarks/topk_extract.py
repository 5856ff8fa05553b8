"""Top-k teacher extraction (:func:`orda_tp.teacher_topk`): checked, timed and sized.

One command on one GPU (``python benchmarks/topk_extract.py``), three parts:

1. ``check``: the Triton kernel against the fp64 torch backend on small problems (ties, soft-cap,
   temperature, padding, bf16/fp16/fp32 heads and stored logits): ids identical, log-probabilities
   within fp32 rounding.
2. ``time``: at BT = 8192, H = 4096, V = 128256, k = 64 (bf16), the extraction against one logits
   GEMM in cuBLAS (``h @ Wᵀ``, bf16 out) and against ``log_softmax((h @ Wᵀ).float()).topk(k)``;
   the median of ``--repeats`` runs after warm-up, and the peak memory each adds to its inputs.
3. ``sweep`` (run before ``time``, which then uses the fastest): the kernel's group, block and
   warps (:data:`orda_tp.engine.triton_math.KERNEL_GROUP` …) on one chunk of fp32 logits.

Under ``torchrun --nproc-per-node N`` (``--tp``; gloo, every rank on ``cuda:0`` with
``--shared-gpu``) it checks instead that each rank's extraction from its vocabulary shard (uneven,
with padding) equals the single-device one, bit for bit. Prints one JSON line per result.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from orda_tp.engine import triton_math
from orda_tp.engine.logits import logits_mm
from orda_tp.topk_cache.extraction import teacher_topk, teacher_topk_of_logits


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median ms, peak MiB above the memory in use before) of ``fn`` on the current GPU."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def fp64_logprobs(logits: torch.Tensor, temperature: float, cap: float | None) -> torch.Tensor:
    """``log_softmax(cap(z)/T)`` of fp64 ``logits``."""
    scaled = (logits if cap is None else cap * torch.tanh(logits / cap)) / temperature
    return torch.log_softmax(scaled, dim=-1)


def check(device: torch.device) -> bool:
    """The Triton kernel's extraction equals the fp64 torch backend's on every problem."""
    ok = True
    generator = torch.Generator(device="cpu").manual_seed(0)
    problems = [  # rows, hidden, columns, vocab_size, k, temperature, softcap, dtype, ties
        (300, 64, 5000, 5000, 64, 1.0, None, torch.bfloat16, False),
        (257, 64, 32000, 31990, 128, 2.0, 30.0, torch.float16, False),
        (64, 32, 3000, 3000, 5, 0.5, None, torch.float32, True),
        (33, 16, 700, 650, 256, 1.0, 5.0, torch.bfloat16, True),
    ]
    for rows, hidden, columns, vocab, k, temperature, cap, dtype, ties in problems:
        h = torch.randn(rows, hidden, generator=generator).to(device, dtype)
        w = torch.randn(columns, hidden, generator=generator).div(hidden**0.25).to(device, dtype)
        options = dict(temperature=temperature, logit_softcap=cap, vocab_size=vocab)
        if ties:  # logits of few distinct values: most of a row's top k are ties
            logits = torch.randint(0, 5, (rows, columns), generator=generator).to(device, dtype)
            got = teacher_topk_of_logits(logits, k, backend="triton", **options)
            want = teacher_topk_of_logits(logits.double(), k, backend="torch", **options)
        else:
            got = teacher_topk(h, w, k, backend="triton", **options)
            # The kernel ranks the fp32 logits of the GEMM: the fp64 ranking of those same values.
            logits = logits_mm(h, w[:vocab], torch.float32).double()
            want = teacher_topk_of_logits(logits, k, backend="torch", **options)
        # Ids may swap only at a tie within fp32 rounding (the kernel's fp32 soft-cap and scaling
        # against the fp64 ones): every id's value, read from the fp64 log-softmax, must be where
        # the kernel put it, and the values must be the oracle's position by position.
        moved = int((got.ids != want.ids).sum())
        error = float((got.logprobs.double() - want.logprobs).abs().max())
        true_values = fp64_logprobs(logits.double()[:, :vocab], temperature, cap).gather(1, got.ids)
        misplaced = float((got.logprobs.double() - true_values).abs().max())
        passed = error <= 2e-5 and misplaced <= 2e-5
        ok &= passed
        emit(part="check", rows=rows, columns=columns, vocab=vocab, k=k, dtype=str(dtype), ties=ties,
             moved_ids=moved, max_abs_error=error, max_id_value_error=misplaced, passed=passed)  # fmt: skip
    return ok


def time_extraction(device: torch.device, args: argparse.Namespace) -> None:
    """The extraction at the issue's shape against one cuBLAS GEMM and the logits-first recipe."""
    rows, hidden, vocab, k = args.rows, args.hidden, args.vocab, args.k
    h = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(torch.bfloat16)
    runs: dict[str, Callable[[], object]] = {
        "gemm_bf16": lambda: h @ w.T,
        "gemm_fp32_out": lambda: torch.mm(h, w.T, out_dtype=torch.float32),
        "teacher_topk_triton": lambda: teacher_topk(h, w, k, backend="triton"),
        "teacher_topk_torch": lambda: teacher_topk(h, w, k, backend="torch"),
        "log_softmax_topk": lambda: torch.log_softmax((h @ w.T).float(), dim=-1).topk(k, dim=-1),
    }
    results = {}
    for name, fn in runs.items():
        if name == "teacher_topk_torch" and args.skip_torch:
            continue
        ms, mib = timed(fn, args.repeats)
        results[name] = ms
        emit(part="time", run=name, rows=rows, hidden=hidden, vocab=vocab, k=k, ms=round(ms, 3), extra_mib=round(mib))
    emit(part="time", ratio_to_gemm=round(results["teacher_topk_triton"] / results["gemm_bf16"], 3))
    chunk = torch.mm(h[:1024], w.T, out_dtype=torch.float32)
    ms, _ = timed(lambda: triton_math.TritonBlockMath().topk(chunk, k, 0, 1.0, None), args.repeats)
    emit(part="time", run="kernel_only_1024_rows", ms=round(ms, 3), per_8192_rows_ms=round(8 * ms, 3))
    ms, _ = timed(lambda: chunk.topk(k, dim=1), args.repeats)
    emit(part="time", run="torch_topk_1024_rows", ms=round(ms, 3), per_8192_rows_ms=round(8 * ms, 3))


def sweep(device: torch.device, args: argparse.Namespace) -> tuple[int, int, int]:
    """The kernel's settings on one 1024-row chunk of fp32 logits (the extraction's chunk); the
    fastest (group, block, warps) that finds the same ids."""
    h = torch.randn(1024, args.hidden, device=device, dtype=torch.bfloat16)
    w = (torch.randn(args.vocab, args.hidden, device=device) / args.hidden**0.5).to(torch.bfloat16)
    chunk = torch.mm(h, w.T, out_dtype=torch.float32)
    want = triton_math.TritonBlockMath().topk(chunk, args.k, 0, 1.0, None)
    chosen = (triton_math.KERNEL_GROUP, triton_math.KERNEL_BLOCK, triton_math.KERNEL_WARPS)
    timings: dict[tuple[int, int, int], float] = {}
    for group in (2, 4, 8, 16):
        for block in (256, 512, 1024, 2048, 4096):
            for warps in (1, 2, 4, 8):
                if block // group < args.k:
                    continue
                triton_math.KERNEL_GROUP, triton_math.KERNEL_BLOCK, triton_math.KERNEL_WARPS = group, block, warps
                same = bool((triton_math.TritonBlockMath().topk(chunk, args.k, 0, 1.0, None).ids == want.ids).all())
                ms, _ = timed(lambda: triton_math.TritonBlockMath().topk(chunk, args.k, 0, 1.0, None), args.repeats)
                emit(part="sweep", group=group, block=block, warps=warps, ms=round(ms, 3), same_ids=same)
                if same:
                    timings[(group, block, warps)] = ms
    triton_math.KERNEL_GROUP, triton_math.KERNEL_BLOCK, triton_math.KERNEL_WARPS = chosen
    best = min(timings, key=timings.__getitem__)
    emit(part="sweep", fastest=best, ms=round(timings[best], 3), current=chosen, current_ms=round(timings[chosen], 3))
    return best


def tensor_parallel(args: argparse.Namespace) -> bool:
    """Each rank's extraction from its uneven, padded shard equals the single-device one: the same
    ids (a pair of swapped ids only at a tie within fp32 rounding: cuBLAS may round a shard's GEMM
    differently), log-probabilities within fp32 rounding (the log-partition is merged from the
    ranks' parts), and bitwise the same result on every rank."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0 if args.shared_gpu else rank) if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator().manual_seed(1)
    ok = True
    for backend in ("triton", "torch"):
        for k in (1, 64, 200):
            h = torch.randn(300, 64, generator=generator).to(device, torch.bfloat16)
            w = torch.randn(10007, 64, generator=generator).div(8).to(device, torch.bfloat16)
            vocab = 10007 - 13  # the last rows are padding
            single = teacher_topk(h, w, k, vocab_size=vocab, backend=backend, temperature=1.5)
            sizes = [10007 // world + (1 if r < 10007 % world else 0) for r in range(world)]
            start = sum(sizes[:rank])
            shard = w[start : start + sizes[rank]]
            split = teacher_topk(h, shard, k, vocab_size=vocab, tp_group=dist.group.WORLD, backend=backend,
                                 temperature=1.5)  # fmt: skip
            error = float((split.logprobs - single.logprobs).abs().max())
            moved = split.ids != single.ids
            near_ties = bool((single.logprobs[moved] - split.logprobs[moved]).abs().le(1e-5).all())
            packed = torch.cat([split.ids.double(), split.logprobs.double()], dim=1).cpu()
            gathered = [torch.empty_like(packed) for _ in range(world)]
            dist.all_gather(gathered, packed)
            ranks_agree = all(torch.equal(part, gathered[0]) for part in gathered)
            passed = error <= 1e-5 and near_ties and ranks_agree
            ok &= passed
            if rank == 0:
                emit(part="tp", world=world, backend=backend, k=k, moved_ids=int(moved.sum()), max_abs_error=error,
                     ranks_agree=ranks_agree, passed=passed)  # fmt: skip
    dist.destroy_process_group()
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--parts", default="check,time,sweep", help="comma-separated: check, time, sweep")
    parser.add_argument("--skip-torch", action="store_true", help="leave out the torch backend's timing")
    parser.add_argument("--tp", action="store_true", help="under torchrun: shards against one device")
    parser.add_argument("--shared-gpu", action="store_true", help="with --tp: every rank on cuda:0 (gloo)")
    args = parser.parse_args()
    if args.tp:
        return 0 if tensor_parallel(args) else 1
    device = torch.device("cuda")
    parts = args.parts.split(",")
    ok = check(device) if "check" in parts else True
    if "sweep" in parts:  # the timing then runs with the fastest settings
        triton_math.KERNEL_GROUP, triton_math.KERNEL_BLOCK, triton_math.KERNEL_WARPS = sweep(device, args)
    if "time" in parts:
        settings = (triton_math.KERNEL_GROUP, triton_math.KERNEL_BLOCK, triton_math.KERNEL_WARPS)
        emit(part="time", kernel_group_block_warps=settings)
        time_extraction(device, args)
    emit(part="summary", check_passed=ok, device=torch.cuda.get_device_name(), torch=torch.__version__)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
