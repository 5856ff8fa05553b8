"""Print the source of a kernel as it runs: the hand-written kernel, the ``@triton.jit`` helpers
it calls, and the functions generated for a variant (or a row step) that it is passed, each
generated section named by the file its module runs under (docs/architecture.md, "Printing a
kernel").
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from collections.abc import Iterator
from pathlib import Path
from types import FunctionType
from typing import Protocol

from ..divergences import VARIANT_KEYWORDS, get_divergence
from ..divergences.expr import Expr
from . import variant_terms
from .variant_terms import GeneratedFunction

__all__ = ["KERNELS", "RowStep", "kernel_source", "print_kernel"]

KERNELS = ("partition", "merge", "sums", "grads", "rows", "scale")
# The repository root: sections name files orda_tp/kernels/…, whatever the working directory.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class RowStep(Protocol):
    """A row step's formulas (``orda_tp.engine.row_formulas.RowProgram``)."""

    @property
    def inputs(self) -> tuple[str, ...]: ...

    @property
    def scalars(self) -> tuple[str, ...]: ...

    @property
    def exprs(self) -> tuple[Expr, ...]: ...


def kernel_source(
    kernel: str, kl_divergence: str | None = None, *, row_step: RowStep | None = None, **variant_parameters: object
) -> str:
    """The source of ``kernel`` (one of :data:`KERNELS`), with the generated functions of the
    variant ``kl_divergence`` (its parameters as the loss takes them: ``kl_alpha=``, …; needed by
    ``sums``, for ``sums`` and ``grads`` only) or of ``row_step`` (for ``rows``)."""
    unknown = [keyword for keyword in variant_parameters if keyword not in VARIANT_KEYWORDS]
    if unknown:
        raise TypeError(f"kernel_source() got an unexpected keyword argument {unknown[0]!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")
    if kl_divergence is not None and kernel not in ("sums", "grads"):
        raise ValueError(f"the {kernel} kernel does not depend on the variant; kl_divergence is for sums and grads")
    if kernel == "sums" and kl_divergence is None:
        raise ValueError("the sums kernel adds up a variant's column terms: pass kl_divergence")
    if row_step is not None and kernel != "rows":
        raise ValueError(f"row_step is for the rows kernel, not {kernel}")
    sections = [_section(_where(function), _text(function)) for function in _jit_closure(kernel)]
    for generated in _generated(kernel, kl_divergence, variant_parameters, row_step):
        sections.append(_section(f"generated: {generated.path}", generated.text))
    return "\n\n".join(sections)


def print_kernel(
    kernel: str, kl_divergence: str | None = None, *, row_step: RowStep | None = None, **variant_parameters: object
) -> None:
    """Print :func:`kernel_source` (same arguments)."""
    print(kernel_source(kernel, kl_divergence, row_step=row_step, **variant_parameters))


def _section(title: str, text: str) -> str:
    return f"# ---- {title} ----\n\n{text.rstrip()}\n"


def _kernel_function(kernel: str) -> object:
    """The ``@triton.jit`` kernel called ``kernel`` (imported here: Triton is optional)."""
    if importlib.util.find_spec("triton") is None:
        raise ImportError("printing a kernel needs triton: pip install 'orda_tp[gpu]'")
    from . import grads, partition, rows, scale, sums

    kernels = {
        "partition": partition.partition_kernel,
        "merge": partition.merge_kernel,
        "sums": sums.sums_kernel,
        "grads": grads.grads_kernel,
        "rows": rows.rows_kernel,
        "scale": scale.scale_kernel,
    }
    return kernels[kernel]


def _python_function(jitted: object) -> FunctionType | None:
    """The Python function of an orda_tp ``@triton.jit`` (or ``triton.constexpr_function``)
    function, None for anything else."""
    function = getattr(jitted, "fn", None)
    # Only orda_tp's own: tl builtins stay out, and generated functions (module orda_tp_generated_…) get sections.
    if isinstance(function, FunctionType) and function.__module__.startswith("orda_tp.kernels"):
        return function
    return None


def _jit_closure(kernel: str) -> Iterator[FunctionType]:
    """The kernel, then the orda_tp Triton functions it calls, directly or not, in the order in
    which they are first named."""
    kernel_function = _python_function(_kernel_function(kernel))
    assert kernel_function is not None
    pending, seen = [kernel_function], {kernel_function}
    while pending:
        function = pending.pop(0)
        yield function
        for called in _called(function):
            if called not in seen:
                seen.add(called)
                pending.append(called)


def _called(function: FunctionType) -> list[FunctionType]:
    """The orda_tp Triton functions that ``function``'s body names, in source order."""
    names = sorted(
        (node for node in ast.walk(ast.parse(_text(function))) if isinstance(node, ast.Name)),
        key=lambda node: (node.lineno, node.col_offset),
    )
    # Resolved in the defining module's globals, so a helper imported from another kernel file is followed.
    found = (_python_function(function.__globals__.get(node.id)) for node in names)
    return list(dict.fromkeys(called for called in found if called is not None))


def _text(function: FunctionType) -> str:
    return inspect.getsource(function)


def _where(function: FunctionType) -> str:
    """``orda_tp/kernels/grads.py: grads_kernel``."""
    path = Path(inspect.getfile(function)).resolve()
    shown = path.relative_to(PACKAGE_ROOT) if path.is_relative_to(PACKAGE_ROOT) else path
    return f"{shown}: {function.__name__}"


def _generated(
    kernel: str, kl_divergence: str | None, variant_parameters: dict[str, object], row_step: RowStep | None
) -> list[GeneratedFunction]:
    """The generated functions the kernel is passed for this variant or row step."""
    if row_step is not None:
        return [variant_terms.row_step(row_step.inputs, row_step.scalars, row_step.exprs)]
    if kl_divergence is None:
        return []
    divergence = get_divergence(kl_divergence)
    params = divergence.resolve(variant_parameters)
    if kernel == "sums":
        return [variant_terms.column_terms(divergence, params)]
    sides = ("student", "teacher") if divergence.cotrains_teacher else ("student",)
    return [variant_terms.kl_grad(divergence, params, side) for side in sides]
