"""The kernels a person can read: ``orda_tp.kernels.print_kernel`` (and ``python -m
orda_tp.kernels``) print real source, and the generated functions (``orda_tp.kernels.expr_compiler``)
compute what the variants' expression trees say, each shared subtree once, with readable names.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from orda_tp import KL_VARIANTS
from orda_tp.divergences import get_divergence
from orda_tp.divergences.expr import (
    IS_TARGET,
    LOGP,
    LOGQ,
    Expr,
    P,
    Q,
    absolute,
    equal,
    exp,
    expm1,
    greater,
    less,
    log,
    logaddexp,
    logical_and,
    logical_or,
    row,
    where,
)
from orda_tp.engine.torch_math import evaluate
from orda_tp.kernels import cache, kernel_source, print_kernel, variant_terms
from orda_tp.kernels.__main__ import main
from orda_tp.kernels.expr_compiler import FunctionSpec, function_source
from orda_tp.kernels.source import KERNELS

from .support.cases import VARIANT_KWARGS

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Generated files go to a fresh kernel cache directory under ``tmp_path`` (none reused from an
    earlier test), so that the printed sections can be compared with the files."""
    path = tmp_path / "kernels"
    monkeypatch.setenv(cache.CACHE_ENV, str(path))
    monkeypatch.setattr(cache, "_MODULES", {})
    for build in (variant_terms.column_terms, variant_terms.kl_grad):
        build.cache_clear()
    return path


def variant_source(kernel: str, variant: str) -> str:
    keywords = VARIANT_KWARGS[variant]
    return kernel_source(
        kernel,
        variant,
        kl_alpha=keywords.get("kl_alpha"),
        kl_beta=keywords.get("kl_beta"),
        entropy_gate=keywords.get("entropy_gate"),
    )


def function_names(text: str) -> list[str]:
    return re.findall(r"^def (\w+)\(", text, flags=re.MULTILINE)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_prints_as_python_that_compiles(kernel: str) -> None:
    text = variant_source(kernel, "reverse") if kernel == "sums" else kernel_source(kernel)
    compile(text, f"<{kernel}>", "exec")
    names = function_names(text)
    kernel_function = "merge_kernel" if kernel == "merge" else f"{kernel}_kernel"
    assert names[0] == kernel_function
    assert text.startswith(f"# ---- orda_tp/kernels/{'partition' if kernel == 'merge' else kernel}.py: ")
    assert "@triton.jit" in text


@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_the_sums_and_grads_kernels_print_the_variants_generated_functions(variant: str, private_cache: Path) -> None:
    sums, grads = variant_source("sums", variant), variant_source("grads", variant)
    for text in (sums, grads):
        compile(text, variant, "exec")
    assert f"def {variant}_column_terms(logp, logq, p, q, is_target):" in sums
    assert "def sums_kernel(" in sums and "def load_tile(" in sums and "def normalized(" in sums
    assert f"def {variant}_student_grad(" in grads and "def grads_kernel(" in grads
    assert (f"def {variant}_teacher_grad(" in grads) == get_divergence(variant).cotrains_teacher
    generated = re.findall(r"^# ---- generated: (.*) ----$", sums + grads, flags=re.MULTILINE)
    assert [Path(path).parent for path in generated] == [private_cache] * len(generated)
    assert [Path(path).name.rsplit("_", 1)[0] for path in generated][:2] == [
        f"sums_terms_{variant}",
        f"grads_student_{variant}",
    ]
    for path in generated:
        assert Path(path).read_text() in sums + grads  # the file, printed whole


def test_the_printed_source_differs_between_variants_and_their_parameters() -> None:
    reverse, forward = variant_source("grads", "reverse"), variant_source("grads", "forward")
    assert reverse != forward
    assert reverse.split("# ---- generated")[0] == forward.split("# ---- generated")[0]  # one hand-written kernel
    assert "grad = p - q" in forward
    assert kernel_source("sums", "alpha_divergence", kl_alpha=0.3) != kernel_source("sums", "alpha_divergence")


