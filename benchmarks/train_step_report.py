"""The Markdown table and the PNG plot of ``benchmarks/train_step.py``'s records (train_step.jsonl).

Reads one or more record files, each one or more runs (a header line ``{"environment": ..., "vocab":
..., "seq": ..., "args": ...}`` followed by that run's records), and merges them by (method,
compile setting): one run may hold the CE methods eager, another the KD methods compiled. Where two
runs hold a first-pass record of the same (method, compile setting), the later one's (with its
timing passes) is kept and a warning goes to stderr; so does one where the headers name different
GPUs, torch versions, commits or shapes.

The Markdown table has a row per (task, method, compile setting) that ran: the step's time (the
median over passes of each pass's median, with the range of the pass medians when there are
several), tokens/s (``batch × seq`` over that time) and their ratio to the task's reference (``hf``
for CE, ``logits_kd`` for KD, ``trl_onpolicy`` on-policy) in the same compile setting, peak memory,
the head and loss alone (ms, share of the step as recorded), the largest micro-batch and the
tokens/s at it, and the first step's loss and gradient errors against the reference (the worst of
the checked parameters). Below it: the methods skipped or failed and why, each compiled record's
graph breaks and whether Dynamo compiled more graphs during the timed steps than by the first (a
recompilation), the host synchronizations of the loss, and with ``--kernels`` its costliest GPU
kernels.

The plot (``--plot``, matplotlib on the Agg backend; skipped with a message where matplotlib is not
importable) has tokens/s per method on the left and the largest micro-batch on the right, grouped by
task, eager and compiled side by side.

    python benchmarks/train_step_report.py OUT/train_step.jsonl                # the table to stdout
    python benchmarks/train_step_report.py OUT1/train_step.jsonl OUT2/train_step.jsonl \\
        --markdown table.md --plot docs/img/train_step.png                     # to files
    python benchmarks/train_step_report.py OUT/train_step.jsonl --kernels      # with the loss's kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import pyplot  # noqa: E402
from benchmarks.train_step import METHODS, REFERENCE  # noqa: E402

LABELS = {
    "hf": "Hugging Face loss",
    "liger": "Liger fused linear CE",
    "cce": "cut-cross-entropy",
    "orda": "orda_tp DistillationHead",
    "orda_ws512": "orda_tp, 512 MiB workspace",
    "logits_kd": "logits-level KD (TRL GKD, β = 0)",
    "liger_jsd": "Liger fused linear JSD (β = 0)",
    "orda_teacher_head": "orda_tp TeacherHead",
    "orda_topk": "orda_tp top-k cache",
    "trl_onpolicy": "TRL DistillationTrainer loss (JSD, β = 0.5)",
    "orda_onpolicy": "orda_tp TRL adapter (JSD, β = 0.5)",
}
TASKS = ("CE", "KD", "on-policy")
CHECKED_ENVIRONMENT = ("gpu", "device", "torch", "git")  # what every header must agree on
MISSING = "–"
COLUMNS = (
    ("task", False),  # (heading, right-aligned)
    ("method", False),
    ("compiled", False),
    ("step ms", True),
    ("tokens/s", True),
    ("vs reference", True),
    ("peak MiB", True),
    ("loss ms", True),
    ("loss share", True),
    ("largest micro-batch", True),
    ("tokens/s at it", True),
    ("loss rel. err", True),
    ("grad rel. err", True),
)

Key = tuple[str, bool]  # (method, compiled)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ reading


@dataclass
class Run:
    """One run of train_step.py: its header and the records that follow it, in order."""

    source: str  # the file, and the run's place in it when it holds several
    header: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Entry:
    """What the report shows of one (method, compile setting): its first-pass record, the timing passes
    of the same run (``"pass"`` ≥ 1) and that run."""

    record: dict[str, Any]
    passes: list[dict[str, Any]]
    run: Run

    @property
    def label(self) -> str:
        return f"{self.record['method']} ({'compiled' if self.record['compile'] else 'eager'})"


def read_runs(path: Path) -> list[Run]:
    """The runs of one records file; records before any header are an error."""
    runs: list[Run] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "environment" in item:
            runs.append(Run(f"{path}#{len(runs) + 1}", item))
        elif not runs:
            raise ValueError(f"{path}:{number}: a record before the first header line")
        else:
            runs[-1].records.append(item)
    if len(runs) == 1:
        runs[0].source = str(path)
    return runs


def run_entries(run: Run) -> dict[Key, Entry]:
    """The run's first-pass records by (method, compiled), each with that run's later passes."""
    entries: dict[Key, Entry] = {}
    for record in run.records:
        key = (record["method"], bool(record["compile"]))
        if record.get("pass", 0) == 0:
            entries[key] = Entry(record, [], run)
        elif key in entries:
            entries[key].passes.append(record)
        else:
            warn(f"{run.source}: pass {record['pass']} of {key[0]} compile={key[1]} has no first pass; ignored")
    return entries


def merge(runs: Iterable[Run]) -> dict[Key, Entry]:
    """Every run's entries, a later run's replacing an earlier one's (with a warning)."""
    merged: dict[Key, Entry] = {}
    for run in runs:
        for key, entry in run_entries(run).items():
            if key in merged:
                earlier = merged[key]
                warn(
                    f"{entry.label}: {earlier.run.source} ({earlier.record['status']}) replaced by "
                    f"{run.source} ({entry.record['status']})"
                )
            merged[key] = entry
    return merged


