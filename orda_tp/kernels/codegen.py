"""Compile the variants' :mod:`orda_tp.divergences.expr` trees into Triton source.

The generated code is a straight-line block of assignments over the kernel's column variables
(``logp``, ``logq``, ``p``, ``q``, ``is_target``: (BLOCK_R, BLOCK_C) tiles) and row constants
(``row_<name>``: (BLOCK_R, 1)). Shared subtrees become one variable. ``expm1`` uses an
exp/log-only form (Kahan's), since the Triton interpreter has no libdevice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..divergences.expr import Expr

__all__ = ["HELPERS", "compile_exprs"]

HELPERS = """
@triton.jit
def _expm1(x):
    u = tl.exp(x)
    um1 = u - 1.0
    accurate = um1 * x / tl.log(tl.where(u == 1.0, 2.0, u))
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, tl.where(u > 3.0e38, u, accurate)))


@triton.jit
def _logaddexp(a, b):
    m = tl.maximum(a, b)
    shift = tl.where(m == float("-inf"), 0.0, m)
    return shift + tl.log(tl.exp(a - shift) + tl.exp(b - shift))
"""

_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "eq": "==", "gt": ">", "lt": "<", "and": "&", "or": "|"}
_CALLS = {
    "exp": "tl.exp",
    "log": "tl.log",
    "expm1": "_expm1",
    "abs": "tl.abs",
    "logaddexp": "_logaddexp",
}


def _literal(value: float) -> str:
    if math.isfinite(value):
        return repr(float(value))
    return f'float("{value}")'  # inf, -inf, nan


def compile_exprs(exprs: Sequence[Expr], prefix: str) -> tuple[list[str], list[str]]:
    """``(lines, results)``: assignments computing each expression, and the variable holding it."""
    lines: list[str] = []
    names: dict[int, str] = {}

    def emit(node: Expr) -> str:
        key = id(node)
        if key in names:
            return names[key]
        if node.op == "const":
            assert isinstance(node.value, float)  # wrap() stores every constant as a float
            return _literal(node.value)
        if node.op == "column":
            name = str(node.value)
        elif node.op == "row":
            name = f"row_{node.value}"
        else:
            args = [emit(arg) for arg in node.args]
            if node.op in _BINARY:
                code = f"({args[0]} {_BINARY[node.op]} {args[1]})"
            elif node.op == "neg":
                code = f"(-{args[0]})"
            elif node.op == "where":
                code = f"tl.where({args[0]}, {args[1]}, {args[2]})"
            else:
                code = f"{_CALLS[node.op]}({', '.join(args)})"
            name = f"{prefix}{len(lines)}"
            lines.append(f"{name} = {code}")
        names[key] = name
        return name

    results = [emit(expr) for expr in exprs]
    return lines, results
