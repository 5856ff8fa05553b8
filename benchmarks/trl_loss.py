"""TRL's on-policy distillation loss against orda_tp's TRL adapter on the same inputs: time, memory,
agreement (issue 37).

The inputs are what TRL 1.16's ``DistillationTrainer`` hands its loss (``benchmarks/onpolicy.py``):
the student's and the teacher's final hidden states at the completion positions, (B, K, H_s) and
(B, K, H_t), N(0, 1); their LM heads (V, H_s) and (V, H_t), N(0, σ²/H), so that logits have a
standard deviation near σ = ``--logit-std`` (2); the completion mask (B, K), all ones, or with
``--masked-fraction f`` each completion cut short as at an EOS (its last positions masked, fewer in
the first completion and more in the last, f of all positions); ``num_items_in_batch`` as the trainer
passes it; no head bias, logit scale or soft-cap (Llama's and Qwen's configs); T = 1. Defaults:
V = 151936 (Qwen's), H_s = H_t = 4096, (B, K) = (8, 1024): 8192 tokens, bf16, the student's states
and head requiring gradients. ``--small``: fp32, (B, K) = (2, 16), H_s = 32, H_t = 48, V = 1000.

Rows, for each β of ``--betas`` (0, 0.5, 1):
- ``TRL``: ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (trl 1.16.0) called as the
  trainer calls it: on a GPU its ``ChunkedDivergenceFunction`` runs Triton kernels on the masked-in
  rows, on the CPU its torch tiles;
- ``orda_tp adapter``: ``orda_tp.integrations.trl.chunked_divergence_loss``, the same call;
- ``orda_tp direct``: ``orda_tp.distillation_loss`` with the keywords the adapter passes it
  (``SeparateTeacher``, student CE weight 0, ``kl_divergence="generalized_jsd"``, ``kl_beta=β``, the
  student's entropy, ``reduction="sum"``, divided by ``num_items_in_batch``) on all B·K rows, the
  masked-out ones labelled -100: no reshape, and on a GPU no dropping of the masked-out rows;
and once, ``GEMM-only (cuBLAS)``: the unavoidable GEMMs of either loss back to back on the masked-in
rows, as ``benchmarks/bench.py`` defines them (each side's logits GEMM with an fp32 result, then the
student's dh and dW).

Each row times forward and backward (the loss and ``torch.autograd.grad`` of the student's states
and head): the median of 10 calls after 3 warm-ups (CUDA events; on the CPU 2 after 1), the spread,
the peak memory above the inputs (the returned gradients included) and without the gradients
(``bench.measure``), and its ratios to TRL's row (time, peak) and to GEMM-only (time). The check, per
β: the adapter's and the direct call's loss, entropy sum, count and gradients against TRL's (relative
errors; a gradient's ‖g − g_TRL‖ / ‖g_TRL‖) within :data:`TOLERANCE`. The issue's targets, judged on a
GPU: the adapter at most 0.68× TRL's time at β = 0 and 1, 0.55× in between, 0.5× its peak memory,
each printed PASS or MISS. A MISS is a result: the exit status is 1 when a row fails or a check does.

Outputs in ``--out`` (default $OUT, else ./trl_loss_out): trl_loss.log, trl_loss.jsonl (a line per
row as it is measured) and trl_loss.json (the environment, the arguments, every row and target).

    python3 benchmarks/trl_loss.py --out DIR                          # one GPU
    python3 benchmarks/trl_loss.py --masked-fraction 0.25 --out DIR   # a ragged completion mask
    python3 benchmarks/trl_loss.py --small                            # the CPU: tiny shapes, checked
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The harness comes in before orda_tp (bench.py imports it first): it sets the Triton environment.
from benchmarks.bench import BenchInputs, Step, gemm_only_step, measure  # noqa: E402
from benchmarks.grad_precision import grad_errors  # noqa: E402
from benchmarks.harness import IGNORE_INDEX, Reporter, Runtime, fmt, guarded, recover_device, run_script  # noqa: E402
from benchmarks.onpolicy import TrlLoss, trainer_call, trainer_num_items  # noqa: E402
from orda_tp import SeparateTeacher, distillation_loss  # noqa: E402
from orda_tp.integrations.trl import _divergence_keywords, chunked_divergence_loss  # noqa: E402

TRL, ADAPTER, DIRECT, GEMM_ONLY = "TRL", "orda_tp adapter", "orda_tp direct", "GEMM-only (cuBLAS)"
#: The largest relative errors against TRL that the check accepts: (loss and entropy sum, gradients).
TOLERANCE = {torch.bfloat16: (1e-3, 1e-2), torch.float32: (1e-5, 1e-4)}
#: Issue 37's targets for the adapter: its time over TRL's (β = 0 or 1; in between), its peak over TRL's.
KL_TIME_TARGET, JSD_TIME_TARGET, MEMORY_TARGET = 0.68, 0.55, 0.5


@dataclass(frozen=True)
class Shape:
    batch: int
    positions: int  # K, the completion positions of each sequence
    hidden: int
    teacher_hidden: int
    vocab: int
    dtype: torch.dtype


GPU_SHAPE = Shape(batch=8, positions=1024, hidden=4096, teacher_hidden=4096, vocab=151936, dtype=torch.bfloat16)
SMALL_SHAPE = Shape(batch=2, positions=16, hidden=32, teacher_hidden=48, vocab=1000, dtype=torch.float32)


@dataclass(frozen=True)
class LossInputs:
    """One problem: rows flattened as (B·K, H), the student's states and head leaves requiring grad."""

    student_hidden: Tensor
    student_weight: Tensor
    teacher_hidden: Tensor
    teacher_weight: Tensor
    completion_mask: Tensor  # (B, K) int64, as the trainer pads it
    num_items_in_batch: Tensor

    def states(self) -> tuple[Tensor, Tensor]:
        """The student's and the teacher's states as (B, K, H) views, as the trainer passes them."""
        batch, positions = self.completion_mask.shape
        return self.student_hidden.view(batch, positions, -1), self.teacher_hidden.view(batch, positions, -1)

    @property
    def valid(self) -> Tensor:
        return self.completion_mask.reshape(-1) != 0