def environment_differences(runs: list[Run]) -> list[str]:
    """What the headers disagree on among the environment's GPU, device, torch and commit and the
    shapes (vocabulary, sequence): one line per differing field, naming each run's value."""
    fields = [("environment", name) for name in CHECKED_ENVIRONMENT] + [(None, "vocab"), (None, "seq")]
    differences = []
    for section, name in fields:
        values = [(run.header[section] if section else run.header).get(name) for run in runs]
        if len(set(map(str, values))) > 1:
            differences.append(f"{name}: " + ", ".join(f"{run.source}={v}" for run, v in zip(runs, values)))
    return differences


# ------------------------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class Row:
    """One line of the table: the values, unformatted (None where not measured)."""

    task: str
    method: str
    compiled: bool
    step_ms: float
    step_range: tuple[float, float] | None  # the pass medians' min and max, with several passes
    tokens_per_s: float
    vs_reference: float | None
    peak_mib: float | None
    loss_ms: float | None
    loss_share: float | None
    max_batch: int | None
    max_batch_tokens_per_s: float | None
    loss_rel_err: float | None
    grad_rel_err: float | None


def method_order(names: Iterable[str]) -> list[str]:
    """The methods in METHODS' order, any others (a newer or older script) after them as they came."""
    known = [m.name for m in METHODS]
    return known + [name for name in dict.fromkeys(names) if name not in known]


def step_time(entry: Entry) -> tuple[float, tuple[float, float] | None]:
    """The median over the passes that ran of each pass's median step, and the range of those medians
    where there are several."""
    medians = [entry.record["step_ms"]] + [p["step_ms"] for p in entry.passes if p.get("status") == "ok"]
    spread = (min(medians), max(medians)) if len(medians) > 1 else None
    return statistics.median(medians), spread


def tokens_per_s(entry: Entry, step_ms: float) -> float:
    batch = entry.record.get("batch", entry.run.header.get("args", {}).get("batch"))
    return batch * entry.run.header["seq"] / (step_ms / 1e3)


def base_row(entry: Entry) -> Row:
    """The entry's row, without its ratio to the reference."""
    r = entry.record
    step_ms, step_range = step_time(entry)
    grads = r.get("grad_rel_err")
    return Row(
        task=r["task"],
        method=r["method"],
        compiled=bool(r["compile"]),
        step_ms=step_ms,
        step_range=step_range,
        tokens_per_s=tokens_per_s(entry, step_ms),
        vs_reference=None,
        peak_mib=r.get("peak_mib"),
        loss_ms=r.get("loss_ms"),
        loss_share=r.get("loss_share"),
        max_batch=r.get("max_batch"),
        max_batch_tokens_per_s=r.get("max_batch_tokens_per_s"),
        loss_rel_err=r.get("loss_rel_err"),
        grad_rel_err=max(grads.values()) if grads else None,
    )


def make_rows(entries: dict[Key, Entry]) -> list[Row]:
    """The rows of the entries that ran, by task (CE, KD, on-policy), method (METHODS' order), eager first; each
    with its tokens/s relative to its task's reference in the same compile setting."""
    ok = {key: base_row(entry) for key, entry in entries.items() if entry.record["status"] == "ok"}
    order = {name: index for index, name in enumerate(method_order(name for name, _ in ok))}
    tasks = {task: index for index, task in enumerate(dict.fromkeys([*TASKS, *(r.task for r in ok.values())]))}
    rows = []
    for row in sorted(ok.values(), key=lambda r: (tasks[r.task], order[r.method], r.compiled)):
        reference = ok.get((REFERENCE.get(row.task, ""), row.compiled))
        ratio = None if reference is None else row.tokens_per_s / reference.tokens_per_s
        rows.append(replace(row, vs_reference=ratio))
    return rows


# ------------------------------------------------------------------------------------------------ the table


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def fmt_ms(value: float | None) -> str:
    """Milliseconds: 0.1 ms resolution from 10 ms, 0.01 below."""
    return fmt(value, ".1f" if value is not None and value >= 10 else ".2f")


