"""Compile :mod:`orda_tp.divergences.expr` trees into the text of one ``@triton.jit`` function that
evaluates the trees' operations in their post-order, as the torch backend does: structurally equal
subtrees computed once; a variable for a result, a value used twice and the operands of a long
expression, named after what it computes (``logp_minus_logq``) or its operation (``diff_1``);
everything else inline, with only the parentheses Python needs; each row constant read once, at
the top.
"""

from __future__ import annotations

import keyword
import math
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..divergences.expr import Expr

__all__ = ["FunctionSpec", "function_source", "wrapped"]

# Python's precedence, loosest first: comparisons bind looser than | and &.
COMPARE, OR, AND, ADD, MUL, UNARY, ATOM = range(7)
#: op -> (operator, precedence, the word a variable's name uses for it)
BINARY = {
    "eq": ("==", COMPARE, "eq"),
    "gt": (">", COMPARE, "gt"),
    "lt": ("<", COMPARE, "lt"),
    "or": ("|", OR, "or"),
    "and": ("&", AND, "and"),
    "add": ("+", ADD, "plus"),
    "sub": ("-", ADD, "minus"),
    "mul": ("*", MUL, "times"),
    "div": ("/", MUL, "over"),
}
CALLS = {
    "exp": "exp",
    "log": "tl.log",
    "abs": "tl.abs",
    "where": "tl.where",
    "expm1": "expm1",
    "logaddexp": "logaddexp",
}
#: the name of a variable that no short description fits: ``<word>_<n>``
OP_WORDS = {"add": "sum", "sub": "diff", "mul": "prod", "div": "ratio", "neg": "neg", "where": "select"}
OP_WORDS.update({op: "cond" for op in ("eq", "gt", "lt", "and", "or")})
OP_WORDS.update({op: op for op in ("exp", "log", "abs", "expm1", "logaddexp")})
HELPERS = frozenset({"exp", "expm1", "logaddexp"})
RESERVED = frozenset({"tl", "triton", "float", "position", *HELPERS, *keyword.kwlist})
LEAVES = ("const", "column", "row")
INLINE_LIMIT = 88  # the inline operands of a longer expression get variables
NAME_LIMIT = 24  # longer descriptions fall back to the operation's word


@dataclass(frozen=True)
class FunctionSpec:
    """A function to generate: ``name(*parameters)`` computing ``outputs`` (variable name, tree),
    returned as a tuple (``returns_tuple``) or, for one output, as a value. ``read_row(name)``
    is the code that reads row constant ``name``."""

    name: str
    parameters: tuple[str, ...]
    doc: str
    outputs: tuple[tuple[str, Expr], ...]
    read_row: Callable[[str], str]
    returns_tuple: bool = True
    row_order: tuple[str, ...] = ()  # the order of the row constants' reads (else first use)


@dataclass(frozen=True)
class _Node:
    op: str
    value: float | str | None
    args: tuple[int, ...]


def function_source(spec: FunctionSpec) -> tuple[str, frozenset[str]]:
    """The function's text (decorator included), and the :mod:`.elementwise` helpers it calls."""
    writer = _Writer(spec)
    results = writer.write([expr for _, expr in spec.outputs])
    returned = [f"return {results[0]}"]
    if spec.returns_tuple:
        items = ", ".join(results) + ("," if len(results) == 1 else "")
        returned = [f"return ({items})"] if len(items) <= INLINE_LIMIT else ["return (", *wrapped(items, "    "), ")"]
    head = ["@triton.jit", f"def {spec.name}({', '.join(spec.parameters)}):"]
    docstring = wrapped(f'"""{spec.doc}"""', "    ")
    text = "\n".join([*head, *docstring, *("    " + line for line in [*writer.preamble(), *writer.lines, *returned])])
    return text + "\n", frozenset(writer.helpers)


def wrapped(text: str, indent: str) -> list[str]:
    """``text`` in lines of at most 100 characters, each indented by ``indent``."""
    return textwrap.wrap(text, width=100, initial_indent=indent, subsequent_indent=indent, break_long_words=False)


def _literal(value: float) -> str:
    if math.isfinite(value):
        # repr round-trips a float exactly, −0.0 included: the kernel gets the tree's constant bit for bit.
        return repr(float(value))
    return f'float("{value}")'  # inf, -inf, nan