def completion_mask(batch: int, positions: int, masked_fraction: float, device: torch.device) -> Tensor:
    """(B, K) int64: completion b keeps its first K − m_b positions, m_b = round(f·K·2b/(B − 1))
    (m = round(f·K) for one completion): cut as at an EOS, f of all positions masked on average."""
    shares = torch.linspace(0.0, 2.0, batch) if batch > 1 else torch.ones(1)
    lengths = positions - (masked_fraction * positions * shares).round().long()
    return (torch.arange(positions) < lengths[:, None]).long().to(device)


def make_inputs(shape: Shape, device: torch.device, masked_fraction: float, logit_std: float, seed: int) -> LossInputs:
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*size, generator=generator, device=device) * scale).to(shape.dtype)

    rows = shape.batch * shape.positions
    mask = completion_mask(shape.batch, shape.positions, masked_fraction, device)
    return LossInputs(
        student_hidden=randn(rows, shape.hidden).requires_grad_(),
        student_weight=randn(shape.vocab, shape.hidden, scale=logit_std / shape.hidden**0.5).requires_grad_(),
        teacher_hidden=randn(rows, shape.teacher_hidden),
        teacher_weight=randn(shape.vocab, shape.teacher_hidden, scale=logit_std / shape.teacher_hidden**0.5),
        completion_mask=mask,
        num_items_in_batch=trainer_num_items(mask),
    )


# ------------------------------------------------------------------------------------------------ the calls

Call = Callable[[LossInputs, float], tuple[Tensor, Tensor, Tensor]]  # (inputs, β) -> (loss, entropy_sum, n_valid)


def as_trainer_call(loss: TrlLoss) -> Call:
    """``loss`` (TRL's function or the adapter) called as ``DistillationTrainer._compute_loss`` calls it."""

    def call(x: LossInputs, beta: float) -> tuple[Tensor, Tensor, Tensor]:
        student, teacher = x.states()
        return trainer_call(
            loss, student, teacher, x.student_weight, x.teacher_weight, x.completion_mask, beta, x.num_items_in_batch
        )

    return call


