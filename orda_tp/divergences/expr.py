"""A small expression language for the column-wise formulas of the KL variants.

Each variant writes its per-column terms and gradients once, as :class:`Expr` trees over the
block symbols (``LOGP``, ``LOGQ``, ``P``, ``Q``, ``IS_TARGET``) and per-row constants
(``row("name")``). The torch backend evaluates the trees with torch ops (:func:`evaluate`); the
Triton backend compiles the same trees into kernel code (``orda_tp.kernels.variant_terms``). So a
formula exists in one place, whatever runs it.

Row formulas (the per-row steps of a chunk, :mod:`orda_tp.engine.row_formulas`) are trees over
row constants alone, evaluated on (rows,) tensors by :func:`evaluate_rows` or compiled into one
row kernel.

Shared subtrees (the same Python object used twice) are computed once by both evaluators.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Expr",
    "IS_TARGET",
    "LOGP",
    "LOGQ",
    "P",
    "Q",
    "absolute",
    "equal",
    "evaluate",
    "evaluate_rows",
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


_TORCH_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "exp": torch.exp,
    "log": torch.log,
    "expm1": torch.expm1,
    "abs": torch.abs,
    "neg": torch.neg,
}
_TORCH_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "eq": torch.eq,
    "gt": torch.gt,
    "lt": torch.lt,
    "and": torch.logical_and,
    "or": torch.logical_or,
    "logaddexp": torch.logaddexp,
}


def _run(
    node: Expr,
    memo: dict[int, Tensor],
    columns: Mapping[str, Tensor | None],
    rows: Mapping[str, Tensor],
    reference: Tensor,
    as_columns: bool,
) -> Tensor:
    key = id(node)
    if key in memo:
        return memo[key]
    if node.op == "const":
        # A 0-d CPU tensor acts as a scalar beside device tensors: no host-to-device copy.
        result = torch.tensor(node.value, dtype=reference.dtype)
    elif node.op == "column":
        value = columns[str(node.value)]
        assert value is not None, f"the block has no {node.value}"
        result = value
    elif node.op == "row":
        result = rows[str(node.value)]
        result = result[:, None] if as_columns else result
    else:
        args = [_run(arg, memo, columns, rows, reference, as_columns) for arg in node.args]
        if node.op == "where":
            result = torch.where(args[0], args[1], args[2])
        elif node.op in _TORCH_UNARY:
            result = _TORCH_UNARY[node.op](args[0])
        else:
            result = _TORCH_BINARY[node.op](args[0], args[1])
    memo[key] = result
    return result


def evaluate(exprs: Sequence[Expr], columns: Mapping[str, Tensor | None], rows: Mapping[str, Tensor]) -> list[Tensor]:
    """Evaluate ``exprs`` with torch on a block: ``columns`` maps the column symbols to
    (rows, cols) tensors, ``rows`` the row constants to (rows,) tensors. Intermediates live only
    as long as this call (a plain memo dict, no closure cycle)."""
    reference = columns["logp"]
    assert reference is not None
    memo: dict[int, Tensor] = {}
    results = [_run(e, memo, columns, rows, reference, True) for e in exprs]
    return [result.to(reference.device).expand_as(reference) for result in results]


def evaluate_rows(exprs: Sequence[Expr], rows: Mapping[str, Tensor], like: Tensor) -> Tensor:
    """Evaluate row formulas with torch: ``rows`` maps the row constants to (rows,) tensors (any
    dtype; booleans read as 0/1); returns the results stacked as (rows, len(exprs)) in ``like``'s
    dtype and device."""
    memo: dict[int, Tensor] = {}
    count = next(iter(rows.values())).shape[0]
    columns = []
    for expr in exprs:
        result = _run(expr, memo, {}, rows, like, False)
        # A constant result (a 0-d CPU tensor) is filled on the device: no host-to-device copy.
        columns.append(result.to(like).expand(count) if result.dim() else like.new_full((count,), result.item()))
    return torch.stack(columns, dim=1)


def row_names(exprs: Sequence[Expr]) -> list[str]:
    """The row constants the expressions read, in first-use order."""
    names: list[str] = []
    seen: set[int] = set()

    def visit(node: Expr) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if node.op == "row" and node.value not in names:
            names.append(str(node.value))
        for arg in node.args:
            visit(arg)

    for expr in exprs:
        visit(expr)
    return names
