"""How close each implementation's gradients are to exact ones, on three data sets and three cases:
the ``--precision`` part of ``benchmarks/bench.py``, which passes in the implementations (orda_tp's
profiles and the importable peers) and keeps the rows in bench.json and bench_tables.md.

What is measured: for each (data set, case) and implementation, ‖g − g_ref‖ / ‖g_ref‖ of ``dh`` and
of ``dW`` separately, against exact gradients computed in fp32 from the same bf16 inputs upcast, over
chunks of rows (``reference_grads``); and whether two calls give bitwise equal gradients
("reproducible"). bf16 inputs always (on the CPU too); labels of 1 row in 7 ignored (-100).

Data sets: a head W (V, H) and hidden states h (BT, H).
  "1/sqrt(H)": W ~ N(0, 1/H), h ~ N(0, 1): logits of std ≈ 1;
  "2/sqrt(H)": W ~ N(0, 4/H), h ~ N(0, 1): logits of std ≈ 2;
  "peaked": trained-like logits: W ~ N(0, 1/H) and h = N(0, 1) + 12·W[y]/‖W[y]‖² for each row's class
      y (its label, unless the row is ignored), so that the label's logit stands 12 above the mean of
      the row's others (std 1): at V = 128256 its probability is ≈ 0.4. Each data set's logit
      statistics are printed (means over rows, in fp32).
Cases (T = 1, the tied frozen teacher: its hidden states through the student's head):
  "CE": the student's cross-entropy alone;
  "KL near convergence": forward KL(q‖p) alone (student_ce_weight = 0, kl_weight = 1), the teacher's
      hidden states h + ε·N(0, 1), ε calibrated in fp32 on the first CALIBRATION_ROWS rows so that the
      mean KL is TARGET_KL nats per row (the achieved KL is printed);
  "CE + KL": student CE + forward KL, the teacher's hidden states drawn independently, as the data
      set's are (for "peaked": around the same classes, so the teacher is peaked on the same labels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from benchmarks.harness import IGNORE_EVERY, IGNORE_INDEX, Reporter, fmt, guarded, recover_device

DTYPE = torch.bfloat16
# Each task's (student CE weight, forward-KL weight); bench.py's too. "KL" is timed nowhere.
TASK_WEIGHTS: dict[str, tuple[float, float]] = {"KD": (1.0, 1.0), "CE": (1.0, 0.0), "KL": (0.0, 1.0)}
REFERENCE_ROWS = 1024  # rows per chunk of the fp32 reference gradients and of the statistics
CALIBRATION_ROWS = 256  # rows on which the perturbed teacher's ε is calibrated
TARGET_KL = 5e-4  # nats per row, "KL near convergence"
CALIBRATION_EPS = 0.05  # the trial ε, scaled to TARGET_KL (the KL grows as ε² for small ε)


@dataclass(frozen=True)
class DataSet:
    name: str
    head_std: float  # W ~ N(0, head_std²/H): the logits' standard deviation for h ~ N(0, 1)
    margin: float = 0.0  # how far each row's label logit stands above the others' mean


@dataclass(frozen=True)
class Case:
    name: str
    task: str  # a key of TASK_WEIGHTS
    perturbed: bool  # the teacher: the student's hidden states + ε·noise, else drawn independently


DATA_SETS = (DataSet("1/sqrt(H)", 1.0), DataSet("2/sqrt(H)", 2.0), DataSet("peaked", 1.0, margin=12.0))
CASES = (Case("CE", "CE", False), Case("KL near convergence", "KL", True), Case("CE + KL", "KD", False))


@dataclass(frozen=True)
class Problem:
    """One case's bf16 inputs (``hidden`` and ``weight`` need grad) and its task."""

    hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher_hidden: Tensor
    task: str


@dataclass(frozen=True)
class Contender:
    """One implementation: ``grads(problem)`` is its ``(dh, dW)`` for a problem whose task it supports."""

    name: str
    grads: Callable[[Problem], tuple[Tensor, ...]]
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class Data:
    """One data set's head, student hidden states, classes (one per row) and labels."""

    weight: Tensor
    hidden: Tensor
    classes: Tensor
    labels: Tensor


# ------------------------------------------------------------------------------------------------ data


