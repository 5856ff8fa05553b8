"""The generated part of the kernels: what differs between variants, and between row steps, as
``@triton.jit`` functions compiled from the expression trees (:mod:`.expr_compiler`), each passed
to a kernel as a ``tl.constexpr`` argument and run from its text in memory (:mod:`.cache`):

- ``<variant>_column_terms(logp, logq, p, q, is_target)``: the column terms of round 2, a tuple:
  the variant's, then the student entropy's where it is reported (``<variant>_entropy_…``);
- ``<variant>_student_grad(logp, logq, p, q, is_target, rowc, ROW_CONSTANTS)``: ``∂D/∂u``, and
  ``<variant>_teacher_grad``: ``∂D/∂v``; a row constant read from ``rowc`` at its position in
  the names ``ROW_CONSTANTS``;
- ``record_column_sums(s, t)``: round 1's column terms over the raw logits, a tuple;
- ``row_step(inputs, scalars)``: one row step's formulas over its (R,) inputs and runtime floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..divergences import Divergence, DivergenceParams, formulas_of
from ..divergences.entropy import round_two_terms
from ..divergences.expr import Expr
from .cache import load_generated_module
from .expr_compiler import FunctionSpec, function_source, wrapped

__all__ = ["GeneratedFunction", "column_terms", "kl_grad", "row_step", "record_column_sums"]

COLUMNS = ("logp", "logq", "p", "q", "is_target")
# ROW_CONSTANTS is constexpr so that position() turns each name into a tuple index at compile time.
GRAD_PARAMETERS = (*COLUMNS, "rowc", "ROW_CONSTANTS: tl.constexpr")
STEM_LIMIT = 48  # the characters of a row step's inputs kept in its file name


@dataclass(frozen=True)
class GeneratedFunction:
    """A generated ``@triton.jit`` function (``function``, to pass as a kernel's constexpr
    argument), the text of its module and the filename it runs under (a pseudo-filename, or its
    file under ``ORDA_TP_KERNEL_CACHE``)."""

    function: object
    name: str
    outputs: int
    text: str
    path: Path


def _variant(divergence: Divergence, params: DivergenceParams) -> str:
    """``kl_divergence='…'`` and the keywords the variant reads, as a call would give them."""
    keywords = [f"{keyword}={params[keyword]!r}" for keyword in divergence.keywords]
    return ", ".join([f"kl_divergence={divergence.name!r}", *keywords])


def _no_rows(name: str) -> str:
    raise ValueError(f"column terms read no row constants, but one reads {name!r}")


def _row_constant(name: str) -> str:
    return f'rowc[position(ROW_CONSTANTS, "{name}")]'


@cache
def column_terms(
    divergence: Divergence | None, params: DivergenceParams, student_entropy: bool = False
) -> GeneratedFunction:
    """``<variant>_column_terms``: the terms whose column sums round 2 collects, the trees of a
    plan's ``round_two_terms``: the variant's (None: a call without a KL term), then the student
    entropy's where it is reported."""
    variant = () if divergence is None else formulas_of(divergence, params).column_terms
    terms = round_two_terms(variant, student_entropy)
    names = ([] if divergence is None else [divergence.name]) + (["entropy"] if student_entropy else [])
    described = ([] if divergence is None else [_variant(divergence, params)]) + (
        ["the student's entropy −p·log p"] if student_entropy else []
    )
    spec = FunctionSpec(
        name=f"{'_'.join(names)}_column_terms",
        parameters=COLUMNS,
        doc=f"The column terms of {', then '.join(described)}: term k is added into the row's sum k.",
        outputs=tuple((f"term{k}", term) for k, term in enumerate(terms)),
        read_row=_no_rows,
    )
    return _load(spec, f"sums_terms_{'_'.join(names)}")


@cache
def record_column_sums(exprs: tuple[Expr, ...]) -> GeneratedFunction:
    """``record_column_sums``: round 1's column terms over the raw logits ``s`` and ``t`` (the
    plan's ``column_sums``: the student terms', and ``UNSUPPORTED`` where the plan counts it;
    built once per set of trees, so the trees' identity is the key)."""
    spec = FunctionSpec(
        name="record_column_sums",
        parameters=("s", "t"),
        doc="Round 1's column terms over the raw logits s and t: term k is added into the row's sum k.",
        outputs=tuple((f"term{k}", expr) for k, expr in enumerate(exprs)),
        read_row=_no_rows,
    )
    return _load(spec, "partition_sums")


_GRAD_SIDES = {"student": ("u", "s/T_s", "student_grad_expr"), "teacher": ("v", "t/T_t", "teacher_grad_expr")}


@cache
def kl_grad(divergence: Divergence, params: DivergenceParams, side: str) -> GeneratedFunction:
    """``<variant>_<side>_grad``: ``∂D/∂u`` of a column for the student's side, ``∂D/∂v`` for the
    teacher's (co-training variants)."""
    symbol, meaning, method = _GRAD_SIDES[side]
    spec = FunctionSpec(
        name=f"{divergence.name}_{side}_grad",
        parameters=GRAD_PARAMETERS,
        doc=f"∂D/∂{symbol} ({symbol} = {meaning}) of a column for {_variant(divergence, params)}.",
        outputs=(("grad", getattr(divergence, method)(params)),),
        read_row=_row_constant,
        returns_tuple=False,
    )
    return _load(spec, f"grads_{side}_{divergence.name}")


@cache
def row_step(inputs: tuple[str, ...], scalars: tuple[str, ...], exprs: tuple[Expr, ...]) -> GeneratedFunction:
    """``row_step``: the formulas ``exprs`` of one row step, ``out<j>`` computing ``exprs[j]``
    (row programs are built once each, so the trees' identity is the key)."""
    positions = {name: f"inputs[{i}]" for i, name in enumerate(inputs)}
    positions.update({name: f"scalars[{j}]" for j, name in enumerate(scalars)})
    spec = FunctionSpec(
        name="row_step",
        parameters=("inputs", "scalars"),
        doc=f"A row step: reads the (rows,) inputs {_listed(inputs)} and the floats {_listed(scalars)}.",
        outputs=tuple((f"out{j}", expr) for j, expr in enumerate(exprs)),
        read_row=positions.__getitem__,
        row_order=(*inputs, *scalars),
    )
    # The stem is only a readable label: the hash that load_generated_module adds tells modules apart.
    stem = "rows"
    for name in inputs:
        if len(stem) + 1 + len(name) > STEM_LIMIT:
            break
        stem += f"_{name}"
    return _load(spec, stem)


def _listed(names: Sequence[str]) -> str:
    return "(" + ", ".join(names) + ")"


def _load(spec: FunctionSpec, stem: str) -> GeneratedFunction:
    """Write the function's module to the kernel cache and run it from the verified text."""
    function, helpers = function_source(spec)
    local = ["from orda_tp.kernels.block_io import position"] if "position(" in function else []
    if helpers:
        local.append(f"from orda_tp.kernels.elementwise import {', '.join(sorted(helpers))}")
    imports = ["import triton", "import triton.language as tl", *([""] + local if local else [])]
    header = wrapped(f'"""{spec.doc}', "") + [
        "",
        "Generated by orda_tp.kernels.variant_terms from the expression trees; do not edit (the kernel",
        'cache rewrites a file that differs from what orda_tp generates)."""',
    ]
    text = "\n".join([*header, "", *imports, "", "", function])
    module = load_generated_module(text, stem)
    assert module.__file__ is not None
    return GeneratedFunction(getattr(module, spec.name), spec.name, len(spec.outputs), text, Path(module.__file__))
