"""The run harness that ``benchmarks/bench.py`` and ``checks/gpu_check.py`` share: the command-line
options both take, the run's output (printed, logged, one JSON document), guarded steps, the
environment record and the tensor-parallel runtime (torchrun, NCCL on GPUs, gloo on the CPU). The
problems they run are built from the tests' helpers (``tests/support/cases.py``). ``train_step.py`` takes
its environment record and device helpers from here too, and ``bench.py`` and ``train_step_report.py``
their matplotlib (:func:`pyplot`).

Import it before ``orda_tp`` and ``torch.distributed`` are set up: it turns NVLink multicast off for
NCCL, PyTorch and NVSHMEM, and chooses Triton's interpreter when no GPU is visible.
"""

from __future__ import annotations

import os

# NVLink multicast stays off on the lent multi-GPU machines (it can take the host's GPUs down).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

# Without a GPU, Triton's kernels run in its interpreter, which must be chosen before they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import orda_tp  # noqa: E402

# The problems of both scripts: labels of ignored rows, and 1 row in IGNORE_EVERY ignored.
IGNORE_INDEX = -100
IGNORE_EVERY = 7


def add_common_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """The options both scripts take: device, tiny shapes, TP under torchrun, seed, output folder."""
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes, for the CPU")
    parser.add_argument("--tp", action="store_true", help="tensor parallel (launch with torchrun)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--collective-timeout", type=float, default=180.0, help="seconds per collective (--tp)")
    parser.add_argument(
        "--shared-gpu",
        action="store_true",
        help="--tp on CUDA with gloo ranks that all use cuda:0 (NCCL refuses two ranks on one device): "
        "the real kernels and the tensor-parallel merge on a one-GPU machine",
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or default_out, help="results directory")


# ------------------------------------------------------------------------------------------------ output