def direct_call(x: LossInputs, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """``distillation_loss`` with the keywords the adapter passes it (T = 1, heads without bias, scale
    or cap: student CE weight 0, ``kl_divergence="generalized_jsd"``, ``kl_beta=β``, the entropy)."""
    labels = torch.where(x.valid, 0, IGNORE_INDEX)
    keywords = _divergence_keywords(beta, 1.0, (1.0, 1.0), (None, None))
    teacher = SeparateTeacher(x.teacher_hidden, x.teacher_weight)
    output = distillation_loss(x.student_hidden, x.student_weight, labels, teacher, reduction="sum", **keywords)
    return output.loss / x.num_items_in_batch, output.student_entropy, x.valid.sum()


def forward_backward(call: Call, x: LossInputs, beta: float) -> Step:
    """The loss and its gradients with respect to the student's states and head (bench.measure's step)."""
    params = (x.student_hidden, x.student_weight)

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        loss = call(x, beta)[0]
        return loss.detach(), torch.autograd.grad(loss, params)

    return step


def gemm_only(x: LossInputs) -> Step:
    """bench.py's GEMM-only step on the masked-in rows: the student's and the teacher's logits GEMMs
    (fp32 results), the student's dh and dW."""
    student, teacher = x.student_hidden.detach()[x.valid], x.teacher_hidden[x.valid]
    labels = torch.zeros(student.shape[0], dtype=torch.long, device=student.device)
    inputs = BenchInputs(student, x.student_weight.detach(), labels, teacher)
    return gemm_only_step(inputs, "KD", SeparateTeacher(teacher, x.teacher_weight))


# ------------------------------------------------------------------------------------------------ the check


@dataclass(frozen=True)
class Outputs:
    loss: float
    entropy_sum: float
    n_valid: int
    grads: tuple[Tensor, Tensor]  # (dh, dW) in fp32


def outputs(call: Call, x: LossInputs, beta: float) -> Outputs:
    loss, entropy_sum, n_valid = call(x, beta)
    dh, dw = torch.autograd.grad(loss, (x.student_hidden, x.student_weight))
    return Outputs(float(loss.detach()), float(entropy_sum), int(n_valid), (dh.float(), dw.float()))


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference) if reference else abs(value)


def check(out: Outputs, reference: Outputs, dtype: torch.dtype) -> dict[str, Any]:
    """Relative errors against TRL's outputs, and whether they are within TOLERANCE."""
    dh, dw = grad_errors(out.grads, reference.grads)
    errors = {
        "loss": relative(out.loss, reference.loss),
        "entropy_sum": relative(out.entropy_sum, reference.entropy_sum),
        "dh": dh,
        "dW": dw,
    }
    values, grads = TOLERANCE[dtype]
    ok = (
        out.n_valid == reference.n_valid
        and max(errors["loss"], errors["entropy_sum"]) <= values
        and max(dh, dw) <= grads
    )
    return {"errors": errors, "n_valid": [out.n_valid, reference.n_valid], "tolerance": [values, grads], "ok": ok}


# ------------------------------------------------------------------------------------------------ the run


HEADER = (
    f"{'beta':>4} {'impl':<20} {'ms':>8} {'spread':>7} {'x TRL':>6} {'x GEMM':>6} {'peak MiB':>9} "
    f"{'x TRL':>6} {'wkspc MiB':>9} {'loss':>11} {'entropy sum':>12}"
)