class _Writer:
    """Interns a function's trees (structural keys) and writes its assignments."""

    def __init__(self, spec: FunctionSpec) -> None:
        self.spec = spec
        self.nodes: list[_Node] = []
        self.keys: dict[tuple[str, object, tuple[int, ...]], int] = {}
        self.seen: dict[int, int] = {}  # id(Expr) -> node, a shortcut for shared objects
        self.taken = set(RESERVED) | {parameter.split(":")[0] for parameter in spec.parameters}
        self.counters: Counter[str] = Counter()
        self.rows: dict[str, str] = {}  # row constant -> the line that reads it
        self.lines: list[str] = []
        self.helpers: set[str] = set()

    def intern(self, expr: Expr) -> int:
        # id() is a safe key here: the spec holds every tree alive while the writer runs, so no id is reused.
        known = self.seen.get(id(expr))
        if known is not None:
            return known
        args = tuple(self.intern(arg) for arg in expr.args)
        value = expr.value.hex() if isinstance(expr.value, float) else expr.value  # keeps −0.0 and nan apart
        key = (expr.op, value, args)
        index = self.keys.get(key)
        if index is None:
            index = self.keys[key] = len(self.nodes)
            self.nodes.append(_Node(expr.op, expr.value, args))
        self.seen[id(expr)] = index
        return index

    def write(self, exprs: Sequence[Expr]) -> list[str]:
        """Write the assignments of ``exprs``; returns the text of each result.

        The nodes are visited in post-order, the order in which the code must evaluate them. An
        operation written inline is evaluated on the line of the assignment that holds it, so
        before a line is written, the inline operations that come before it in that order and
        are on no line yet (``pending``) get variables."""
        results = [self.intern(expr) for expr in exprs]
        uses = Counter(arg for node in self.nodes for arg in node.args) + Counter(results)
        names = dict(reversed(list(zip(results, (name for name, _ in self.spec.outputs)))))  # the first name
        self.taken.update(f"row_{node.value}" for node in self.nodes if node.op == "row")
        refs: list[tuple[str, int]] = []  # each node's text and its precedence
        pending: list[int] = []  # operations written inline but in no line yet, in evaluation order
        for index, node in enumerate(self.nodes):
            text, level = self.expression(node, refs)
            refs.append((text, level))
            if node.op in LEAVES:
                continue
            operands = [arg for arg in dict.fromkeys(node.args) if arg in pending]
            if len(text) > INLINE_LIMIT and operands:  # too long to read: its operands get variables
                self.flush(pending, refs)
                refs[index] = self.expression(node, refs)
            pending[:] = [arg for arg in pending if arg not in operands]
            # A result, or a value used twice, gets a variable: computed once, on its own line.
            if index in names or uses[index] > 1:
                self.flush(pending, refs)
                name = self.unique(names[index]) if index in names else self.variable_name(node, refs)
                self.lines.append(f"{name} = {refs[index][0]}")
                refs[index] = (name, ATOM)
            else:
                pending.append(index)
        return [refs[index][0] for index in results]

    def flush(self, pending: list[int], refs: list[tuple[str, int]]) -> None:
        """Give every pending inline operation a variable, in evaluation order."""
        for index in pending:
            name = self.variable_name(self.nodes[index], refs)
            self.lines.append(f"{name} = {refs[index][0]}")
            refs[index] = (name, ATOM)
        pending.clear()

    def expression(self, node: _Node, refs: list[tuple[str, int]]) -> tuple[str, int]:
        """The text of ``node`` over its operands' texts, and its precedence."""
        if node.op == "const":
            assert isinstance(node.value, float)
            text = _literal(node.value)
            # A negative literal is a unary minus to Python, parenthesized wherever one would be.
            return text, UNARY if text.startswith("-") else ATOM
        if node.op == "column":
            return str(node.value), ATOM
        if node.op == "row":
            return self.row(str(node.value)), ATOM
        args = [refs[arg] for arg in node.args]
        if node.op in BINARY:
            symbol, level, _ = BINARY[node.op]
            (left, left_level), (right, right_level) = args
            # Python chains comparisons (a == b == c): a comparison on the left of another needs parentheses.
            if left_level < level or (level == COMPARE and left_level == COMPARE):
                left = f"({left})"
            # The operators are left-associative: a right operand of equal precedence needs them (a - (b - c)).
            if right_level <= level:
                right = f"({right})"
            return f"{left} {symbol} {right}", level
        if node.op == "neg":
            operand, level = args[0]
            # −(a * b), not −a * b: the text keeps the tree's order of operations, negation last.
            return ("-" + (f"({operand})" if level <= UNARY else operand)), UNARY
        if node.op in HELPERS:
            self.helpers.add(node.op)
        return f"{CALLS[node.op]}({', '.join(text for text, _ in args)})", ATOM

    def row(self, name: str) -> str:
        variable = f"row_{name}"
        self.rows.setdefault(name, f"{variable} = {self.spec.read_row(name)}")
        return variable

    def preamble(self) -> list[str]:
        """The reads of the row constants, in ``row_order``."""
        order = {name: rank for rank, name in enumerate(self.spec.row_order)}
        return [self.rows[name] for name in sorted(self.rows, key=lambda name: order.get(name, len(order)))]

    def variable_name(self, node: _Node, refs: list[tuple[str, int]]) -> str:
        """``logp_minus_logq`` where the operands have short names, else ``diff_<n>``."""
        words = [_word(refs[arg][0]) for arg in node.args]
        name = None
        if all(word is not None for word in words) and node.op != "where":
            if node.op in BINARY:
                name = f"{words[0]}_{BINARY[node.op][2]}_{words[1]}"
            else:
                name = "_".join([OP_WORDS[node.op], *(str(word) for word in words)])
        if name is None or len(name) > NAME_LIMIT or not name.isidentifier() or name in self.taken:
            word = OP_WORDS[node.op]
            self.counters[word] += 1
            name = f"{word}_{self.counters[word]}"
        return self.unique(name)

    def unique(self, name: str) -> str:
        candidate, suffix = name, 1
        while candidate in self.taken:
            suffix += 1
            candidate = f"{name}_{suffix}"
        self.taken.add(candidate)
        return candidate


WORDS = {f"{n}.0": str(n) for n in range(10)} | {'float("inf")': "inf", 'float("-inf")': "neg_inf"}


def _word(text: str) -> str | None:
    """A short word for an operand in a variable's name: its name (a row constant's without
    ``row_``), a small whole number or ±inf; None for anything else."""
    if text.isidentifier():
        return text.removeprefix("row_")
    return WORDS.get(text)
