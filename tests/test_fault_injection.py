"""Every check of a tensor-parallel call that fails, on every rank or on one rank only, raises the
same error on every rank, naming the argument, with no hang and no collective left behind
(tests/support/fault_cases.py injects the faults); and every ``raise`` of the checks' modules is reached
by some fault, so that a new check without a fault case fails here."""

from __future__ import annotations

import ast
from functools import cache

import pytest

from .support import fault_cases
from .support.distributed import run_distributed
from .support.fault_cases import FAULTS, PACKAGE, Outcome

WORLDS = (2, 3)
TIMEOUT_S = 240.0
COLLECTIVE_TIMEOUT_S = 30.0  # a rank left waiting fails with gloo's timeout, long before TIMEOUT_S
LOCAL_FAILURE = "invalid inputs on tp_group rank(s)"

# The modules whose checks a loss call runs (directly or through the helpers of checks.py).
CHECK_MODULES = (
    "loss.py",
    "arguments/validation.py",
    "arguments/options.py",
    "arguments/plan.py",
    "lm_head.py",
    "divergences/base.py",
    "divergences/aliases.py",
    "divergences/power.py",
    "divergences/kl_family.py",
    "teachers/source.py",
    "teachers/cached.py",
    "teachers/topk.py",
    "parallel/local_shards.py",
    "parallel/layout.py",
    "parallel/dtensor.py",
    "parallel/shard_exchange.py",
    "kd_loss.py",
    "flash_kd.py",
    "parallel/logits_shards.py",
    "engine/block_math.py",
    "engine/call.py",
    "teachers/mixture.py",
    "arguments/mixture_plan.py",
)

# Functions whose raises no fault reaches, and why.
BUILT_BY_THE_USER = "raised where the user builds the object, before the call and before any collective"
EXEMPT = {
    "divergences/base.py:EntropyGate.__post_init__": BUILT_BY_THE_USER,
    "teachers/source.py:check_tensor": BUILT_BY_THE_USER + " (the teacher descriptors' constructors)",
    "teachers/source.py:TiedTeacher.__post_init__": BUILT_BY_THE_USER,
    "teachers/source.py:SeparateTeacher.__post_init__": BUILT_BY_THE_USER,
    "teachers/source.py:TeacherHead.__post_init__": BUILT_BY_THE_USER,
    "teachers/cached.py:PrecomputedTeacher.__post_init__": BUILT_BY_THE_USER,
    "teachers/cached.py:PrecomputedTeacher._check_topk": BUILT_BY_THE_USER,
    "teachers/cached.py:PrecomputedTeacher._check_declarations": BUILT_BY_THE_USER,
    "teachers/cached.py:PrecomputedTeacher._version_of": BUILT_BY_THE_USER,
    "teachers/cached.py:PrecomputedTeacher.prepare_logits": BUILT_BY_THE_USER + " (a method the user calls)",
    "lm_head.py:DistillationHead.from_linear": BUILT_BY_THE_USER,
    "arguments/options.py:resolve_divergence": "its second raise (a parameter the variant does not read) is raised "
    "with unused='raise' only, by KDLoss's constructor; the first is reached",
    "arguments/options.py:LogitsOptions.resolve": "its raise (a keyword no variant reads) is KDLoss's constructor's: "
    + BUILT_BY_THE_USER,
    "parallel/local_shards.py:_localize": "its tp_group-against-mesh check needs a second process group of other "
    "ranks than the mesh's (test_tensor_parallel's DTensor workers cover it); the others are reached",
    "parallel/local_shards.py:DTensorShards.head": "needs a 2-D mesh (a teacher head sharded on another mesh "
    "dimension than the student's; test_tensor_parallel's 2-D workers)",
    "parallel/dtensor.py:local_shard": "its mesh and two-row-shard checks need a second or 2-D mesh "
    "(test_tensor_parallel's DTensor workers); the placement check is reached",
    "parallel/logits_shards.py:_vocab_axis": "its second raise needs a 2-D mesh; the first is reached",
    "parallel/logits_shards.py:logits_group": "its second raise needs a second process group; the first is reached",
    "parallel/logits_shards.py:local_head_weight": "needs a head sharded on a second mesh",
    "engine/block_math.py:select_backend": "its second raise (the kernels refuse a call they could run: the top-k "
    "kernel's largest k) needs a CUDA device where the kernels run; the first is reached",
}


@cache
def tp_results(world: int) -> tuple[dict[str, dict[str, Outcome]], ...]:
    names = list(FAULTS)
    outcomes = run_distributed(
        world, fault_cases.fault_worker, names, timeout=TIMEOUT_S, collective_timeout=COLLECTIVE_TIMEOUT_S
    )
    return tuple(outcomes)