@dataclass
class Run:
    reporter: Reporter
    device: torch.device
    inputs: LossInputs
    dtype: torch.dtype
    rows: list[dict[str, Any]]
    gemm_ms: float | None = None

    def emit(self, row: dict[str, Any]) -> None:
        """Keep ``row``, print it, append it to trl_loss.jsonl."""
        self.rows.append(row)
        self.reporter.line(row_line(row))
        with (self.reporter.out_dir / "trl_loss.jsonl").open("a") as lines:
            lines.write(json.dumps(row) + "\n")

    def measure_row(self, impl: str, beta: float | None, step: Callable[[], Step]) -> dict[str, Any]:
        """Time and memory of one row (``status`` "ok" or "error": then the run fails)."""
        label = f"beta={beta} {impl}"
        ok, timing = guarded(self.reporter, label, lambda: measure(step(), self.device))
        recover_device()
        row: dict[str, Any] = {"beta": beta, "impl": impl}
        if not ok:
            self.reporter.fail(f"{label}: {timing}")
            return row | {"status": "error", "message": timing}
        row |= dict(status="ok", ms=timing.ms, spread_ms=timing.spread_ms, peak_mib=timing.peak_mib)
        row |= dict(workspace_mib=timing.workspace_mib)
        if self.gemm_ms is not None:
            row["x_gemm_only"] = timing.ms / self.gemm_ms
        return row

    def beta_rows(self, beta: float, calls: dict[str, Call]) -> list[dict[str, Any]]:
        """Every implementation at ``beta``, TRL's first; each one's outputs checked against TRL's."""
        reference: Outputs | None = None
        rows = []
        for impl, call in calls.items():
            row, out = self.checked_row(impl, call, beta, reference)
            if impl == TRL:
                reference = out
            del out  # the others' gradients go before the next row
            recover_device()
            rows.append(row)
        trl = rows[0]
        for row in rows[1:]:
            if row["status"] == "ok" and trl["status"] == "ok":
                row["x_trl"] = row["ms"] / trl["ms"]
                if row["peak_mib"] is not None:
                    row["peak_x_trl"] = row["peak_mib"] / trl["peak_mib"]
        for row in rows:
            self.emit(row)
        return rows

    def checked_row(
        self, impl: str, call: Call, beta: float, reference: Outputs | None
    ) -> tuple[dict[str, Any], Outputs | None]:
        """One row measured, then its outputs once more, checked against TRL's (``reference``)."""
        row = self.measure_row(impl, beta, lambda: forward_backward(call, self.inputs, beta))
        if row["status"] != "ok":
            return row, None
        label = f"beta={beta} {impl} outputs"
        ok, out = guarded(self.reporter, label, lambda: outputs(call, self.inputs, beta))
        if not ok:
            self.reporter.fail(f"{label}: {out}")
            return row | {"status": "error", "message": out}, None
        row |= {"loss": out.loss, "entropy_sum": out.entropy_sum, "n_valid": out.n_valid}
        if reference is not None:
            row["check"] = check(out, reference, self.dtype)
            if not row["check"]["ok"]:
                self.reporter.fail(f"beta={beta} {impl} against TRL: {row['check']['errors']}")
        return row, out


def row_line(row: dict[str, Any]) -> str:
    beta = "" if row["beta"] is None else f"{row['beta']:g}"
    if row["status"] != "ok":
        return f"{beta:>4} {row['impl']:<20} {row['status'].upper()}: {row.get('message', '')}"
    return (
        f"{beta:>4} {row['impl']:<20} {row['ms']:>8.2f} {row['spread_ms']:>7.2f} {fmt(row.get('x_trl'), '6.3f'):>6} "
        f"{fmt(row.get('x_gemm_only'), '6.2f'):>6} {fmt(row['peak_mib'], '9.0f'):>9} "
        f"{fmt(row.get('peak_x_trl'), '6.3f'):>6} {fmt(row['workspace_mib'], '9.0f'):>9} "
        f"{fmt(row.get('loss'), '11.6g'):>11} {fmt(row.get('entropy_sum'), '12.7g'):>12}"
    )


def check_line(row: dict[str, Any]) -> str:
    errors = row["check"]["errors"]
    n_valid, reference = row["check"]["n_valid"]
    verdict = "ok" if row["check"]["ok"] else "FAIL"
    return (
        f"check beta={row['beta']:g} {row['impl']} against TRL: loss {errors['loss']:.1e}, entropy sum "
        f"{errors['entropy_sum']:.1e}, dh {errors['dh']:.1e}, dW {errors['dW']:.1e}, n_valid {n_valid} / {reference}"
        f" (tolerance {row['check']['tolerance'][0]:g} / {row['check']['tolerance'][1]:g}): {verdict}"
    )


