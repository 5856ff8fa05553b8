"""Run a test body on ``world_size`` real torch.distributed (gloo) processes.

:func:`run_distributed` starts one process per rank (torch.multiprocessing's ``forkserver`` or
``spawn`` context: never a plain fork of the test process), joins them through a
:class:`torch.distributed.FileStore` in a fresh temporary directory (never a fixed port), runs
``worker(rank, world_size, *args)`` in each, and returns the ranks' return values in rank order.

- A worker exception reaches the test as :class:`DistributedFailure` with every failing rank's
  traceback.
- Every collective has a timeout (``collective_timeout``), and the whole run a hard one
  (``timeout``): ranks still running then are killed and the test fails with "rank(s) N hung",
  together with the last :func:`note` each rank left (what it was doing).
- Workers must live in an importable module (e.g. ``tests.support.tp_workers``) and return picklable
  values. Each rank runs single-threaded (``OMP_NUM_THREADS=1``): CI machines have few cores.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedFailure", "note", "run_distributed"]

# After one rank has failed, how long the others may take to finish before they count as hung.
FAILURE_GRACE_S = 10.0
_POLL_S = 0.02
_NOTE_ENV = "ORDA_TP_TEST_NOTE_FILE"
# Imported once by the forkserver, before it forks any rank (it stays single-threaded).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor")


class DistributedFailure(AssertionError):
    """A rank raised, died or hung; the message has every rank's traceback or state."""


def note(text: str) -> None:
    """Record what this rank is doing now; a hang report quotes each rank's last note.

    A no-op outside :func:`run_distributed`.
    """
    path = os.environ.get(_NOTE_ENV)
    if path:
        Path(path).write_text(text)


def run_distributed(
    world_size: int,
    worker: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; their return values.

    ``timeout`` bounds the whole run (seconds, from the start of the processes);
    ``collective_timeout`` (default ``timeout / 2``) bounds each collective, so that a rank left
    waiting in a collective fails with gloo's timeout error (and a traceback saying where)
    before the hard timeout kills it. ``start_method`` is "forkserver" (a fresh interpreter that
    imports torch once and forks single-threaded children: a rank starts in milliseconds instead
    of the ~2 CPU-seconds of a spawned interpreter importing torch) or "spawn".
    """
    if collective_timeout is None:
        collective_timeout = timeout / 2
    workdir = Path(tempfile.mkdtemp(prefix="orda_tp_dist_"))
    try:
        processes = _start(world_size, worker, args, workdir, collective_timeout, start_method)
        hung, elapsed = _wait(processes, workdir, timeout)
        return _collect(processes, workdir, hung, elapsed)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"result_{rank}.pkl"


def _note_path(workdir: Path, rank: int) -> Path:
    return workdir / f"note_{rank}.txt"


@contextmanager
def _child_environment(**values: str) -> Iterator[None]:
    """Set environment variables for processes started inside the block (spawn copies
    ``os.environ`` at start), restoring the parent's afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start(
    world_size: int,
    worker: Callable[..., Any],
    args: tuple[Any, ...],
    workdir: Path,
    collective_timeout: float,
    start_method: str,
) -> list[mp.Process]:
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload([*PRELOAD, worker.__module__])
    store_path = str(workdir / "store")
    processes = []
    with _child_environment(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
        for rank in range(world_size):
            process = context.Process(
                target=_entry,
                args=(rank, world_size, store_path, str(workdir), collective_timeout, worker, args),
                name=f"orda_tp-rank{rank}",
                daemon=True,
            )
            process.start()
            processes.append(process)
    return processes


def _entry(
    rank: int,
    world_size: int,
    store_path: str,
    workdir: str,
    collective_timeout: float,
    worker: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """Body of one rank's process: join the group, run the worker, write the outcome."""
    os.environ[_NOTE_ENV] = str(_note_path(Path(workdir), rank))
    torch.set_num_threads(1)
    try:
        note("joining the process group")
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout)
        )
        try:
            note("running the worker")
            outcome: tuple[str, Any] = ("ok", worker(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent
        outcome = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    try:
        payload = pickle.dumps(outcome)
    except Exception as error:  # noqa: BLE001
        payload = pickle.dumps(("error", f"the worker's return value cannot be pickled: {error!r}"))
    partial = _result_path(Path(workdir), rank).with_suffix(".tmp")
    partial.write_bytes(payload)
    partial.rename(_result_path(Path(workdir), rank))  # atomic: the parent never reads half a file


def _failed(workdir: Path, rank: int) -> bool:
    path = _result_path(workdir, rank)
    return path.exists() and pickle.loads(path.read_bytes())[0] == "error"


def _wait(processes: list[mp.Process], workdir: Path, timeout: float) -> tuple[list[int], float]:
    """Wait for every rank; kill the ones still running at the deadline (or ``FAILURE_GRACE_S``
    after another rank failed). Returns their ranks and the seconds waited."""
    start = time.monotonic()
    deadline = start + timeout
    failure_seen = False
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        if not failure_seen and any(
            not p.is_alive() and (p.exitcode != 0 or _failed(workdir, rank)) for rank, p in enumerate(processes)
        ):
            failure_seen = True
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        time.sleep(_POLL_S)
    elapsed = time.monotonic() - start
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for rank in hung:
        processes[rank].kill()
    for process in processes:
        process.join(timeout=10)
    return hung, elapsed


def _exit_text(code: int | None) -> str:
    """``exit code 1`` or ``signal SIGABRT`` (gloo aborts the process on a collective size
    mismatch; its message is in the captured stderr)."""
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}; see the captured stderr"
        except ValueError:
            pass
    return f"exit code {code}"


def _collect(processes: list[mp.Process], workdir: Path, hung: list[int], elapsed: float) -> list[Any]:
    """The ranks' return values, or a :class:`DistributedFailure` describing every bad rank."""
    results: list[Any] = []
    problems: list[str] = []
    for rank, process in enumerate(processes):
        path = _result_path(workdir, rank)
        if rank in hung:
            last = _note_path(workdir, rank)
            doing = last.read_text() if last.exists() else "starting"
            problems.append(f"rank {rank} hung (killed; last note: {doing!r})")
        elif not path.exists():
            problems.append(f"rank {rank} died ({_exit_text(process.exitcode)}) without reporting a result")
        else:
            status, value = pickle.loads(path.read_bytes())
            if status == "ok":
                results.append(value)
                continue
            problems.append(f"rank {rank} raised {value}")
        results.append(None)
    if problems:
        header = f"rank(s) {', '.join(map(str, hung))} hung after {elapsed:.0f} s; " if hung else ""
        raise DistributedFailure(
            header + f"{len(problems)} of {len(processes)} ranks failed:\n\n" + "\n\n".join(problems)
        )
    return results