def cells(row: Row) -> list[str]:
    step = fmt_ms(row.step_ms)
    if row.step_range is not None:
        step += f" ({fmt_ms(row.step_range[0])}–{fmt_ms(row.step_range[1])})"
    return [
        row.task,
        LABELS.get(row.method, row.method),
        "compiled" if row.compiled else "eager",
        step,
        fmt(row.tokens_per_s, ",.0f"),
        fmt(row.vs_reference, ".2f", "×"),
        fmt(row.peak_mib, ",.0f"),
        fmt_ms(row.loss_ms),
        fmt(None if row.loss_share is None else 100 * row.loss_share, ".1f", "%"),
        fmt(row.max_batch, "d"),
        fmt(row.max_batch_tokens_per_s, ",.0f"),
        fmt(row.loss_rel_err, ".1e"),
        fmt(row.grad_rel_err, ".1e"),
    ]


def markdown_table(rows: list[Row]) -> list[str]:
    lines = [
        "| " + " | ".join(heading for heading, _ in COLUMNS) + " |",
        "|" + "|".join("---:" if right else "---" for _, right in COLUMNS) + "|",
    ]
    return lines + ["| " + " | ".join(cells(row)) + " |" for row in rows]


def distinct(values: Iterable[Any]) -> str:
    """The distinct values, joined by " / " (a single one where the runs agree)."""
    return " / ".join(str(v) for v in dict.fromkeys(values) if v is not None) or "?"


def caption(entries: dict[Key, Entry]) -> str:
    """The runs' device, versions, commit and shapes, in one line."""
    headers = [entry.run.header for entry in entries.values()]
    env = [h["environment"] for h in headers]
    device = distinct(e.get("gpu") or e.get("device") for e in env)
    commit = distinct((e.get("git") or "")[:10] or None for e in env)
    shapes = (
        f"V = {distinct(h.get('vocab') for h in headers)}, seq {distinct(h.get('seq') for h in headers)}, "
        f"micro-batch {distinct(entry.record.get('batch') for entry in entries.values())}"
    )
    return f"{device}, torch {distinct(e.get('torch') for e in env)}, commit {commit}; {shapes}"


# ------------------------------------------------------------------------------------------------ notes


def short_reason(reason: str) -> str:
    """A graph break's reason, its first line (the records of older runs hold the whole message)."""
    return reason.strip().splitlines()[0] if reason.strip() else reason


def compile_note(entry: Entry) -> str | None:
    """A compiled record's graph breaks (reason ×count) and whether graphs were compiled during the
    timed steps (a recompilation); None for an eager record."""
    first, end = entry.record.get("compiled_by_first_step"), entry.record.get("compiled_by_timing_end")
    last = end if end is not None else first
    if not entry.record["compile"] or last is None:
        return None
    breaks: dict[str, int] = {}
    for reason, count in last["graph_breaks"].items():
        breaks[short_reason(reason)] = breaks.get(short_reason(reason), 0) + count
    text = "; ".join(f"{reason} ×{count}" for reason, count in breaks.items()) or "none"
    if first is None or end is None:
        graphs = f"{last['graphs']} graphs (growth not recorded)"
    elif end["graphs"] > first["graphs"]:
        graphs = f"recompiled: graphs {first['graphs']} by the first step → {end['graphs']} by the end of timing"
    else:
        graphs = f"{end['graphs']} graphs, no recompilation"
    return f"{entry.label}: graph breaks: {text}; {graphs}"


def status_notes(entry: Entry) -> list[str]:
    """The entry's skip or error, and any failed timing pass."""
    notes = []
    if entry.record["status"] != "ok":
        notes.append(f"{entry.label}: {entry.record['status']}: {entry.record.get('reason', '(no reason)')}")
    for p in entry.passes:
        if p.get("status") != "ok":
            notes.append(f"{entry.label}, pass {p['pass']}: {p.get('status')}: {p.get('reason', '(no reason)')}")
    return notes


def kernel_lines(entry: Entry) -> list[str]:
    """The loss's costliest kernels as a nested list: name, total ms, calls."""
    kernels = entry.record.get("loss_kernels") or []
    items = [f"  - `{name}`: {ms:.3f} ms, {calls} calls" for name, ms, calls in kernels]
    return [f"- {entry.label}: loss kernels:"] + items


def notes(entries: dict[Key, Entry], kernels: bool) -> list[str]:
    """The lines below the table (a Markdown list), in the table's order of methods."""
    order = {name: index for index, name in enumerate(method_order(name for name, _ in entries))}
    ordered = [entries[key] for key in sorted(entries, key=lambda key: (order[key[0]], key[1]))]
    lines = [f"- {note}" for entry in ordered for note in status_notes(entry)]
    lines += [f"- {note}" for entry in ordered if (note := compile_note(entry)) is not None]
    for entry in ordered:
        syncs = entry.record.get("loss_host_syncs")
        if syncs:
            lines.append(
                f"- {entry.label}: host syncs in the loss: " + ", ".join(f"{k} ×{v}" for k, v in syncs.items())
            )
    if kernels:
        lines += [line for entry in ordered if entry.record.get("loss_kernels") for line in kernel_lines(entry)]
    return lines


