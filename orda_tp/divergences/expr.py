"""A small expression language for the formulas of the KL variants and the student's terms:
:class:`Expr` trees over the block symbols (``LOGP``, ``LOGQ``, ``P``, ``Q``, ``IS_TARGET``) and per-row
constants (``row("name")``), evaluated column-wise on blocks or row-wise on (rows,) tensors. The torch
backend interprets them (``orda_tp.engine.torch_math``), the Triton backend compiles them
(``orda_tp.kernels``): a formula exists in one place, whatever runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Expr",
    "IS_TARGET",
    "LOGP",
    "LOGQ",
    "P",
    "Q",
    "absolute",
    "column_names",
    "equal",
    "exp",
    "expm1",
    "greater",
    "less",
    "log",
    "logaddexp",
    "logical_and",
    "logical_or",
    "row",
    "row_names",
    "where",
    "wrap",
]


# eq=False: nodes compare and hash by identity; a comparison node is built by equal(), never by ==.
@dataclass(frozen=True, eq=False)
class Expr:
    """A node: ``op`` applied to ``args``; ``value`` holds a constant or a symbol's name."""

    op: str
    args: tuple[Expr, ...] = ()
    value: float | str | None = None

    def __add__(self, other: Expr | float) -> Expr:
        return Expr("add", (self, wrap(other)))

    def __radd__(self, other: float) -> Expr:
        return Expr("add", (wrap(other), self))

    def __sub__(self, other: Expr | float) -> Expr:
        return Expr("sub", (self, wrap(other)))

    def __rsub__(self, other: float) -> Expr:
        return Expr("sub", (wrap(other), self))

    def __mul__(self, other: Expr | float) -> Expr:
        return Expr("mul", (self, wrap(other)))

    def __rmul__(self, other: float) -> Expr:
        return Expr("mul", (wrap(other), self))

    def __truediv__(self, other: Expr | float) -> Expr:
        return Expr("div", (self, wrap(other)))

    def __rtruediv__(self, other: float) -> Expr:
        return Expr("div", (wrap(other), self))

    def __neg__(self) -> Expr:
        return Expr("neg", (self,))


def wrap(value: Expr | float) -> Expr:
    if isinstance(value, Expr):
        return value
    return Expr("const", value=float(value))


def _symbol(name: str) -> Expr:
    return Expr("column", value=name)


LOGP = _symbol("logp")
LOGQ = _symbol("logq")
P = _symbol("p")
Q = _symbol("q")
IS_TARGET = _symbol("is_target")


def row(name: str) -> Expr:
    """A per-row constant produced by the variant's finalize step."""
    return Expr("row", value=name)


def exp(x: Expr) -> Expr:
    return Expr("exp", (x,))


def log(x: Expr) -> Expr:
    return Expr("log", (x,))


def expm1(x: Expr) -> Expr:
    return Expr("expm1", (x,))


def absolute(x: Expr) -> Expr:
    return Expr("abs", (x,))


def logaddexp(a: Expr, b: Expr) -> Expr:
    """``log(e^a + e^b)``, with ``logaddexp(−inf, −inf) = −inf``."""
    return Expr("logaddexp", (a, b))


def equal(a: Expr | float, b: Expr | float) -> Expr:
    return Expr("eq", (wrap(a), wrap(b)))


def greater(a: Expr | float, b: Expr | float) -> Expr:
    return Expr("gt", (wrap(a), wrap(b)))


def less(a: Expr | float, b: Expr | float) -> Expr:
    return Expr("lt", (wrap(a), wrap(b)))


def logical_and(a: Expr, b: Expr) -> Expr:
    return Expr("and", (a, b))


def logical_or(a: Expr, b: Expr) -> Expr:
    return Expr("or", (a, b))


def where(condition: Expr, a: Expr | float, b: Expr | float) -> Expr:
    return Expr("where", (condition, wrap(a), wrap(b)))


def row_names(exprs: Sequence[Expr]) -> list[str]:
    """The row constants the expressions read, in first-use order."""
    return _leaf_values(exprs, "row")


def column_names(exprs: Sequence[Expr]) -> list[str]:
    """The column symbols the expressions read (``logp``, …, or a raw side ``s``, ``t``), in
    first-use order."""
    return _leaf_values(exprs, "column")


def _leaf_values(exprs: Sequence[Expr], op: str) -> list[str]:
    """The values of the ``op`` leaves of the expressions, each once, in first-use order."""
    names: list[str] = []
    seen: set[int] = set()  # by id: a subtree shared by several formulas is visited once

    def visit(node: Expr) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if node.op == op and node.value not in names:
            names.append(str(node.value))
        for arg in node.args:
            visit(arg)

    for expr in exprs:
        visit(expr)
    return names
