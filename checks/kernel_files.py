"""Whether the triton backend needs, or writes, any file on its default path: a probe for the GPU.

In a fresh process whose ``HOME`` and ``XDG_CACHE_HOME`` are one empty temporary directory (also
its working directory) and ``ORDA_TP_KERNEL_CACHE`` is unset, it runs calls on ``backend="triton"``
that build every kind of generated function (``orda_tp/kernels/variant_terms.py``): reverse KL +
CE with a tied teacher; ``skew_js`` (two round-2 sums) with label smoothing, a z-loss and soft-caps
on a separate teacher; ``mutual`` (the teacher's gradient too); ``forward`` on a top-64
``PrecomputedTeacher``; and ``KDLoss`` on bf16 logits (fp32 on the CPU). Each is compared with the
fp64 reference (``backend="reference"`` on the same inputs upcast; for ``KDLoss`` its formula,
``T²·Σ_valid KL(q‖p) / N``) within ``checks/gpu_check.py``'s tolerances. Then it checks that every
generated module ran under a pseudo-filename, that every kind was built, and that no file was
written under the temporary directory nor under ``orda_tp/``. What other tools cache goes to a
second temporary directory, which is not checked: Triton's compile cache (``TRITON_HOME``,
``TRITON_CACHE_DIR``; its file count shows that kernels were compiled), CUDA's JIT cache
(``CUDA_CACHE_PATH``) and torch's (``PYTORCH_KERNEL_CACHE_PATH``); Python writes no bytecode
(``PYTHONDONTWRITEBYTECODE=1``). One line per case, then ``PASS`` or ``FAIL``; exit status 1 on a
failure.

    python checks/kernel_files.py                                       # on a CUDA device
    TRITON_INTERPRET=1 python checks/kernel_files.py --device cpu --small  # on the CPU
"""

from __future__ import annotations

import argparse
import linecache
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from checks.gpu_check import (  # noqa: E402  (first: its harness chooses Triton's interpreter without a GPU)
    CHECK_TOLERANCE,
    DTYPES,
    CheckShape,
    check_kwargs,
    compare,
    make_check_problem,
)
from orda_tp import KDLoss  # noqa: E402
from orda_tp.kernels.cache import CACHE_ENV, PSEUDO_FILENAME  # noqa: E402
from tests.support.cases import loss_and_grads, relative_error, stable_seed  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "orda_tp"
#: The kinds of generated module: the first words of their names (orda_tp/kernels/variant_terms.py).
KINDS = ("sums_terms", "grads_student", "grads_teacher", "partition_sums", "rows")
SMALL = CheckShape(rows=12, hidden=8, vocab=131, vocab_size=128, teacher_hidden=11, chunk_rows=5, vocab_block=32)
LARGE = CheckShape(
    rows=512, hidden=256, vocab=32003, vocab_size=31990, teacher_hidden=259, chunk_rows=192, vocab_block=8192
)
KD_COLUMNS = 1 << 15  # on the GPU: the wide blocks, whose tiles of 2-byte logits have a table of their own
KD_TEMPERATURE = 2.0
Case = Callable[[], tuple[float, float]]  # (worst value error, worst gradient error)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes, for the CPU interpreter")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the fresh process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cases(args) if args.child else probe(args)


# ------------------------------------------------------------------------------------------------ the parent


def probe(args: argparse.Namespace) -> int:
    """Run the cases in a fresh process with an empty home, then look for the files it wrote."""
    with (
        tempfile.TemporaryDirectory(prefix="orda_tp_home_") as home_dir,
        tempfile.TemporaryDirectory(prefix="orda_tp_tools_") as tools_dir,
    ):
        home, tools = Path(home_dir), Path(tools_dir)
        before = _package_files()
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "--device", args.device]
        child = subprocess.run(
            [*command, *(["--small"] if args.small else [])], cwd=home, env=_environment(home, tools)
        )
        written = sorted(str(path.relative_to(home)) for path in home.rglob("*"))
        after = _package_files()
        changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        cached = sum(1 for path in tools.rglob("*") if path.is_file())
    print(f"files under the temporary home: {written or 'none'}")
    print(f"files written or changed under orda_tp/: {changed or 'none'}")
    print(f"files in Triton's compile cache and the other tools' caches (not checked): {cached}")
    failures = [f"the cases' process exited with status {child.returncode}"] if child.returncode else []
    failures += [f"{len(written)} file(s) under the temporary home"] if written else []
    failures += [f"{len(changed)} file(s) written or changed under orda_tp/"] if changed else []
    print("PASS" if not failures else f"FAIL: {'; '.join(failures)}")
    return 1 if failures else 0


def _environment(home: Path, tools: Path) -> dict[str, str]:
    """The fresh process's environment: this one's, with an empty home and no kernel cache
    directory, the other tools' caches in ``tools``."""
    environment = {name: value for name, value in os.environ.items() if name != CACHE_ENV}
    environment.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home),
        PYTHONDONTWRITEBYTECODE="1",
        TRITON_HOME=str(tools),
        TRITON_CACHE_DIR=str(tools / "triton"),
        CUDA_CACHE_PATH=str(tools / "cuda"),
        PYTORCH_KERNEL_CACHE_PATH=str(tools / "torch"),
    )
    return environment


