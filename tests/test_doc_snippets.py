"""Every ```python snippet of README.md and docs/*.md runs as it stands, or is marked as an excerpt of a
file that exists (marker convention: tests/support/doc_snippets.py). Complete snippets run in a subprocess
(``python``, or torchrun on gloo for ``<!-- torchrun: N -->``), and their output comments must be what
they print."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from .support.doc_snippets import REPO_ROOT, Snippet, all_snippets, line_matches, output_mismatch, read_snippets
from .test_examples import TORCHRUN
from .test_launch import run

SNIPPETS = all_snippets()
# The torchrun ones (the longest) first, so that pytest -n 2 does not end on one of them alone.
RUNNABLE = sorted((snippet for snippet in SNIPPETS if snippet.kind != "excerpt"), key=lambda s: s.kind != "torchrun")
EXCERPTS = [snippet for snippet in SNIPPETS if snippet.kind == "excerpt"]


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[snippet.id for snippet in RUNNABLE])
def test_snippet_runs_and_prints_what_it_shows(
    snippet: Snippet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / f"{Path(snippet.doc).stem}_line{snippet.line}.py"
    script.write_text(snippet.code, encoding="utf-8")
    # The reader's shell: not the interpreter switch that tests/conftest.py sets for this process. One
    # thread per process, as torchrun gives its workers: the results do not depend on the machine's
    # core count, and two snippets at once (pytest -n 2) do not oversubscribe the cores.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if snippet.kind == "torchrun":
        assert "torchrun" in snippet.code, f"{snippet.id}: a torchrun snippet says how to run it"
        # --tee 1: each rank's stdout goes through its own file and comes back line by line, prefixed
        # "[default<rank>]:", so that the ranks' lines never interleave mid-line (PYTHONUNBUFFERED=1).
        command = [sys.executable, *TORCHRUN, "--nproc-per-node", str(snippet.ranks), "--tee", "1", str(script)]
        stdout = re.sub(r"^\[default\d+\]:", "", run(command), flags=re.MULTILINE)
    else:
        stdout = run([sys.executable, str(script)])
    if snippet.expected_output() is not None:
        mismatch = output_mismatch(snippet, stdout)
        assert mismatch is None, f"{snippet.id}: the output comments are not what it prints\n{mismatch}"


@pytest.mark.parametrize("snippet", EXCERPTS, ids=[snippet.id for snippet in EXCERPTS])
def test_excerpt_names_an_existing_file(snippet: Snippet) -> None:
    assert (REPO_ROOT / snippet.source).is_file(), f"{snippet.id}: excerpt of {snippet.source}, which does not exist"
    assert snippet.source in snippet.text_before, (
        f"{snippet.id}: the paragraph before the excerpt must name {snippet.source}: {snippet.text_before!r}"
    )
    if snippet.source.startswith(("examples/", "launch/")):  # quoted code: every line is the script's
        script_lines = {text.strip() for text in (REPO_ROOT / snippet.source).read_text(encoding="utf-8").splitlines()}
        changed = [text for text in snippet.code.splitlines() if text.strip() and text.strip() not in script_lines]
        assert not changed, f"{snippet.id}: lines not in {snippet.source}: {changed}"


def test_snippets_are_found() -> None:
    assert len(RUNNABLE) >= 20 and len(EXCERPTS) >= 10, (len(RUNNABLE), len(EXCERPTS))
    assert {snippet.doc for snippet in RUNNABLE} >= {"README.md", "docs/guide.md", "docs/integrations.md"}


def test_reader_markers_and_output_comments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from .support import doc_snippets

    doc = tmp_path / "doc.md"
    doc.write_text(
        "From `examples/missing.py`:\n\n<!-- excerpt: examples/missing.py -->\n```python\nx = 1\n```\n\n"
        "> <!-- torchrun: 2 -->\n> ```python\n> print(0, 1.25)\n> # 0 1.25\n> ```\n\n"
        "<!-- excerpts: x -->\n```python\npass\n```\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(doc_snippets, "REPO_ROOT", tmp_path)
    with pytest.raises(ValueError, match="unknown marker"):
        read_snippets("doc.md")
    doc.write_text(doc.read_text().replace("<!-- excerpts: x -->\n", ""), encoding="utf-8")
    excerpt, distributed, plain = read_snippets("doc.md")
    assert (excerpt.kind, excerpt.source) == ("excerpt", "examples/missing.py")
    assert "examples/missing.py" in excerpt.text_before and not (REPO_ROOT / excerpt.source).exists()
    with pytest.raises(AssertionError, match="does not exist"):
        test_excerpt_names_an_existing_file(excerpt)
    assert (distributed.kind, distributed.ranks, distributed.code) == ("torchrun", 2, "print(0, 1.25)\n# 0 1.25\n")
    assert distributed.expected_output() == ["0 1.25"]
    assert output_mismatch(distributed, "0 1.2500001\n") is None
    assert output_mismatch(distributed, "0 1.27\n") is not None  # one unit of the last digit shown: rounding
    assert (plain.kind, plain.expected_output()) == ("python", None)
    assert line_matches("loss 21.974 (501, 32)", "loss 21.9741 (501, 32)")
    assert not line_matches("loss 21.974 (501, 32)", "loss 21.974 (500, 32)")