def test_print_kernel_and_the_command_line_print_the_same_text(capsys: pytest.CaptureFixture[str]) -> None:
    print_kernel("grads", kl_divergence="skew_js", kl_beta=0.4)
    printed = capsys.readouterr().out
    assert main(["grads", "--kl-divergence", "skew_js", "--kl-beta", "0.4"]) == 0
    assert capsys.readouterr().out == printed == kernel_source("grads", "skew_js", kl_beta=0.4) + "\n"
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == str(cache.kernel_cache_dir())
    assert any(line.strip().startswith("grads_student_skew_js_") for line in listing[1:])


def test_printing_writes_no_file_without_a_kernel_cache_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default path: the generated functions print under their pseudo-filenames, and nothing
    is written, under the home or anywhere else in ``tmp_path``."""
    monkeypatch.delenv(cache.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    assert main(["grads", "--kl-divergence", "mutual"]) == 0
    text = capsys.readouterr().out
    generated = re.findall(r"^# ---- generated: (.*) ----$", text, flags=re.MULTILINE)
    assert [re.sub(r"_[0-9a-f]{12}\.py>$", "", name) for name in generated] == [
        "<orda_tp generated grads_student_mutual",
        "<orda_tp generated grads_teacher_mutual",
    ]
    assert main(["cache"]) == 0
    assert capsys.readouterr().out == (
        "ORDA_TP_KERNEL_CACHE is not set: generated kernel modules run from memory and no file is written\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_wrong_requests_say_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernel_source("softmax")
    with pytest.raises(ValueError, match="pass kl_divergence"):
        kernel_source("sums")
    with pytest.raises(ValueError, match="does not depend on the variant"):
        kernel_source("partition", "reverse")
    with pytest.raises(ValueError, match="kl_divergence must be one of"):
        kernel_source("grads", "reversed")
    with pytest.raises(ValueError, match="kl_alpha must lie in"):
        kernel_source("sums", "alpha_divergence", kl_alpha=2.0)
    with pytest.raises(SystemExit):
        main(["sums"])
    assert "pass kl_divergence" in capsys.readouterr().err


@dataclass(frozen=True)
class Step:
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    exprs: tuple[Expr, ...]


def test_the_rows_kernel_prints_a_row_steps_formulas() -> None:
    value = row("value")
    step = Step(("value", "owned"), ("t_s",), (where(less(value, 0.0), 0.0, value) * row("t_s"), row("owned")))
    text = kernel_source("rows", row_step=step)
    compile(text, "rows", "exec")
    assert function_names(text)[0] == "rows_kernel" and "def row_step(inputs, scalars):" in text
    assert re.search(r"^# ---- generated: .*/rows_value_owned_[0-9a-f]{12}\.py ----$", text, flags=re.MULTILINE)
    assert "row_value = inputs[0]" in text and "row_t_s = scalars[0]" in text
    with pytest.raises(ValueError, match="row_step is for the rows kernel"):
        kernel_source("grads", row_step=step)


# The generated code, run with torch standing in for Triton: the operations the trees say, in
# their order, so the results equal the torch interpreter's (torch_math.evaluate) bit for bit.
TORCH_TL = types.SimpleNamespace(exp=torch.exp, log=torch.log, abs=torch.abs, where=torch.where, constexpr=object)
NAMESPACE = {
    "triton": types.SimpleNamespace(jit=lambda function: function),
    "tl": TORCH_TL,
    "exp": torch.exp,
    "expm1": torch.expm1,
    "logaddexp": torch.logaddexp,
    "position": lambda names, name: names.index(name),
}
ROWS = ("a", "b")


def generated(exprs: list[Expr]) -> tuple[str, Callable[..., object]]:
    spec = FunctionSpec(
        name="terms",
        parameters=("logp", "logq", "p", "q", "is_target", "rowc", "ROW_CONSTANTS"),
        doc="Test terms.",
        outputs=tuple((f"term{k}", expr) for k, expr in enumerate(exprs)),
        read_row=lambda name: f'rowc[position(ROW_CONSTANTS, "{name}")]',
    )
    text, _ = function_source(spec)
    namespace = dict(NAMESPACE)
    exec(compile(text, "<generated>", "exec"), namespace)
    return text, namespace["terms"]


def tricky_trees() -> list[Expr]:
    """Trees whose infix form needs Python's precedence right."""
    a, b = row("a"), row("b")
    minus_logp = -LOGP
    return [
        LOGP - (LOGQ - P),
        (LOGP - LOGQ) - P,
        LOGP / (LOGQ * P),
        LOGP / LOGQ * P,
        -(LOGP + LOGQ),
        -minus_logp * -2.5,
        LOGP - -1.0 * Q,
        where(logical_and(equal(P, 0.0), greater(Q, a)), 0.0, P),
        where(equal(less(P, Q), equal(Q, P)), 1.0, 2.0),
        where(logical_or(IS_TARGET, less(absolute(LOGP), b)), exp(LOGP) * 3.0, log(Q)),
        expm1(0.3 * (LOGP - LOGQ)) - 0.3 * expm1(LOGP - LOGQ),
        logaddexp(-0.5 + LOGQ, -0.9 + LOGP) + a * b,
        where(equal(P, float("inf")), float("-inf"), float("nan")) + 0.0 * P,
    ]