def plain(value: Any) -> Any:
    """JSON-safe: non-finite floats as strings, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def fmt(value: float | None, spec: str) -> str:
    """``value`` in ``spec``, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def pyplot(say: Callable[[str], None]) -> Any:
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not importable (``say``
    gets the line that says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        say(f"plot skipped: matplotlib is not importable ({error})")
        return None
    return plt


class Reporter:
    """Prints on rank 0, keeps a log file per rank and one JSON document (rank 0)."""

    def __init__(self, out_dir: Path, stem: str, rank: int) -> None:
        self.rank = rank
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        suffix = "" if rank == 0 else f"_rank{rank}"
        self.log_path = out_dir / f"{stem}{suffix}.log"
        self.json_path = out_dir / f"{stem}.json"
        self.log_path.write_text("")
        self.data: dict[str, Any] = {}
        self.failures: list[str] = []

    def line(self, text: str = "", *, every_rank: bool = False) -> None:
        if self.rank == 0 or every_rank:
            prefix = "" if self.rank == 0 else f"[rank {self.rank}] "
            print(prefix + text, flush=True)
        with self.log_path.open("a") as log:
            log.write(text + "\n")

    def log_only(self, text: str) -> None:
        with self.log_path.open("a") as log:
            log.write(text + "\n")

    def fail(self, label: str) -> None:
        self.failures.append(label)

    def dump(self) -> None:
        if self.rank == 0:
            self.json_path.write_text(json.dumps(plain(self.data), indent=1))


def guarded(reporter: Reporter, label: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, message)`` after printing the error (traceback to the log)."""
    try:
        return True, fn()
    except Exception as error:  # noqa: BLE001 - every failure is reported and counted, then the script goes on
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        reporter.line(f"  ERROR {label}: {message}", every_rank=True)
        reporter.log_only(traceback.format_exc())
        recover_device()
        return False, message


def recover_device() -> None:
    """Free what a step left behind (after an error, an out-of-memory error too)."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a sticky CUDA error shows up again in the next step
            pass


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, the device and the commit (``ORDA_TP_COMMIT``, else the checkout's HEAD), for the
    JSON record."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "orda_tp": orda_tp.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "CCE_AUTOTUNE": os.environ.get("CCE_AUTOTUNE"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count())
        info["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    info["git"] = os.environ.get("ORDA_TP_COMMIT") or _checkout_commit()
    return info


def _checkout_commit() -> str | None:
    """HEAD of the checkout; a copied tree whose .git lags its files reports the wrong commit, so
    a run can name its commit in ``ORDA_TP_COMMIT`` instead."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return commit.stdout.strip() or None


# ------------------------------------------------------------------------------------------------ TP runtime


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    device: torch.device


def init_distributed(args: argparse.Namespace) -> Runtime:
    """The process group of a torchrun launch: NCCL with one GPU per rank, gloo on the CPU, or
    gloo with every rank on cuda:0 (``--shared-gpu``)."""
    if "RANK" not in os.environ:
        script = Path(sys.argv[0]).resolve()
        shown = script.relative_to(REPO_ROOT) if script.is_relative_to(REPO_ROOT) else script
        raise SystemExit(f"--tp runs under torchrun: torchrun --standalone --nproc-per-node 2 {shown} --tp")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(seconds=args.collective_timeout)
    if args.device == "cuda" and args.shared_gpu:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        dist.init_process_group("gloo", timeout=timeout)
    elif args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
        dist.init_process_group("gloo", timeout=timeout)
    return Runtime(dist.get_rank(), dist.get_world_size(), device)


def column_ranges(columns: int, world: int) -> list[tuple[int, int]]:
    """Every rank's head rows in torch.chunk order (uneven when ``columns`` is not a multiple)."""
    sizes = [len(part) for part in torch.arange(columns).chunk(world)]
    if len(sizes) != world:
        raise ValueError(f"{columns} columns do not make {world} torch.chunk shards")
    starts = [sum(sizes[:i]) for i in range(world)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over the ranks (infinities survive the round trip)."""
    finite = [v if math.isfinite(v) else 1e300 for v in values]
    tensor = torch.tensor(finite, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [math.inf if v >= 1e300 else v for v in tensor.tolist()]


# ------------------------------------------------------------------------------------------------ main


def run_script(args: argparse.Namespace, stem: str, body: Callable[[Reporter, Runtime], None]) -> int:
    """Set up the device (and the process group under ``--tp``), run ``body``, print the summary.

    Returns the exit status: 1 when ``body`` recorded a failure on any rank, else 0."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible (use --device cpu --small to debug here)")
    runtime = init_distributed(args) if args.tp else Runtime(0, 1, torch.device(args.device))
    reporter = Reporter(Path(args.out), stem, runtime.rank)
    reporter.data["env"] = environment(runtime.device)
    reporter.data["args"] = vars(args)
    reporter.line(f"orda_tp {Path(sys.argv[0]).stem}: {json.dumps(plain(reporter.data['env']))}")
    started = time.perf_counter()
    try:
        body(reporter, runtime)
    except Exception:  # noqa: BLE001 - an unexpected error in the harness itself still ends in a summary
        reporter.line(traceback.format_exc(), every_rank=True)
        reporter.fail("harness error (see the log)")
    return _summarize(args, reporter, runtime, started)


def _summarize(args: argparse.Namespace, reporter: Reporter, runtime: Runtime, started: float) -> int:
    """The failures (the first 30), the verdict and the JSON record; ends the process group."""
    failures = len(reporter.failures)
    if args.tp and dist.is_initialized():
        failures = int(max_over_ranks([float(failures)], runtime.device)[0])
    reporter.data["failures"] = reporter.failures
    reporter.data["seconds"] = time.perf_counter() - started
    reporter.dump()
    for failure in reporter.failures[:30]:
        reporter.line(f"FAIL {failure}"[:400])
    if len(reporter.failures) > 30:
        reporter.line(f"... {len(reporter.failures) - 30} more failures in {reporter.json_path}")
    verdict = "PASS" if failures == 0 else f"FAIL ({failures} failures on the worst rank)"
    reporter.line(f"== {verdict} in {time.perf_counter() - started:.1f} s; results in {reporter.json_path}")
    if args.tp and dist.is_initialized():
        dist.destroy_process_group()
    return 0 if failures == 0 else 1
