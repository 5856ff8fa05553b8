"""The ```python snippets of README.md and docs/*.md, read with their markers (for tests/test_doc_snippets.py).

Marker convention. The line right before a ```python fence (same blockquote / list indentation) may hold
one HTML comment, which the rendered page hides:

- no marker: a complete program. Pasted into a file with nothing else, ``python file.py`` runs it.
- ``<!-- torchrun: N -->``: a complete program for N ranks on CPU (gloo): ``torchrun --standalone
  --nproc-per-node N file.py`` runs it. The snippet itself says so (its text contains "torchrun").
- ``<!-- excerpt: PATH -->``: not a complete program, quoted from (or, for an API signature or generated
  code, declared in or written by) the repository file PATH, which must exist and be named in the
  paragraph right before the snippet. Excerpts are not run; an excerpt of a script in ``examples/`` or
  ``launch/`` is quoted verbatim (every non-blank line, indentation aside, is a line of the script).

Printed output. The full-line comments that directly follow a ``print(...)`` statement (no blank line
between) are what that print writes, ``# `` removed. When a snippet shows any, all of them together are
its whole stdout: in order for a plain program; for a torchrun program each printed line starts with the
rank, and the lines are compared grouped by that first word, in order within a rank (the ranks' lines
interleave). Integers and words must match exactly, decimals within 1e-5 relative or one unit of the
last digit shown (the rounding of a value on a digit boundary).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = ("README.md", *sorted(f"docs/{path.name}" for path in (REPO_ROOT / "docs").glob("*.md")))

FENCE = re.compile(r"^(?P<prefix>[ >]*)```(?P<lang>\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>[\w-]+)\s*:\s*(?P<value>.*?)\s*-->\s*$")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class Snippet:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    kind: str  # "python", "torchrun" or "excerpt"
    ranks: int  # torchrun: the number of ranks, else 0
    source: str  # excerpt: the file it comes from, else ""
    text_before: str  # the paragraph right before the snippet (without the marker)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    def expected_output(self) -> list[str] | None:
        """The lines that the output comments show, or None when the snippet shows none."""
        lines = self.code.splitlines()
        blocks: list[tuple[int, list[str]]] = []
        for node in ast.walk(ast.parse(self.code)):
            if not (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "print"
            ):
                continue
            block: list[str] = []
            for text in lines[node.end_lineno or node.lineno :]:
                stripped = text.strip()
                if not stripped.startswith("#"):
                    break
                block.append(stripped[2:] if stripped.startswith("# ") else stripped[1:])
            blocks.append((node.lineno, block))
        shown = [text for _, block in sorted(blocks) for text in block]
        return shown or None


def _strip_prefix(text: str, prefix: str) -> str | None:
    """``text`` without the fence's blockquote/indent prefix, or None when the line leaves the block."""
    if text.startswith(prefix):
        return text[len(prefix) :]
    if text.strip() == "" or text.rstrip() == prefix.rstrip():
        return ""
    return None


def read_snippets(doc: str) -> list[Snippet]:
    """Every ```python snippet of ``doc`` (relative to the repository root), with its marker.

    Raises ``ValueError`` for a malformed or unknown marker and for an unclosed fence."""
    lines = (REPO_ROOT / doc).read_text(encoding="utf-8").splitlines()
    snippets: list[Snippet] = []
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        prefix = fence.group("prefix")
        end = index + 1
        while end < len(lines):
            inner = _strip_prefix(lines[end], prefix)
            if inner is not None and inner.strip().startswith("```"):
                break
            end += 1
        else:
            raise ValueError(f"{doc}:{index + 1}: the fence is never closed")
        if fence.group("lang") == "python":
            body = [_strip_prefix(text, prefix) or "" for text in lines[index + 1 : end]]
            snippets.append(_snippet(doc, lines, index, prefix, "\n".join(body) + "\n"))
        index = end + 1
    return snippets


def _snippet(doc: str, lines: list[str], index: int, prefix: str, code: str) -> Snippet:
    where = f"{doc}:{index + 1}"
    kind, ranks, source = "python", 0, ""
    before = index - 1
    marker_text = _strip_prefix(lines[before], prefix) if before >= 0 else None
    if marker_text is not None and marker_text.strip().startswith("<!--"):
        marker = MARKER.match(marker_text)
        if marker is None or marker.group("kind") not in ("torchrun", "excerpt"):
            raise ValueError(f"{where}: unknown marker {marker_text.strip()!r} (torchrun: N or excerpt: PATH)")
        kind = marker.group("kind")
        if kind == "torchrun":
            if not marker.group("value").isdigit():
                raise ValueError(f"{where}: torchrun takes a number of ranks, got {marker.group('value')!r}")
            ranks = int(marker.group("value"))
        else:
            source = marker.group("value")
        before -= 1
    # The paragraph right before: skip blank lines, then take lines up to a blank line, fence or heading.
    while before >= 0 and (_strip_prefix(lines[before], prefix) or "").strip() == "":
        before -= 1
    paragraph: list[str] = []
    while before >= 0:
        text = (_strip_prefix(lines[before], prefix) or "").strip()
        if text == "" or text.startswith("```") or text.startswith("#"):
            break
        paragraph.insert(0, text)
        before -= 1
    return Snippet(doc, index + 1, code, kind, ranks, source, " ".join(paragraph))


def all_snippets() -> list[Snippet]:
    return [snippet for doc in DOC_FILES for snippet in read_snippets(doc)]


def _numbers_match(shown: str, printed: str) -> bool:
    if shown == printed:
        return True
    if not any(c in shown + printed for c in ".eE"):
        return False  # integers must be equal
    try:
        expected, actual = float(shown), float(printed)
    except ValueError:
        return False
    mantissa = shown.lower().split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(shown.lower().split("e")[1]) if "e" in shown.lower() else 0
    unit = 10.0 ** (exponent - decimals)
    return math.isclose(actual, expected, rel_tol=1e-5, abs_tol=unit * 1.0001)


def line_matches(shown: str, printed: str) -> bool:
    """``printed`` is the line ``shown``, up to the rounding of its decimals."""
    shown_parts, printed_parts = NUMBER.split(shown), NUMBER.split(printed)
    shown_numbers, printed_numbers = NUMBER.findall(shown), NUMBER.findall(printed)
    if shown_parts != printed_parts or len(shown_numbers) != len(printed_numbers):
        return False
    return all(_numbers_match(a, b) for a, b in zip(shown_numbers, printed_numbers))


def output_mismatch(snippet: Snippet, stdout: str) -> str | None:
    """None when ``stdout`` is what the snippet's output comments show, else a description."""
    expected = snippet.expected_output()
    assert expected is not None
    printed = stdout.rstrip("\n").splitlines()
    if snippet.kind == "torchrun":
        expected = sorted(expected, key=lambda text: text.split(" ", 1)[0])
        printed = sorted(printed, key=lambda text: text.split(" ", 1)[0])
    if len(expected) == len(printed) and all(line_matches(a, b) for a, b in zip(expected, printed)):
        return None
    return "shown:\n" + "\n".join(expected) + "\nprinted:\n" + "\n".join(printed)