def report(entries: dict[Key, Entry], kernels: bool = False) -> str:
    """The Markdown: a caption, the table, the notes."""
    lines = [f"*{caption(entries)}*", ""] + markdown_table(make_rows(entries))
    below = notes(entries, kernels)
    return "\n".join(lines + ([""] + below if below else [])) + "\n"


# ------------------------------------------------------------------------------------------------ the plot


def plot_layout(rows: list[Row]) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """The y position of each method (in the table's order) and of each task's heading, a gap between tasks."""
    positions: dict[str, float] = {}
    headings: list[tuple[str, float]] = []
    y = 0.0
    for task in dict.fromkeys(r.task for r in rows):
        headings.append((task, y))
        y += 0.8
        for method in dict.fromkeys(r.method for r in rows if r.task == task):
            positions[method] = y
            y += 1.0
        y += 0.4
    return positions, headings


def bar_panel(axes: Any, rows: list[Row], value: Callable[[Row], float | None], note: Callable[[Row], str]) -> None:
    """Horizontal bars of ``value`` per method, eager above compiled, each annotated with ``note``."""
    positions, headings = plot_layout(rows)
    height = 0.38
    for compiled, color in ((False, "tab:blue"), (True, "tab:orange")):
        points = [(positions[r.method], value(r), note(r)) for r in rows if r.compiled == compiled]
        points = [(y, v, text) for y, v, text in points if v is not None]
        offset = height / 2 if compiled else -height / 2
        bars = axes.barh([y + offset for y, _, _ in points], [v for _, v, _ in points], height, color=color)
        bars.set_label("compiled" if compiled else "eager")
        for (y, v, text), _ in zip(points, bars):
            axes.text(v, y + offset, f" {text}", va="center", fontsize=7)
    axes.set_yticks(list(positions.values()), [LABELS.get(m, m) for m in positions], fontsize=8)
    for task, y in headings:
        axes.text(0.01, y, task, fontsize=9, fontweight="bold", va="center", transform=axes.get_yaxis_transform())
    axes.set_ylim(max(positions.values(), default=0) + 0.8, -0.6)
    axes.set_xlim(0, axes.get_xlim()[1] * 1.35)
    axes.tick_params(axis="x", labelsize=8)
    axes.grid(True, axis="x", alpha=0.3)


def tokens_note(row: Row) -> str:
    return f"{row.tokens_per_s / 1e3:.1f}k" + ("" if row.vs_reference is None else f" ({row.vs_reference:.2f}×)")


def batch_note(row: Row) -> str:
    tps = row.max_batch_tokens_per_s
    return f"{row.max_batch}" + ("" if tps is None else f" ({tps / 1e3:.1f}k tok/s)")


def plot(entries: dict[Key, Entry], path: Path) -> bool:
    """The two panels to ``path``; False where matplotlib is not importable."""
    plt = pyplot(lambda text: print(text, file=sys.stderr))
    if plt is None:
        return False
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    rows = make_rows(entries)
    figure, (speed, batch) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    bar_panel(speed, rows, lambda r: r.tokens_per_s, tokens_note)
    speed.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1e3:g}k" if x else "0"))
    speed.set_xlabel("tokens/s (× the task's reference in the same compile setting)", fontsize=8)
    speed.legend(fontsize=8, loc="upper right", ncols=2)
    if any(r.max_batch is not None for r in rows):
        bar_panel(batch, rows, lambda r: r.max_batch, batch_note)
        batch.xaxis.set_major_locator(MaxNLocator(integer=True))
        batch.set_xlabel("largest micro-batch that fits (tokens/s at it)", fontsize=8)
        batch.tick_params(axis="y", labelleft=False)
    else:
        batch.text(0.5, 0.5, "largest micro-batch not measured", ha="center", transform=batch.transAxes)
        batch.set_axis_off()
    figure.suptitle(f"Training step: {caption(entries)}", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path, help="train_step.jsonl files, later ones winning")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here instead of stdout")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG) here")
    parser.add_argument("--kernels", action="store_true", help="also list each record's costliest loss kernels")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [run for path in args.records for run in read_runs(path)]
    if not runs:
        print("no runs in the records", file=sys.stderr)
        return 1
    differences = environment_differences(runs)
    if differences:
        warn("the runs differ in\n  " + "\n  ".join(differences))
    entries = merge(runs)
    text = report(entries, args.kernels)
    if args.markdown is None:
        print(text, end="")
    else:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
        print(f"table: {args.markdown}", file=sys.stderr)
    if args.plot is not None and plot(entries, args.plot):
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