def targets(rows: list[dict[str, Any]], judged: bool) -> list[dict[str, Any]]:
    """The issue's targets for the adapter's rows: time and peak memory over TRL's at the same β."""
    results = []
    for row in rows:
        if row["impl"] != ADAPTER or row["status"] != "ok" or "x_trl" not in row:
            continue
        time_target = KL_TIME_TARGET if row["beta"] in (0.0, 1.0) else JSD_TIME_TARGET
        for what, ratio, target in (
            ("time", row["x_trl"], time_target),
            ("peak memory", row.get("peak_x_trl"), MEMORY_TARGET),
        ):
            met = None if not judged or ratio is None else ratio <= target
            results.append({"beta": row["beta"], "what": what, "ratio": ratio, "target": target, "met": met})
    return results


def target_line(target: dict[str, Any]) -> str:
    verdict = {True: "PASS", False: "MISS", None: "not judged (CPU)"}[target["met"]]
    return (
        f"target beta={target['beta']:g} adapter {target['what']}: {fmt(target['ratio'], '.3f')}x TRL "
        f"<= {target['target']:g}x: {verdict}"
    )


def body(args: argparse.Namespace, trl_loss: TrlLoss) -> Callable[[Reporter, Runtime], None]:
    def run(reporter: Reporter, runtime: Runtime) -> None:
        shape = SMALL_SHAPE if args.small else GPU_SHAPE
        reporter.data["env"] |= {name: metadata.version(name) for name in ("trl", "transformers", "datasets")}
        x = make_inputs(shape, runtime.device, args.masked_fraction, args.logit_std, args.seed)
        n_valid = int(x.valid.sum())
        reporter.data["trl_loss"] = record = {"shape": vars(shape) | {"dtype": str(shape.dtype)}, "n_valid": n_valid}
        (reporter.out_dir / "trl_loss.jsonl").write_text("")
        reporter.line(
            f"V = {shape.vocab}, H_s = {shape.hidden}, H_t = {shape.teacher_hidden}, (B, K) = ({shape.batch}, "
            f"{shape.positions}): {n_valid} of {shape.batch * shape.positions} positions in the loss, {shape.dtype}"
        )
        reporter.line(HEADER)
        bench = Run(reporter, runtime.device, x, shape.dtype, record.setdefault("rows", []))
        gemm = bench.measure_row(GEMM_ONLY, None, lambda: gemm_only(x))
        bench.emit(gemm)
        bench.gemm_ms = gemm.get("ms")
        calls = {TRL: as_trainer_call(trl_loss), ADAPTER: as_trainer_call(chunked_divergence_loss), DIRECT: direct_call}
        for beta in args.betas:
            rows = bench.beta_rows(beta, calls)
            for row in rows:
                if "check" in row:
                    reporter.line(check_line(row))
            reporter.dump()
        record["targets"] = targets(bench.rows, judged=runtime.device.type == "cuda")
        for target in record["targets"]:
            reporter.line(target_line(target))

    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny fp32 shapes, for the CPU")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="TRL's beta, in [0, 1]")
    parser.add_argument(
        "--masked-fraction", type=float, default=0.0, help="completions cut short: this share of positions masked"
    )
    parser.add_argument("--logit-std", type=float, default=2.0, help="the logits' standard deviation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results directory (default $OUT, else ./trl_loss_out)")
    args = parser.parse_args(argv)
    if not all(0.0 <= beta <= 1.0 for beta in args.betas):
        parser.error(f"--betas must lie in [0, 1], got {args.betas}")
    if not 0.0 <= args.masked_fraction < 0.5:
        parser.error(f"--masked-fraction must lie in [0, 0.5), got {args.masked_fraction}")
    args.out = args.out or (os.environ.get("OUT") or "trl_loss_out")
    args.tp = False  # run_script's one-device path
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from trl.trainer.distillation_trainer import _chunked_divergence_loss
    except ImportError as error:
        raise SystemExit(f"TRL's loss does not import ({error}): pip install trl==1.16.0") from error
    return run_script(args, "trl_loss", body(args, _chunked_divergence_loss))


if __name__ == "__main__":
    sys.exit(main())