def draw_hidden(data_set: DataSet, weight: Tensor, classes: Tensor, generator: torch.Generator) -> Tensor:
    """N(0, 1) rows, plus ``margin·W[y]/‖W[y]‖²`` for "peaked" (the bf16 head's rows in fp32): the
    label logit rises by ``margin``, each other logit by N(0, margin²/‖W[y]‖² · head_std²/H) ≈ 0."""
    hidden = torch.randn(classes.shape[0], weight.shape[1], generator=generator, device=weight.device)
    if data_set.margin:
        rows = weight[classes].float()
        hidden += data_set.margin * rows / rows.square().sum(-1, keepdim=True)
    return hidden.to(DTYPE)


def make_data(data_set: DataSet, shape: tuple[int, int, int], device: torch.device, seed: int) -> Data:
    """The data set's head and student rows; classes uniform, 1 label in IGNORE_EVERY ignored."""
    rows, width, vocab = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    std = data_set.head_std / width**0.5
    weight = (torch.randn(vocab, width, generator=generator, device=device) * std).to(DTYPE)
    classes = torch.randint(0, vocab, (rows,), generator=generator, device=device)
    labels = classes.clone()
    labels[3::IGNORE_EVERY] = IGNORE_INDEX
    return Data(weight, draw_hidden(data_set, weight, classes, generator), classes, labels)


def logit_stats(data: Data) -> dict[str, float]:
    """Means over rows, in fp32: the logits' standard deviation, the label logit's margin over the
    mean of the row's others and over their logsumexp, the largest probability."""
    weight = data.weight.float()
    total = {"sum": 0.0, "square": 0.0, "margin": 0.0, "over_lse": 0.0, "max_prob": 0.0}
    for begin in range(0, data.hidden.shape[0], REFERENCE_ROWS):
        chunk = slice(begin, begin + REFERENCE_ROWS)
        logits, classes = data.hidden[chunk].float() @ weight.T, data.classes[chunk, None]
        label = logits.gather(1, classes)[:, 0]
        others = logits.scatter(1, classes, -math.inf)
        total["sum"] += float(logits.sum())
        total["square"] += float(logits.square().sum())
        total["margin"] += float((label - (logits.sum(-1) - label) / (logits.shape[1] - 1)).sum())
        total["over_lse"] += float((label - others.logsumexp(-1)).sum())
        total["max_prob"] += float(logits.softmax(-1).amax(-1).sum())
    rows, count = data.hidden.shape[0], data.hidden.shape[0] * weight.shape[0]
    mean = total["sum"] / count
    return {
        "logit_std": math.sqrt(max(total["square"] / count - mean**2, 0.0)),
        "label_minus_others_mean": total["margin"] / rows,
        "label_minus_others_logsumexp": total["over_lse"] / rows,
        "max_prob": total["max_prob"] / rows,
    }


def mean_kl(hidden: Tensor, teacher_hidden: Tensor, weight: Tensor) -> float:
    """Mean over the rows of KL(q‖p) in fp32, p = softmax(h·Wᵀ) and q = softmax(t·Wᵀ)."""
    log_p = (hidden.float() @ weight.T).log_softmax(-1)
    log_q = (teacher_hidden.float() @ weight.T).log_softmax(-1)
    return float((log_q.exp() * (log_q - log_p)).sum(-1).mean())


def perturbed_teacher(data: Data, generator: torch.Generator) -> tuple[Tensor, float, float]:
    """The student's hidden states + ε·N(0, 1) in bf16, ε scaled from CALIBRATION_EPS to TARGET_KL
    on the first CALIBRATION_ROWS rows; returns them, ε and the KL they give on those rows."""
    noise = torch.randn(data.hidden.shape, generator=generator, device=data.hidden.device)
    rows, weight = slice(0, CALIBRATION_ROWS), data.weight.float()
    hidden = data.hidden.float()
    trial = mean_kl(hidden[rows], hidden[rows] + CALIBRATION_EPS * noise[rows], weight)
    eps = CALIBRATION_EPS * math.sqrt(TARGET_KL / trial)
    teacher = (hidden + eps * noise).to(DTYPE)
    return teacher, eps, mean_kl(hidden[rows], teacher[rows], weight)


# ------------------------------------------------------------------------------------------------ reference