def block(seed: int) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, 7, generator=generator, dtype=torch.float64) * 3
    logits[:, 0, :3] = float("-inf")
    logp, logq = logits.log_softmax(dim=-1)
    is_target = torch.zeros(5, 7, dtype=torch.bool)
    is_target[torch.arange(5), torch.arange(5)] = True
    columns: dict[str, torch.Tensor | None] = {
        "logp": logp,
        "logq": logq,
        "p": logp.exp(),
        "q": logq.exp(),
        "is_target": is_target,
    }
    rows = {name: torch.rand(5, generator=generator, dtype=torch.float64) for name in ROWS}
    return columns, rows


def variant_trees(name: str) -> list[Expr]:
    """The variant's column terms and gradients."""
    divergence = get_divergence(name)
    params = divergence.resolve(VARIANT_KWARGS[name])
    exprs = [*divergence.column_terms(params), divergence.student_grad_expr(params)]
    if divergence.cotrains_teacher:
        exprs.append(divergence.teacher_grad_expr(params))
    return exprs


@pytest.mark.parametrize("case", ["tricky", *KL_VARIANTS])
def test_generated_code_computes_the_trees_bit_for_bit(case: str) -> None:
    exprs = tricky_trees() if case == "tricky" else variant_trees(case)
    text, terms = generated(exprs)
    columns, rows = block(len(case))
    names = tuple(sorted(set(re.findall(r'position\(ROW_CONSTANTS, "(\w+)"\)', text))))
    given = {name: rows.get(name, torch.rand(5, dtype=torch.float64) + 0.5) for name in names}
    expected = evaluate(exprs, columns, given)
    rowc = tuple(given[name][:, None] for name in names)
    actual = terms(*(columns[key] for key in ("logp", "logq", "p", "q", "is_target")), rowc, names)
    actual = actual if isinstance(actual, tuple) else (actual,)
    for got, wanted in zip(actual, expected):
        got = torch.as_tensor(got, dtype=torch.float64).expand_as(wanted)
        assert torch.equal(got.isnan(), wanted.isnan()), text
        assert torch.equal(got.nan_to_num(), wanted.nan_to_num()), text


def test_identical_subtrees_are_computed_once_whatever_python_objects_they_are() -> None:
    first = where(equal(P, 0.0), 0.0, P * (LOGP - LOGQ))
    second = where(equal(P, 0.0), 0.0, P * (LOGP - LOGQ)) + where(equal(P, 0.0), 1.0, Q)  # new objects
    text, _ = generated([first, second])
    assert text.count("p == 0.0") == 1 and text.count("logp - logq") == 1
    assert "term1 = term0 + tl.where(p_eq_0, 1.0, q)" in text


def test_generated_names_say_what_they_compute() -> None:
    text = kernel_source("sums", "alpha_divergence", kl_alpha=0.3)
    body = text.split("def alpha_divergence_column_terms")[1]
    assert "logp_minus_logq = logp - logq" in body
    assert not re.search(r"\b[rvg]\d+\b", body)  # no r0 … r30 any more
    assert re.search(r"^# ---- generated: .*/sums_terms_alpha_divergence_[0-9a-f]{12}\.py ----$", text, re.MULTILINE)
