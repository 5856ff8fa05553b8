"""Several teachers in one fused call, ``orda_tp.TeacherMixture``, against the same teachers in separate
calls and against the GEMMs alone: time, memory, and agreement with an fp32 oracle.

The problem: a student of BT rows, its hidden states (BT, H_s) N(0, 1) and head (V, H_s) N(0, 4/H_s)
requiring gradients, labels uniform with 1 in 7 ignored (``bench.make_bench_inputs``); two frozen
``SeparateTeacher``s, each with its own hidden states (BT, H_t) and head (V, H_t) (``bench.separate_teacher``
with seeds 5 and 6: logits of standard deviation ≈ 2); no bias, scale or soft-cap. The loss: student CE +
forward KL at T = 1, kl_weight 1, the teachers weighing (0.5, 0.5). Defaults: BT = 8192, H_s = 2048,
H_t = 4096, V = 128256, bf16 (``bench.py``'s separate teacher of another width, twice). ``--small``: fp32,
BT = 64, H_s = 32, H_t = 48, V = 1000.

Rows, for each combine mode (``"divergences"``, ``"probabilities"``, ``"log_probabilities"``; guide §16):
- ``orda_tp mixture``: ``distillation_loss(h_s, W_s, labels, TeacherMixture([t0, t1], [0.5, 0.5], combine),
  kl_weight=1.0)``;
- ``routed``: the same with a (BT, 2) weights tensor of one-hot rows, the first half of the rows routed to
  teacher 0 and the second half to teacher 1 (each teacher's GEMM runs over its half alone; one-hot rows
  give every mode the same loss);
- ``routed, scattered``: one-hot rows drawn at random (each teacher's rows gathered; reported, no target);
and once:
- ``n separate calls``: Σ_i ``distillation_loss(h_s, W_s, labels, t_i, kl_weight=w_i, student_ce_weight=1 if
  i == 0 else 0)`` and one gradient of the sum: the value of ``"divergences"``, the baseline of every mode;
- ``GEMM-only (cuBLAS)``: the unavoidable GEMMs back to back as ``benchmarks/bench.py`` defines them (the
  student's and each teacher's logits GEMM with an fp32 result, then the student's dh and dW), and
  ``GEMM-only (cuBLAS), routed``, where each teacher's logits GEMM runs over its half of the rows: the
  baseline of the routed rows.

Each row times forward and backward (the loss and ``torch.autograd.grad`` of the student's states and head;
orda_tp on ``--backend``, by default Triton on a GPU and torch on the CPU) with ``bench.measure``: the median
of 10 calls after 3 warm-ups (CUDA events; on the CPU 2 after 1), the spread, the peak memory above the inputs
(the returned gradients included) and without the gradients; then its time over its GEMM-only row, over the
separate calls' and, for the routed rows, over the dense mixture of the same mode. The checks, each row run
once more: its loss and gradients against an fp32 oracle from the full logits, :data:`ORACLE_ROWS` rows at a
time (:func:`oracle`: the inputs upcast, each mode's KL written from its definition, differentiated by
autograd), the loss's relative error and each gradient's ‖g − g_ref‖ / ‖g_ref‖ within :data:`TOLERANCE`; the
dense ``"divergences"`` mixture's loss against the separate calls' within :data:`SEPARATE_TOLERANCE`. The
targets, judged on a GPU and printed PASS or MISS (a MISS is a result): per mode, the mixture at most 1.2× its
GEMM-only time and 0.7× the separate calls', the routed rows at most 1.2× the routed GEMM-only time and 0.8×
the dense mixture's.

``--time-limit S``: no row starts after S seconds; the rows left are listed as not run. The exit status is 1
when a row fails or a check does (not for a MISS).

Outputs in ``--out`` (default $OUT, else ./mixture_out): mixture.log, mixture.jsonl (a line per row as it is
measured) and mixture.json (the environment, the arguments, every row and target); the rows and the targets
are printed last as Markdown tables.

    python3 benchmarks/mixture.py --out DIR --time-limit 420   # one GPU
    python3 benchmarks/mixture.py --small                      # the CPU: tiny shapes, checked
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The harness comes in before orda_tp (bench.py imports it first): it sets the Triton environment.
from benchmarks.bench import (  # noqa: E402
    GEMM_ONLY,
    BenchInputs,
    BenchShape,
    Budget,
    Step,
    _cell,
    _table,
    gemm_only_step,
    loss_step,
    make_bench_inputs,
    measure,
    separate_teacher,
)
from benchmarks.grad_precision import REFERENCE_ROWS  # noqa: E402
from benchmarks.harness import IGNORE_INDEX, Reporter, Runtime, fmt, guarded, recover_device, run_script  # noqa: E402
from orda_tp import SeparateTeacher, TeacherMixture, distillation_loss  # noqa: E402
from orda_tp.teachers.mixture import COMBINE_MODES  # noqa: E402
from tests.support.cases import relative_error  # noqa: E402

MIXTURE, ROUTED, SCATTERED, SEPARATE = "orda_tp mixture", "routed", "routed, scattered", "n separate calls"
ROUTED_GEMM_ONLY = f"{GEMM_ONLY}, routed"
#: The rows measured once, for every mode (no mode of their own).
SHARED_ROWS = (GEMM_ONLY, ROUTED_GEMM_ONLY, SEPARATE)
WEIGHTS = (0.5, 0.5)  # the teachers' weights, also each separate call's kl_weight
KL_WEIGHT = 1.0
TEACHER_SEED = 5  # teacher i is drawn from seed TEACHER_SEED + i
#: The weights of each row that calls orda_tp: the n numbers, one-hot rows by halves, one-hot rows at random.
DENSE, HALVES, DRAWN = "dense", "halves", "drawn"
ROW_WEIGHTS = {SEPARATE: DENSE, MIXTURE: DENSE, ROUTED: HALVES, SCATTERED: DRAWN}
#: The largest errors against the oracle that the check accepts: (the loss's relative error, a gradient's).
TOLERANCE = {torch.bfloat16: (1e-2, 2e-2), torch.float32: (1e-5, 1e-5)}
SEPARATE_TOLERANCE = 1e-3  # the dense "divergences" mixture's loss against the separate calls'
ORACLE_ROWS = REFERENCE_ROWS  # rows per chunk of the oracle's full logits
#: Each row's ratios: the ratio's name -> the row whose time divides its time (the same mode's, or a shared row).
BASELINES = {
    SEPARATE: {"x_gemm_only": GEMM_ONLY},
    MIXTURE: {"x_gemm_only": GEMM_ONLY, "x_separate": SEPARATE},
    ROUTED: {"x_gemm_only": ROUTED_GEMM_ONLY, "x_separate": SEPARATE, "x_mixture": MIXTURE},
    SCATTERED: {"x_gemm_only": ROUTED_GEMM_ONLY, "x_separate": SEPARATE, "x_mixture": MIXTURE},
}
BASELINE_NAMES = {"x_gemm_only": "GEMM-only", "x_separate": "separate calls", "x_mixture": "dense mixture"}
#: The targets, per mode: (row, ratio, the largest ratio that meets it).
TARGETS = (
    (MIXTURE, "x_gemm_only", 1.2),
    (MIXTURE, "x_separate", 0.7),
    (ROUTED, "x_gemm_only", 1.2),
    (ROUTED, "x_mixture", 0.8),
)


@dataclass(frozen=True)
class Shape:
    rows: int
    hidden: int
    teacher_hidden: int  # every teacher's width H_t
    vocab: int
    dtype: torch.dtype


GPU_SHAPE = Shape(rows=8192, hidden=2048, teacher_hidden=4096, vocab=128256, dtype=torch.bfloat16)
SMALL_SHAPE = Shape(rows=64, hidden=32, teacher_hidden=48, vocab=1000, dtype=torch.float32)


@dataclass(frozen=True)
class Problem:
    """The student's inputs (states and head requiring grad, labels), the teachers and each row's weights:
    ``weights[DENSE]`` the n numbers, ``weights[HALVES]`` and ``weights[DRAWN]`` (BT, n) fp32 one-hot rows."""

    inputs: BenchInputs
    teachers: tuple[SeparateTeacher, ...]
    weights: dict[str, list[float] | Tensor]

    def table(self, kind: str) -> Tensor:
        """``weights[kind]`` as a (BT, n) fp32 tensor on the device."""
        given = self.weights[kind]
        if isinstance(given, Tensor):
            return given
        return torch.tensor(given, device=self.inputs.labels.device).expand(self.inputs.labels.shape[0], -1)


def runs(rows: int, teachers: int) -> list[slice]:
    """The rows routed to each teacher: ``teachers`` consecutive runs of ``rows`` (halves for two)."""
    return [slice(index * rows // teachers, (index + 1) * rows // teachers) for index in range(teachers)]


def make_problem(shape: Shape, device: torch.device, seed: int) -> Problem:
    """The student's inputs as ``bench.py`` draws them, the teachers (seeds TEACHER_SEED + i) and the weights
    (the drawn one-hot rows from ``seed + 1``)."""
    student = BenchShape(shape.rows, shape.hidden, shape.vocab)
    inputs = make_bench_inputs(student, device, shape.dtype, None, seed)
    n = len(WEIGHTS)
    teachers = tuple(separate_teacher(inputs, shape.teacher_hidden, seed=TEACHER_SEED + i) for i in range(n))
    halves = torch.zeros(shape.rows, n, device=device)
    for index, rows in enumerate(runs(shape.rows, n)):
        halves[rows, index] = 1.0
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    drawn = F.one_hot(torch.randint(0, n, (shape.rows,), generator=generator, device=device), n).float()
    return Problem(inputs, teachers, {DENSE: list(WEIGHTS), HALVES: halves, DRAWN: drawn})


# ------------------------------------------------------------------------------------------------ the steps


def mixture_step(problem: Problem, backend: str, combine: str, kind: str) -> Step:
    """The mixture of the teachers under ``weights[kind]``, combined by ``combine``: one call, one gradient."""
    x = problem.inputs

    def loss() -> Tensor:
        mixture = TeacherMixture(problem.teachers, problem.weights[kind], combine)
        return distillation_loss(x.hidden, x.weight, x.labels, mixture, kl_weight=KL_WEIGHT, backend=backend).loss

    return loss_step(x, loss)


def separate_step(problem: Problem, backend: str) -> Step:
    """A call per teacher at kl_weight w_i (the student's CE in the first one alone), one gradient of the sum."""
    x = problem.inputs

    def loss() -> Tensor:
        losses = [
            distillation_loss(
                x.hidden, x.weight, x.labels, teacher, kl_weight=KL_WEIGHT * weight,
                student_ce_weight=1.0 if index == 0 else 0.0, backend=backend,
            ).loss
            for index, (teacher, weight) in enumerate(zip(problem.teachers, WEIGHTS))
        ]  # fmt: skip
        return sum(losses[1:], losses[0])

    return loss_step(x, loss)


def routed_gemm_only_step(problem: Problem) -> Step:
    """bench.py's GEMM-only step with each teacher's logits GEMM over the rows routed to it (``runs``)."""
    rows = runs(problem.inputs.labels.shape[0], len(problem.teachers))
    teachers = [SeparateTeacher(t.hidden[run], t.weight) for t, run in zip(problem.teachers, rows)]
    return gemm_only_step(problem.inputs, "KD", teachers)


# ------------------------------------------------------------------------------------------------ the oracle


@dataclass(frozen=True)
class Exact:
    loss: Tensor  # fp64 scalar
    grads: tuple[Tensor, Tensor]  # (dh, dW) in fp32


def kl_rows(log_q: Tensor, log_p: Tensor) -> Tensor:
    """Σ_v q·(log q − log p) over the last dimension (a column where q = 0 adds 0)."""
    return torch.where(log_q > -math.inf, log_q.exp() * (log_q - log_p), 0.0).sum(-1)


def mixture_kl(log_p: Tensor, logits: Tensor, weights: Tensor, combine: str) -> Tensor:
    """Each row's forward KL of the mixture at T = 1 from its definition (guide §16): ``log_p`` (rows, V) the
    student's log-probabilities, ``logits`` (n, rows, V) the teachers', ``weights`` (rows, n), each row's
    weights not all 0."""
    log_q = logits.log_softmax(-1)
    if combine == "divergences":  # Σ_i w_i·KL(q_i‖p)
        return (weights.T * kl_rows(log_q, log_p)).sum(0)
    if combine == "probabilities":  # KL(Σ_i w̃_i·q_i‖p), w̃ the row's weights over their sum
        shares = (weights / weights.sum(1, keepdim=True)).T.log()
        return kl_rows(torch.logsumexp(shares[:, :, None] + log_q, 0), log_p)
    return kl_rows((weights.T[:, :, None] * logits).sum(0).log_softmax(-1), log_p)  # the product of experts


def oracle(problem: Problem, kind: str, combine: str) -> Exact:
    """The loss (student CE + KL_WEIGHT · ``mixture_kl``, averaged over the rows not ignored) and its
    gradients with respect to the student's states and head, from the fp32 logits of the inputs upcast
    (fp32 GEMMs at torch's default precision), ORACLE_ROWS rows at a time, differentiated by autograd."""
    x, table = problem.inputs, problem.table(kind).float()
    hidden, head = x.hidden.detach(), x.weight.detach().float()
    heads = [teacher.weight.float() for teacher in problem.teachers]
    valid = x.labels != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    parts = []
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_head = torch.zeros(head.shape, dtype=torch.float32, device=hidden.device)
    for begin in range(0, hidden.shape[0], ORACLE_ROWS):
        rows = slice(begin, begin + ORACLE_ROWS)
        rows_hidden = hidden[rows].float()
        # Autograd runs from the chunk's logits alone; dh and dW are their products, so that no graph
        # spans more than ORACLE_ROWS rows of the (BT, V) logits.
        logits = (rows_hidden @ head.T).requires_grad_()
        teacher_logits = torch.stack([t.hidden[rows].float() @ w.T for t, w in zip(problem.teachers, heads)])
        log_p = logits.log_softmax(-1)
        ce = F.nll_loss(log_p, x.labels[rows], ignore_index=IGNORE_INDEX, reduction="none")
        kl = mixture_kl(log_p, teacher_logits, table[rows], combine)
        part = torch.where(valid[rows], ce + KL_WEIGHT * kl, 0.0).sum() / count
        (grad,) = torch.autograd.grad(part, logits)
        parts.append(part.detach().double())
        grad_hidden[rows] = grad @ head
        grad_head += grad.T @ rows_hidden
    return Exact(torch.stack(parts).sum(), (grad_hidden, grad_head))


# ------------------------------------------------------------------------------------------------ the run


HEADER = (
    f"{'mode':<17} {'impl':<26} {'ms':>8} {'spread':>7} {'peak MiB':>9} {'wkspc MiB':>9} {'x GEMM':>6} "
    f"{'x sep':>6} {'x dense':>7} {'loss':>11}"
)


@dataclass
class Run:
    """The run's state: where rows are printed and kept (in the order measured), the problem, the time
    budget and the oracle."""

    reporter: Reporter
    runtime: Runtime
    problem: Problem
    budget: Budget
    rows: list[dict[str, Any]]
    exact: Callable[[str, str], Exact]  # (weights kind, combine) -> the oracle's outputs

    def find(self, mode: str | None, impl: str) -> dict[str, Any] | None:
        """The measured row of ``impl`` (a shared row's whatever ``mode``), or None."""
        mode = None if impl in SHARED_ROWS else mode
        return next((r for r in self.rows if (r["mode"], r["impl"], r["status"]) == (mode, impl, "ok")), None)

    def row(self, mode: str | None, impl: str, make: Callable[[], Step]) -> None:
        """Measure ``make()``'s step, check its outputs (every row that calls orda_tp), add its ratios,
        print it and append it to mixture.jsonl; once the time limit is spent, record it as not run."""
        label = impl if mode is None else f"{mode} {impl}"
        row: dict[str, Any] = {"mode": mode, "impl": impl}
        if self.budget.spent(self.runtime):
            self.budget.not_run.append(label)
            row |= {"status": "not run", "message": f"--time-limit {self.budget.seconds:g} s reached"}
        else:
            row |= self.measured(label, make)
            if row["status"] == "ok" and impl in ROW_WEIGHTS:
                row |= self.checked(label, mode or "divergences", impl, make)
            if row["status"] == "ok":
                for name, baseline in BASELINES.get(impl, {}).items():
                    divisor = self.find(mode, baseline)
                    row[name] = None if divisor is None else row["ms"] / divisor["ms"]
        self.rows.append(row)
        self.reporter.line(row_line(row))
        with (self.reporter.out_dir / "mixture.jsonl").open("a") as lines:
            lines.write(json.dumps(row) + "\n")

    def measured(self, label: str, make: Callable[[], Step]) -> dict[str, Any]:
        """Time and memory (``status`` "ok", or "error": then the run fails)."""
        ok, timing = guarded(self.reporter, label, lambda: measure(make(), self.runtime.device))
        recover_device()
        if not ok:
            self.reporter.fail(f"{label}: {timing}")
            return {"status": "error", "message": timing}
        return dict(
            status="ok", ms=timing.ms, spread_ms=timing.spread_ms, peak_mib=timing.peak_mib,
            workspace_mib=timing.workspace_mib,
        )  # fmt: skip

    def checked(self, label: str, combine: str, impl: str, make: Callable[[], Step]) -> dict[str, Any]:
        """One more call, its loss and gradients against the oracle (and, for the dense "divergences"
        mixture, its loss against the separate calls'); a failed check fails the run."""
        ok, result = guarded(self.reporter, f"{label} check", lambda: self.compare(combine, impl, make()))
        recover_device()
        if not ok:
            self.reporter.fail(f"{label} check: {result}")
            return {"status": "error", "message": result}
        self.reporter.line(check_line(label, result["check"]))
        if not result["check"]["ok"]:
            self.reporter.fail(f"{label} against the oracle: {result['check']['errors']}")
        return result

    def compare(self, combine: str, impl: str, step: Step) -> dict[str, Any]:
        loss, grads = step()
        exact = self.exact(ROW_WEIGHTS[impl], combine)
        values, gradients = TOLERANCE[self.problem.inputs.hidden.dtype]
        errors = {"loss": relative_error(loss, exact.loss)}
        errors |= {name: relative_error(g, e) for name, g, e in zip(("dh", "dW"), grads, exact.grads)}
        limits = {"loss": values, "dh": gradients, "dW": gradients}
        separate = self.find(None, SEPARATE)
        if (combine, impl) == ("divergences", MIXTURE) and separate is not None:
            errors["separate"] = relative_error(loss, loss.new_tensor(separate["loss"]))
            limits["separate"] = SEPARATE_TOLERANCE
        check = {"errors": errors, "tolerance": limits, "ok": all(errors[k] <= limits[k] for k in limits)}
        return {"loss": float(loss), "exact_loss": float(exact.loss), "check": check}


def row_line(row: dict[str, Any]) -> str:
    mode = row["mode"] or ""
    if row["status"] != "ok":
        return f"{mode:<17} {row['impl']:<26} {row['status'].upper()}: {row.get('message', '')}"
    return (
        f"{mode:<17} {row['impl']:<26} {row['ms']:>8.2f} {row['spread_ms']:>7.2f} {fmt(row['peak_mib'], '9.0f'):>9} "
        f"{fmt(row['workspace_mib'], '9.0f'):>9} {fmt(row.get('x_gemm_only'), '6.3f'):>6} "
        f"{fmt(row.get('x_separate'), '6.3f'):>6} {fmt(row.get('x_mixture'), '7.3f'):>7} "
        f"{fmt(row.get('loss'), '11.6g'):>11}"
    )


def check_line(label: str, check: dict[str, Any]) -> str:
    errors, limits = check["errors"], check["tolerance"]
    found = ", ".join(f"{name} {errors[name]:.1e} (<= {limits[name]:g})" for name in limits)
    return f"check {label} against the fp32 oracle{' and the separate calls' if 'separate' in limits else ''}: " + (
        f"{found}: {'ok' if check['ok'] else 'FAIL'}"
    )


def targets(rows: list[dict[str, Any]], judged: bool) -> list[dict[str, Any]]:
    """Per mode, each target's ratio (None where a row was not measured) and whether it is met (None
    where it is not judged: on the CPU, or without the ratio)."""
    results = []
    for mode in COMBINE_MODES:
        for impl, name, limit in TARGETS:
            row = next((r for r in rows if (r["mode"], r["impl"]) == (mode, impl)), {})
            ratio = row.get(name)
            met = None if not judged or ratio is None else ratio <= limit
            results.append({"mode": mode, "impl": impl, "over": name, "ratio": ratio, "target": limit, "met": met})
    return results


def verdict(target: dict[str, Any]) -> str:
    if target["ratio"] is None:
        return "not measured"
    return {True: "PASS", False: "MISS", None: "not judged (CPU)"}[target["met"]]


def markdown(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[str]:
    """The rows and the targets as Markdown tables."""
    lines = _table(
        ["mode", "implementation", "ms", "spread ms", "peak MiB", "× GEMM-only", "× separate", "× dense mixture",
         "loss error", "gradient error"],
        (
            [r["mode"] or "all", r["impl"], _cell(r.get("ms"), ".2f") if r["status"] == "ok" else r["status"],
             _cell(r.get("spread_ms"), ".2f"), _cell(r.get("peak_mib"), ".0f"), _cell(r.get("x_gemm_only"), ".3f"),
             _cell(r.get("x_separate"), ".3f"), _cell(r.get("x_mixture"), ".3f"),
             _cell(r["check"]["errors"]["loss"], ".1e") if "check" in r else "-",
             _cell(max(r["check"]["errors"]["dh"], r["check"]["errors"]["dW"]), ".1e") if "check" in r else "-"]
            for r in rows
        ),
    )  # fmt: skip
    return lines + [""] + _table(
        ["mode", "row", "time ÷", "ratio", "target", "verdict"],
        (
            [t["mode"], t["impl"], BASELINE_NAMES[t["over"]], _cell(t["ratio"], ".3f"), f"≤ {t['target']:g}",
             verdict(t)]
            for t in results
        ),
    )  # fmt: skip


def body(args: argparse.Namespace) -> Callable[[Reporter, Runtime], None]:
    def run(reporter: Reporter, runtime: Runtime) -> None:
        budget = Budget(args.time_limit)
        shape = SMALL_SHAPE if args.small else GPU_SHAPE
        problem = make_problem(shape, runtime.device, args.seed)
        reporter.data["mixture"] = record = {
            "shape": vars(shape) | {"dtype": str(shape.dtype)}, "teachers": len(WEIGHTS), "weights": list(WEIGHTS),
            "backend": args.backend, "rows": [],
        }  # fmt: skip
        (reporter.out_dir / "mixture.jsonl").write_text("")
        reporter.line(
            f"BT = {shape.rows}, H_s = {shape.hidden}, {len(WEIGHTS)} teachers of H_t = {shape.teacher_hidden}, "
            f"V = {shape.vocab}, {shape.dtype}; student CE + forward KL (T = 1), weights {WEIGHTS}; "
            f"orda_tp backend {args.backend!r}"
        )
        reporter.line(HEADER)
        # The oracle of the last (weights, mode) asked: the separate calls and the dense "divergences" share one.
        exact = lru_cache(maxsize=1)(partial(oracle, problem))
        bench = Run(reporter, runtime, problem, budget, record["rows"], exact)
        bench.row(None, GEMM_ONLY, lambda: gemm_only_step(problem.inputs, "KD", problem.teachers))
        bench.row(None, ROUTED_GEMM_ONLY, lambda: routed_gemm_only_step(problem))
        bench.row(None, SEPARATE, lambda: separate_step(problem, args.backend))
        # The scattered rows last: they have no target, and --time-limit leaves out the last rows first.
        for impls in ((MIXTURE, ROUTED), (SCATTERED,)):
            for combine in COMBINE_MODES:
                for impl in impls:
                    bench.row(combine, impl, partial(mixture_step, problem, args.backend, combine, ROW_WEIGHTS[impl]))
                reporter.dump()
        record["targets"] = targets(bench.rows, judged=runtime.device.type == "cuda")
        record["not_run"] = budget.not_run
        for target in record["targets"]:
            reporter.line(
                f"target {target['mode']} {target['impl']}: {fmt(target['ratio'], '.3f')} x "
                f"{BASELINE_NAMES[target['over']]} <= {target['target']:g}: {verdict(target)}"
            )
        if budget.not_run:
            reporter.line(f"not run (--time-limit {budget.seconds:g} s): " + "; ".join(budget.not_run))
        reporter.line("")
        for line in markdown(bench.rows, record["targets"]):
            reporter.line(line)

    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=("triton", "torch"), help="default: triton on CUDA, torch on the CPU")
    parser.add_argument("--small", action="store_true", help="tiny fp32 shapes, for the CPU")
    parser.add_argument("--time-limit", type=float, default=math.inf, help="seconds after which no row starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results directory (default $OUT, else ./mixture_out)")
    args = parser.parse_args(argv)
    args.backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    args.out = args.out or (os.environ.get("OUT") or "mixture_out")
    args.tp = False  # run_script's one-device path
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_script(args, "mixture", body(args))


if __name__ == "__main__":
    sys.exit(main())
