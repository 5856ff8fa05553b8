"""The shape of the code, kept as the engine was simplified to (docs/architecture.md, "Reading a call").

- One ``distillation_loss`` call (forward and backward, reverse KL, tied teacher, 8 × 64 rows) runs
  named functions of at most 13 files and 55 functions of orda_tp on the torch backend (56 on the
  Triton backend, whose launches take one more helper), so that a reader
  follows it top to bottom: api → options → plan → row walker → block math / kernels.
- No module of orda_tp is over 400 lines, no function over 60 lines (its docstring aside).
- No import circle between orda_tp's modules (imports inside functions and ``TYPE_CHECKING``
  blocks included), so each module can be read after the ones it uses.
- No import runs up the floors (:data:`FLOORS`, the same imports counted), so the house reads
  bottom-up: a floor's modules use those of their own floor and of the floors below.
- Comments say why and docstrings state contracts: comment lines (whose text starts with ``#``) are
  at least :data:`MIN_COMMENT_SHARE` of the package's lines, docstring lines (every line of a
  module's, class's or function's docstring) at most :data:`MAX_DOCSTRING_SHARE`.
- One call pipeline: the steps every door shares after its own checks (the rank-consistent error
  path, the default workspace, the label range, the exchange, the backend choice) are taken in
  ``engine/call.py`` alone (:data:`PIPELINE_STEPS`), and rows per chunk come from the one
  workspace rule, ``engine.workspace.row_layout``, in the walks alone.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch

import orda_tp

PACKAGE = Path(orda_tp.__file__).parent
MAX_CALL_FILES = 13
MAX_CALL_FUNCTIONS = {"torch": 55, "triton": 56}
# A function's length is its body's: the signature (28 keywords for distillation_loss) and the
# docstring are not counted.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
#: orda_tp's floors, bottom first (docs/architecture.md, "Layers"): the top-level package or module
#: of orda_tp that each module belongs to ("" for ``orda_tp/__init__.py``).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("divergences",),  # the variants, the student's terms, the expression language they are written in
    ("teachers",),  # the teacher descriptors
    ("arguments",),  # a call's arguments, checked once, its execution settings and its plan
    ("kernels",),  # the Triton kernels and their generated functions; no engine
    ("parallel",),  # shards, the layout handshake, the record exchange; no engine, no variant
    ("engine",),  # the prepared call, the row walk, its block math (torch | Triton), the autograd Functions
    (
        "",
        "cross_vocab",
        "flash_kd",
        "integrations",
        "kd_loss",
        "lm_head",
        "loss",
        "loss_op",
        "topk_cache",
        "vocab_parallel",
    ),  # the public doors
)


MIN_COMMENT_SHARE, MAX_DOCSTRING_SHARE = 0.03, 0.15
#: The steps of every door's path: called in ``engine/call.py`` and nowhere else in the package.
PIPELINE_STEPS = ("fail_on_every_rank", "default_workspace_mib", "check_label_range", "ShardExchange", "select_backend")
#: The walks that size their chunks by the workspace rule (``row_layout``).
CHUNKED_WALKS = ("engine/fused.py", "engine/given_logits.py", "topk_cache/extraction.py")


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, orda_tp.TiedTeacher]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 64, generator=generator, requires_grad=True)
    weight = torch.randn(50, 64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (8,), generator=generator)
    return hidden, weight, labels, orda_tp.TiedTeacher(torch.randn(8, 64, generator=generator))


def _call(backend: str, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, orda_tp.TiedTeacher]) -> None:
    out = orda_tp.distillation_loss(*inputs, kl_weight=1.0, kl_divergence="reverse", backend=backend)
    out.loss.backward()


def _device_code() -> set[tuple[str, str]]:
    """``(file, name)`` of orda_tp's ``@triton.jit`` and ``@triton.constexpr_function`` functions:
    device and compile-time code, which Triton's interpreter runs as Python on the CPU (from code
    objects of its own) but which is not part of the host's call path."""
    from triton.runtime import JITFunction
    from triton.runtime.interpreter import InterpretedFunction  # what @triton.jit makes under the interpreter
    from triton.runtime.jit import ConstexprFunction  # @triton.constexpr_function: evaluated at compile time

    modules = [module for name, module in list(sys.modules.items()) if name.startswith("orda_tp.kernels")]
    return {
        (value.fn.__code__.co_filename, value.fn.__name__)
        for module in modules
        for value in vars(module).values()
        if isinstance(value, (JITFunction, InterpretedFunction, ConstexprFunction))
    }