def reference_grads(
    hidden: Tensor, weight: Tensor, labels: Tensor, teacher_hidden: Tensor, task: str
) -> tuple[Tensor, Tensor]:
    """The task's exact gradients ``(dh, dW)`` in fp32, from fp32 logits over chunks of
    REFERENCE_ROWS rows (fp32 GEMMs at torch's default precision, no TF32): for the task's weights
    ``(a, b)`` (TASK_WEIGHTS), ``∂/∂s = a·(softmax(s) − onehot(y)) + b·(softmax(s) − softmax(t))``
    (student CE, forward KL(q‖p) at T = 1 with the tied frozen teacher's logits t), ÷ the
    non-ignored rows, 0 on ignored rows."""
    ce_weight, kl_weight = TASK_WEIGHTS[task]
    hidden, weight = hidden.detach(), weight.detach().float()
    valid = labels != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device)
    for begin in range(0, hidden.shape[0], REFERENCE_ROWS):
        rows = slice(begin, begin + REFERENCE_ROWS)
        rows_hidden = hidden[rows].float()
        grad = (rows_hidden @ weight.T).softmax(-1).mul_(ce_weight + kl_weight)
        if kl_weight:
            grad -= kl_weight * (teacher_hidden[rows].float() @ weight.T).softmax(-1)
        kept = valid[rows]
        grad[kept.nonzero()[:, 0], labels[rows][kept]] -= ce_weight
        grad *= (kept / count)[:, None]
        grad_hidden[rows] = grad @ weight
        grad_weight += grad.T @ rows_hidden
    return grad_hidden, grad_weight


def grad_errors(grads: tuple[Tensor, ...], reference: tuple[Tensor, Tensor]) -> tuple[float, float]:
    """‖g − g_ref‖ / ‖g_ref‖ of ``dh`` and of ``dW``, in fp32."""
    dh, dw = (float((g.float() - r).norm() / r.norm()) for g, r in zip(grads, reference))
    return dh, dw


# ------------------------------------------------------------------------------------------------ the part


PRECISION_HEADER = f"{'data set':<10} {'case':<20} {'impl':<24} {'dh err':>8} {'dW err':>8}  reproducible"


def run_precision(
    reporter: Reporter,
    device: torch.device,
    shape: tuple[int, int, int],
    contenders: list[Contender],
    seed: int,
    spent: Callable[[], bool],
) -> dict[str, Any]:
    """Every data set and case for every contender that supports the case's task; once ``spent()``,
    the rows left are recorded as not run. Returns the shape, each data set's statistics and the rows."""
    rows, width, vocab = shape
    reporter.line(
        f"== gradient precision: BT={rows}, H={width}, V={vocab}, bf16 inputs; errors ‖g − g_ref‖/‖g_ref‖ against "
        "exact fp32 gradients; reproducible: two calls' gradients bitwise equal"
    )
    stats: dict[str, dict[str, float]] = {}
    out: list[dict[str, Any]] = []
    for index, data_set in enumerate(DATA_SETS):
        data = None
        if not spent():
            ok, data = guarded(
                reporter, f"precision inputs {data_set.name}", partial(make_data, data_set, shape, device, seed + index)
            )
            if not ok:
                reporter.fail(f"precision inputs {data_set.name}: {data}")
                continue
            stats[data_set.name] = logit_stats(data)
            print_stats(reporter, data_set, stats[data_set.name])
        reporter.line(PRECISION_HEADER)
        generator = torch.Generator(device=device).manual_seed(seed + 100 + index)
        for case in CASES:
            out += run_case(reporter, data, data_set, case, contenders, generator, spent)
        del data
        recover_device()
    return {"shape": {"rows": rows, "hidden": width, "vocab": vocab}, "data_sets": stats, "rows": out}


def print_stats(reporter: Reporter, data_set: DataSet, stats: dict[str, float]) -> None:
    margin = f", label margin {data_set.margin:g}" if data_set.margin else ""
    reporter.line(
        f"   data set {data_set.name} (W ~ N(0, {data_set.head_std**2:g}/H){margin}): logit std "
        f"{stats['logit_std']:.2f}; label logit − mean of the others {stats['label_minus_others_mean']:.2f}; label "
        f"logit − logsumexp of the others {stats['label_minus_others_logsumexp']:.2f}; max probability "
        f"{stats['max_prob']:.3f} (means over rows, fp32)"
    )


