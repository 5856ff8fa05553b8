"""``benchmarks/train_step_report.py`` on synthetic records: the table's computed values (the median
over passes, tokens/s from each run's sequence, the ratio to the reference, the loss share), the
notes below it (skips, graph breaks, recompilations, host syncs) and the warnings of the merge. The
plot is not tested (matplotlib is not a dependency)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import train_step_report as report


def header(git: str, seq: int) -> dict[str, Any]:
    environment = {"gpu": "NVIDIA H200", "device": "cuda", "torch": "2.9.0", "git": git}
    return {"environment": environment, "vocab": 128256, "seq": seq, "args": {"batch": 4}}


def ok(method: str, task: str, compiled: bool, step_ms: float, batch: int, **extra: Any) -> dict[str, Any]:
    """A first-pass record; its tokens_per_s deliberately wrong (the report computes its own)."""
    record = {"method": method, "task": task, "compile": compiled, "batch": batch, "status": "ok"}
    record |= {"step_ms": step_ms, "step_ms_min": step_ms - 1, "step_ms_max": step_ms + 1, "tokens_per_s": 1.0}
    record |= {"loss_ms": 1.0, "loss_share": 1.0 / step_ms, "loss_rel_err": 0.0, "grad_rel_err": {"w": 0.0}}
    return record | extra


def timing_pass(method: str, task: str, compiled: bool, index: int, step_ms: float) -> dict[str, Any]:
    record = {"method": method, "task": task, "compile": compiled, "pass": index, "status": "ok"}
    return record | {"step_ms": step_ms, "step_ms_min": step_ms - 1, "step_ms_max": step_ms + 1}


def graphs(count: int, breaks: dict[str, int]) -> dict[str, Any]:
    return {"graphs": count, "graph_breaks": breaks}


BREAK = "Dynamic shape operator\n  Explanation: Operator `aten.nonzero.default`'s output shape depends on data."


def eager_ce_run() -> list[dict[str, Any]]:
    """CE eager, seq 1024, batch 4: hf 20 then 22 ms (median 21), orda 30, 10, 12 ms (median 12)."""
    orda = ok(
        "orda", "CE", False, 30.0, 4, loss_ms=6.0, loss_share=0.2, peak_mib=1234.4, max_batch=16,
        max_batch_tokens_per_s=123456.7, loss_rel_err=2.5e-8, grad_rel_err={"a": 1e-7, "b": 3e-6, "c": 2e-6},
        loss_host_syncs={"loss.py:10": 2},
    )  # fmt: skip
    return [
        header("abc", 1024),
        ok("hf", "CE", False, 20.0, 4, loss_ms=2.0, loss_share=0.1, peak_mib=2000.0, loss_host_syncs={}),
        {"method": "liger", "task": "CE", "compile": False, "batch": 4, "status": "skipped", "reason": "no liger"},
        orda,
        timing_pass("orda", "CE", False, 1, 10.0),
        timing_pass("hf", "CE", False, 1, 22.0),
        timing_pass("orda", "CE", False, 2, 12.0),
    ]


def compiled_kd_run() -> list[dict[str, Any]]:
    """KD compiled, seq 2048, batch 2: logits_kd 50 ms, orda_topk 40 ms with a graph break and a
    recompilation (2 graphs by the first step, 3 by the end)."""
    reference = ok("logits_kd", "KD", True, 50.0, 2)
    reference |= {"compiled_by_first_step": graphs(2, {}), "compiled_by_timing_end": graphs(2, {})}
    topk = ok("orda_topk", "KD", True, 40.0, 2, loss_ms=14.0, loss_share=0.35)
    topk |= {"compiled_by_first_step": graphs(2, {BREAK: 1}), "compiled_by_timing_end": graphs(3, {BREAK: 2})}
    return [header("def", 2048), reference, topk]


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def table_cells(markdown: str) -> dict[tuple[str, str, str], dict[str, str]]:
    """The table's rows by (task, method label, compiled), each its cells by heading."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    headings = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(headings, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]
    return {(row["task"], row["method"], row["compiled"]): row for row in rows}


def run_report(tmp_path: Path, *files: Path) -> str:
    out = tmp_path / "table.md"
    assert report.main([*map(str, files), "--markdown", str(out)]) == 0
    return out.read_text()


def test_table_values_and_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    eager = write(tmp_path / "eager.jsonl", eager_ce_run())
    compiled = write(tmp_path / "compiled.jsonl", compiled_kd_run())
    markdown = run_report(tmp_path, eager, compiled)
    rows = table_cells(markdown)
    assert list(rows) == [
        ("CE", "Hugging Face loss", "eager"),
        ("CE", "orda_tp DistillationHead", "eager"),
        ("KD", "logits-level KD (TRL GKD, β = 0)", "compiled"),
        ("KD", "orda_tp top-k cache", "compiled"),
    ]
    hf, orda = rows["CE", "Hugging Face loss", "eager"], rows["CE", "orda_tp DistillationHead", "eager"]
    assert (hf["step ms"], hf["tokens/s"], hf["vs reference"]) == ("21.0 (20.0–22.0)", "195,048", "1.00×")
    assert (orda["step ms"], orda["tokens/s"], orda["vs reference"]) == ("12.0 (10.0–30.0)", "341,333", "1.75×")
    assert (orda["loss ms"], orda["loss share"], hf["loss share"]) == ("6.00", "20.0%", "10.0%")
    assert (orda["peak MiB"], orda["largest micro-batch"], orda["tokens/s at it"]) == ("1,234", "16", "123,457")
    assert (orda["loss rel. err"], orda["grad rel. err"]) == ("2.5e-08", "3.0e-06")
    assert (hf["largest micro-batch"], hf["tokens/s at it"]) == ("–", "–")
    topk = rows["KD", "orda_tp top-k cache", "compiled"]
    assert (topk["step ms"], topk["tokens/s"], topk["vs reference"]) == ("40.0", "102,400", "1.25×")
    assert topk["loss share"] == "35.0%"
    assert "- liger (eager): skipped: no liger" in markdown
    assert "- logits_kd (compiled): graph breaks: none; 2 graphs, no recompilation" in markdown
    topk_note = next(line for line in markdown.splitlines() if line.startswith("- orda_topk (compiled)"))
    assert "Dynamic shape operator ×2" in topk_note and "Explanation" not in topk_note, topk_note
    assert "recompiled: graphs 2 by the first step → 3" in topk_note, topk_note
    assert "- orda (eager): host syncs in the loss: loss.py:10 ×2" in markdown
    assert "host syncs" not in markdown.replace("- orda (eager): host syncs", "")
    assert "git: " in capsys.readouterr().err  # the two runs name different commits


def test_later_run_replaces_earlier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A later run's first-pass record of the same (method, compile) wins, with its own passes only."""
    first = write(tmp_path / "first.jsonl", eager_ce_run())
    again = [header("abc", 1024), ok("orda", "CE", False, 16.0, 4), timing_pass("orda", "CE", False, 1, 18.0)]
    second = write(tmp_path / "second.jsonl", again)
    rows = table_cells(run_report(tmp_path, first, second))
    orda = rows["CE", "orda_tp DistillationHead", "eager"]
    assert (orda["step ms"], orda["vs reference"]) == ("17.0 (16.0–18.0)", f"{21 / 17:.2f}×")
    err = capsys.readouterr().err
    assert "orda (eager)" in err and "replaced by" in err and str(second) in err, err
    assert "differ" not in err, err  # same environment and shapes