def traced_call(backend: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The files and (file, function) pairs of orda_tp's host code that one call runs, after a
    first call that builds and caches whatever a call builds once (kernels, row programs)."""
    _call(backend, _inputs())
    inputs = _inputs()
    device_code = _device_code()
    files: set[str] = set()
    functions: set[tuple[str, str]] = set()
    root = str(PACKAGE)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        name = frame.f_code.co_filename
        code = frame.f_code
        host = (code.co_filename, code.co_name) not in device_code and not code.co_name.startswith("<")
        if event == "call" and name.startswith(root) and host:
            relative = os.path.relpath(name, root)
            files.add(relative)
            functions.add((relative, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        _call(backend, inputs)
    finally:
        sys.setprofile(None)
    return files, functions


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_call_reads_top_to_bottom(backend: str) -> None:
    files, functions = traced_call(backend)
    listing = "\n".join(f"{file}: {name}" for file, name in sorted(functions))
    assert len(files) <= MAX_CALL_FILES, f"{len(files)} files: {sorted(files)}"
    assert len(functions) <= MAX_CALL_FUNCTIONS[backend], f"{len(functions)} functions:\n{listing}"


def _modules() -> Iterator[tuple[str, ast.Module, int]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(text), len(text.splitlines())


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def test_modules_and_functions_are_short() -> None:
    long_modules = [f"{name} ({lines} lines)" for name, _, lines in _modules() if lines > MAX_MODULE_LINES]
    long_functions = []
    for name, tree, _ in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.body[0].lineno + 1 - _docstring_lines(node)
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def _module_name(path: str) -> str:
    dotted = path.removesuffix(".py").replace(os.sep, ".")
    return dotted.removesuffix(".__init__")


def _imports(module: str, tree: ast.Module, is_package: bool) -> set[str]:
    """The orda_tp modules ``module`` imports, wherever the import statement stands."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("orda_tp"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            if base.startswith("orda_tp"):
                # A module's own packages are imported before it, whatever it imports from them:
                # only the names it takes from them can close a circle.
                if not module.startswith(base + "."):
                    found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_no_import_circle() -> None:
    modules = {_module_name(name): (tree, name.endswith("__init__.py")) for name, tree, _ in _modules()}
    graph = {
        module: sorted(
            target for target in _imports(module, tree, is_package) if target in modules and target != module
        )
        for module, (tree, is_package) in modules.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        stack.pop()
        state[module] = 2
        return None

    for module in graph:
        if module not in state:
            circle = visit(module)
            assert circle is None, " -> ".join(circle)


def _floor(module: str) -> int | None:
    """The index in :data:`FLOORS` of ``module`` (a dotted orda_tp module name), None if unplaced."""
    part = module.split(".")[1] if "." in module else ""
    return next((index for index, names in enumerate(FLOORS) if part in names), None)


def test_no_import_runs_up_the_floors() -> None:
    modules = {_module_name(name): (tree, name.endswith("__init__.py")) for name, tree, _ in _modules()}
    floors = {module: _floor(module) for module in modules}
    unplaced = sorted(module for module, floor in floors.items() if floor is None)
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"
    upward = [
        f"{module} (floor {floors[module]}) imports {target} (floor {floors[target]})"
        for module, (tree, is_package) in sorted(modules.items())
        for target in sorted(_imports(module, tree, is_package))
        if target in modules and floors[target] > floors[module]
    ]
    assert not upward, "\n".join(upward)


def _calls(tree: ast.Module) -> Iterator[str]:
    """The names called in ``tree`` (``f(...)`` and ``module.f(...)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                yield func.id
            elif isinstance(func, ast.Attribute):
                yield func.attr


def test_one_call_pipeline_under_every_door() -> None:
    misplaced = []
    for name, tree, _ in _modules():
        module = os.path.relpath(name, "orda_tp")
        for called in _calls(tree):
            if called in PIPELINE_STEPS and module != "engine/call.py":
                misplaced.append(f"{module} calls {called} (a step of every door's path: engine/call.py)")
            if called == "row_layout" and module not in CHUNKED_WALKS:
                misplaced.append(f"{module} calls row_layout (the walks alone: {CHUNKED_WALKS})")
    assert not misplaced, "\n".join(misplaced)


def _docstring_line_numbers(tree: ast.Module) -> set[int]:
    """The lines of every module, class and function docstring of ``tree``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def test_comments_say_why_and_docstrings_state_contracts() -> None:
    total = comments = docstrings = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        total += len(lines)
        comments += sum(1 for line in lines if line.strip().startswith("#"))
        docstrings += len(_docstring_line_numbers(ast.parse(text)))
    assert comments >= MIN_COMMENT_SHARE * total, f"{comments} comment lines of {total}"
    assert docstrings <= MAX_DOCSTRING_SHARE * total, f"{docstrings} docstring lines of {total}"
