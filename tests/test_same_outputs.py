"""``checks/same_outputs.py``, the check that a restructuring moves no number: it finds a change of
one formula's constant in another checkout, and names the outputs it moved."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_moved_number_is_found(tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(ROOT / "orda_tp", other / "orda_tp", ignore=shutil.ignore_patterns("__pycache__"))
    plan = other / "orda_tp" / "arguments" / "plan.py"
    text = plan.read_text()
    exact = "inv_vocab = 1.0 / self.vocab_size"
    assert exact in text
    plan.write_text(text.replace(exact, "inv_vocab = 1.0000001 / self.vocab_size"))  # label smoothing's 1/V
    result = subprocess.run(
        [sys.executable, str(ROOT / "checks" / "same_outputs.py"), "--other", str(other)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    differing = [line for line in result.stdout.splitlines() if line.startswith("DIFFERS")]
    assert result.returncode == 1, result.stdout + result.stderr
    assert differing and all(".skew_js_terms." in line for line in differing), result.stdout
    assert "DIFFERS loss.tied.skew_js_terms.grad.hidden: largest difference" in result.stdout, result.stdout