@dataclass(frozen=True)
class Prepared:
    """One case's problem, its exact gradients and, for a perturbed teacher, its ε and the KL it gives."""

    problem: Problem
    reference: tuple[Tensor, Tensor]
    calibration: dict[str, float]


def prepare(data: Data, data_set: DataSet, case: Case, generator: torch.Generator) -> Prepared:
    """The case's teacher, its problem (the data set's tensors, as leaves that need grad) and the
    exact gradients."""
    calibration: dict[str, float] = {}
    if case.perturbed:
        teacher, calibration["teacher_eps"], calibration["teacher_kl"] = perturbed_teacher(data, generator)
    else:
        teacher = draw_hidden(data_set, data.weight, data.classes, generator)
    hidden, weight = data.hidden.detach().requires_grad_(), data.weight.detach().requires_grad_()
    reference = reference_grads(hidden, weight, data.labels, teacher, case.task)
    return Prepared(Problem(hidden, weight, data.labels, teacher, case.task), reference, calibration)


def run_case(
    reporter: Reporter,
    data: Data | None,
    data_set: DataSet,
    case: Case,
    contenders: list[Contender],
    generator: torch.Generator,
    spent: Callable[[], bool],
) -> list[dict[str, Any]]:
    """One (data set, case): its problem and reference, then each contender's errors."""
    chosen = [c for c in contenders if case.task in c.tasks]
    rows = [{"data_set": data_set.name, "case": case.name, "task": case.task, "impl": c.name} for c in chosen]
    label = f"precision {data_set.name} {case.name}"
    if data is None or spent():
        return mark(reporter, rows, status="not run", message="--time-limit reached")
    ok, prepared = guarded(reporter, f"{label} reference", lambda: prepare(data, data_set, case, generator))
    if not ok:
        reporter.fail(f"{label}: {prepared}")
        return mark(reporter, rows, status="error", message=prepared)
    if prepared.calibration:
        eps, kl = prepared.calibration["teacher_eps"], prepared.calibration["teacher_kl"]
        calibrated = min(CALIBRATION_ROWS, data.hidden.shape[0])
        reporter.line(
            f"   {data_set.name}, {case.name}: teacher = student + ε·N(0, 1), ε = {eps:.4f}: mean KL {kl:.2e} nats "
            f"per row (fp32, first {calibrated} rows)"
        )
    for contender, row in zip(chosen, rows):
        if spent():
            row.update(status="not run", message="--time-limit reached")
        else:
            row.update(prepared.calibration)
            row.update(contender_errors(reporter, f"{label} {contender.name}", contender, prepared))
        print_precision_row(reporter, row)
    del prepared
    recover_device()
    return rows


def mark(reporter: Reporter, rows: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """``rows``, each with ``fields`` (a status and a message), printed."""
    for row in rows:
        row.update(fields)
        print_precision_row(reporter, row)
    return rows


def contender_errors(reporter: Reporter, label: str, contender: Contender, prepared: Prepared) -> dict[str, Any]:
    """Two calls: the first one's errors, and whether the second's gradients are bitwise the same.
    An error is recorded (and fails the run), running out of memory is a result."""

    def errors() -> tuple[tuple[float, float], bool]:
        first = contender.grads(prepared.problem)
        second = contender.grads(prepared.problem)
        return grad_errors(first, prepared.reference), all(torch.equal(a, b) for a, b in zip(first, second))

    ok, result = guarded(reporter, label, errors)
    recover_device()
    if ok:
        (dh, dw), same = result
        return {"status": "ok", "dh_err": dh, "dW_err": dw, "reproducible": same}
    if result.startswith("OutOfMemoryError"):
        return {"status": "OOM", "message": result}
    reporter.fail(f"{label}: {result}")
    return {"status": "error", "message": result}


def print_precision_row(reporter: Reporter, row: dict[str, Any]) -> None:
    head = f"{row['data_set']:<10} {row['case']:<20} {row['impl']:<24}"
    if row["status"] != "ok":
        reporter.line(f"{head} {row['status'].upper():>8}  {row.get('message', '')}")
        return
    reproducible = "yes" if row["reproducible"] else "no"
    reporter.line(f"{head} {fmt(row['dh_err'], '8.1e')} {fmt(row['dW_err'], '8.1e')}  {reproducible}")
