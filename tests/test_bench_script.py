"""The benchmark script end to end on the CPU: ``benchmarks/bench.py --small --device cpu`` in a subprocess,
then its JSON rows and its markdown tables."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH = str(REPO_ROOT / "benchmarks" / "bench.py")
SMALL_SHAPES = ("BT64_H32_V203", "BT64_H32_V512")


def run_bench(out: Path) -> dict:
    """Run the small CPU benchmark into ``out``; assert it exits 0 and return its JSON document."""
    command = [sys.executable, BENCH, "--small", "--device", "cpu", "--out", str(out)]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, (
        f"{command} exited {completed.returncode}:\n{completed.stdout}\n{completed.stderr}"
    )
    return json.loads((out / "bench.json").read_text())


def test_small_cpu_bench_rows_and_tables(tmp_path: Path) -> None:
    rows = run_bench(tmp_path)["bench"]["rows"]
    main = {(r["shape"], r["case"], r["impl"]): r for r in rows if r["section"] == "main"}
    for shape in SMALL_SHAPES:
        for task in ("KD", "CE"):
            naive = main[(shape, task, "naive")]
            orda = main[(shape, task, "orda_tp torch")]
            for row in (naive, orda):
                assert row["status"] == "ok" and math.isfinite(row["ms"]) and row["ms"] > 0, row
            assert abs(orda["loss"] - naive["loss"]) <= 1e-4 * abs(naive["loss"]), (orda, naive)
            assert orda["sanity"] == "ok", orda
            # autograd through the naive loss and the script's hand-written fp32 reference agree
            for row in (naive, orda):
                assert row["grad_err"] <= 1e-5 and row["grad_sanity"] == "ok", row
    tables = (tmp_path / "bench_tables.md").read_text()
    for shape in SMALL_SHAPES:
        assert f"### {shape}" in tables, tables