@cache
def one_device(name: str) -> Outcome:
    return fault_cases.one_device_outcome(name)


def _same_everywhere(name: str, where: str, ranks: list[Outcome], problems: list[str]) -> Outcome | None:
    first = ranks[0]
    if any((o.type, o.message) != (first.type, first.message) for o in ranks):
        listing = "; ".join(f"rank {r}: {o.type}: {o.message[:300]}" for r, o in enumerate(ranks))
        problems.append(f"{name} ({where}): the ranks differ: {listing}")
        return None
    return first


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_raises_the_same_error(world: int) -> None:
    """Each fault, injected on every rank and on the last rank only: every rank raises the same
    ValueError/TypeError naming the argument (and the failing rank, for a rank's own check), of
    the type one device raises; then a good call gives one device's loss (no collective was left
    half-done)."""
    results = tp_results(world)
    problems: list[str] = []
    for name, fault in FAULTS.items():
        if not fault.on_group:
            alone = one_device(name)
            if alone.type not in ("ValueError", "TypeError") or fault.argument not in alone.message:
                problems.append(f"{name} (one device): {alone.type}: {alone.message}")
            continue
        for where in ("all", "one") if fault.one_rank else ("all",):
            seen = _same_everywhere(name, where, [r[name][where] for r in results], problems)
            if seen is None:
                continue
            if where == "all" and not fault.fails_on_all:
                if seen.type:
                    problems.append(f"{name} (all): a setting alike on every rank raised {seen.type}: {seen.message}")
                continue
            if seen.type not in ("ValueError", "TypeError"):
                problems.append(f"{name} ({where}): {seen.type or 'no error'}: {seen.message[:300]}")
                continue
            if fault.argument not in seen.message:
                problems.append(f"{name} ({where}): the error does not name {fault.argument!r}: {seen.message}")
            if where == "one" and seen.message.startswith(LOCAL_FAILURE):
                if not seen.message.startswith(f"{LOCAL_FAILURE} [{world - 1}]"):
                    problems.append(f"{name} (one): the error does not name rank {world - 1} alone: {seen.message}")
            if fault.one_device and fault.fails_on_all:
                alone = one_device(name)
                if alone.type != seen.type:
                    problems.append(f"{name}: one device raises {alone.type} ({alone.message}), the group {seen.type}")
    for rank, result in enumerate(results):
        error = result["good call"]["all"].message
        if float(error) > 1e-12:
            problems.append(f"rank {rank}: the good call after the faults is {error} from one device's loss")
    assert not problems, "\n".join(problems)


def _collect_raises(node: ast.AST, module: str, scope: list[str], sites: dict[str, list[tuple[int, int]]]) -> None:
    named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    if named:
        scope = [*scope, node.name]  # type: ignore[union-attr]
    if isinstance(node, ast.Raise) and node.exc is not None:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(exc, ast.Name) and exc.id in ("ValueError", "TypeError"):
            sites.setdefault(f"{module}:{'.'.join(scope)}", []).append((node.lineno, node.end_lineno or node.lineno))
    for child in ast.iter_child_nodes(node):
        _collect_raises(child, module, scope, sites)


def _raise_sites() -> dict[str, list[tuple[int, int]]]:
    """``module:qualname`` → the (first, last) lines of each ``raise ValueError/TypeError``."""
    sites: dict[str, list[tuple[int, int]]] = {}
    for module in CHECK_MODULES:
        _collect_raises(ast.parse((PACKAGE / module).read_text()), module, [], sites)
    return sites


def test_every_check_has_a_fault() -> None:
    """Every ``raise ValueError/TypeError`` in the modules of a call's checks is reached by some
    fault (on a group or on one device), or its function is exempt with a reason; no exemption
    is stale."""
    reached: set[tuple[str, int]] = set()
    for world in WORLDS:
        for result in tp_results(world):
            for outcomes in result.values():
                for outcome in outcomes.values():
                    reached.update(outcome.sites)
    for name, fault in FAULTS.items():
        if fault.one_device:
            reached.update(one_device(name).sites)
    missing, stale = [], []
    for key, spans in _raise_sites().items():
        module = key.split(":")[0]
        unreached = [
            first for first, last in spans if not any(m == module and first <= line <= last for m, line in reached)
        ]
        if key in EXEMPT:
            if not unreached:
                stale.append(key)
        elif unreached:
            missing.append(f"{key}: raise at line(s) {unreached}")
    assert not missing, "checks without a fault case (add one to tests/support/fault_cases.py):\n" + "\n".join(missing)
    unknown = [key for key in EXEMPT if key not in _raise_sites()]
    assert not stale and not unknown, f"exemptions whose raises are all reached or gone: {stale + unknown}"