def _package_files() -> dict[str, tuple[int, int]]:
    """``orda_tp/``'s files: relative path -> (size, modification time in ns)."""
    files = (path for path in PACKAGE.rglob("*") if path.is_file())
    return {str(path.relative_to(PACKAGE)): (path.stat().st_size, path.stat().st_mtime_ns) for path in files}


# ------------------------------------------------------------------------------------------------ the cases


def run_cases(args: argparse.Namespace) -> int:
    """The fresh process: each case against the reference, then the names its generated modules ran under."""
    device = torch.device(args.device)
    shape = SMALL if args.small else LARGE
    kd_dtype = "bf16" if device.type == "cuda" else "fp32"  # bf16 arithmetic is wrong under the interpreter
    kd_columns = shape.vocab if args.small else KD_COLUMNS
    cases: dict[str, tuple[Case, str]] = {
        "reverse KL + CE, tied teacher": (lambda: _loss_case(shape, device, "tied", "reverse"), "fp32"),
        "skew_js (2 sums) + terms, separate teacher": (
            lambda: _loss_case(shape, device, "separate", "skew_js+terms"),
            "fp32",
        ),
        "mutual (the teacher trains), separate teacher": (
            lambda: _loss_case(shape, device, "separate", "mutual"),
            "fp32",
        ),
        "forward, top-64 PrecomputedTeacher": (lambda: _loss_case(shape, device, "topk", "forward"), "fp32"),
        "KDLoss (forward) on logits": (lambda: _kd_case(shape.rows, kd_columns, device, kd_dtype), kd_dtype),
    }
    failures = 0
    for name, (case, dtype_name) in cases.items():
        value_error, grad_error = case()
        value_limit, grad_limit = CHECK_TOLERANCE[dtype_name]
        ok = value_error <= value_limit and grad_error <= grad_limit  # False for NaN
        failures += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'}  {name:<46} {dtype_name}  values {value_error:.1e} (<= {value_limit:.0e})  "
            f"grads {grad_error:.1e} (<= {grad_limit:.0e})",
            flush=True,
        )
    return 1 if failures or not _generated_modules_ok() else 0


def _generated_modules_ok() -> bool:
    """Print how many generated modules ran under a pseudo-filename (``linecache`` holds their
    lines under it); True when every kind was built."""
    prefix, suffix = PSEUDO_FILENAME.split("{}")
    names = [name[len(prefix) : -len(suffix)] for name in linecache.cache if name.startswith(prefix)]
    missing = [kind for kind in KINDS if not any(name.startswith(kind) for name in names)]
    print(
        f"{'FAIL' if missing else 'ok  '}  {len(names)} generated modules ran under pseudo-filenames; "
        f"kinds not built: {missing or 'none'}",
        flush=True,
    )
    return not missing


def _loss_case(shape: CheckShape, device: torch.device, mode: str, variant: str) -> tuple[float, float]:
    """``distillation_loss`` on ``backend="triton"`` (fp32 inputs) against ``backend="reference"``
    on the same values in fp64, compared as ``checks/gpu_check.py`` compares them."""
    problem, _ = make_check_problem(shape, stable_seed(mode, variant), device, mode)
    rounded = problem.to(torch.float32)
    kwargs = check_kwargs(variant, mode, "mean", shape, device)
    expected = loss_and_grads(rounded.to(torch.float64), mode, backend="reference", **kwargs)
    actual = loss_and_grads(rounded, mode, backend="triton", **kwargs)
    comparison = compare(actual, expected, mode, CHECK_TOLERANCE["fp32"], torch.float32)
    for problem_text in comparison.problems:
        print(f"      {problem_text}")
    return comparison.worst_value, comparison.worst_grad


def _kd_case(rows: int, columns: int, device: torch.device, dtype_name: str) -> tuple[float, float]:
    """``KDLoss`` on ``backend="triton"`` against its formula, ``T²·Σ_valid KL(q‖p) / N``, in fp64
    on the same rounded logits."""
    generator = torch.Generator(device=device).manual_seed(0)

    def logits() -> torch.Tensor:
        values = torch.randn(rows, columns, generator=generator, device=device, dtype=torch.float64) * 2
        return values.to(DTYPES[dtype_name])

    student, teacher = logits().requires_grad_(), logits()
    labels = torch.randint(0, columns, (rows,), generator=generator, device=device)
    labels[3::7] = -100
    loss = KDLoss(temperature=KD_TEMPERATURE, backend="triton")(student, teacher, labels)
    (grad,) = torch.autograd.grad(loss, student)
    exact = student.detach().double().requires_grad_()
    log_p = torch.log_softmax(exact / KD_TEMPERATURE, dim=-1)
    log_q = torch.log_softmax(teacher.double() / KD_TEMPERATURE, dim=-1)
    valid = labels != -100
    expected = KD_TEMPERATURE**2 * (log_q.exp() * (log_q - log_p)).sum(-1)[valid].sum() / valid.sum()
    (expected_grad,) = torch.autograd.grad(expected, exact)
    return relative_error(loss, expected), relative_error(grad, expected_grad)


if __name__ == "__main__":
    sys.exit(main())
