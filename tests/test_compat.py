"""Drop-in compatibility with orda-kernel 0.1.0 (docs/reference.md §1): a call it accepts is accepted here.

- A variant parameter the variant does not read (``kl_alpha`` with ``"forward"``, ...), which
  orda-kernel ignores, gives one :class:`orda_tp.IgnoredArgumentWarning` per call (per
  ``DistillationLoss`` construction, none per forward), attributed to the caller's line, and
  changes nothing: outputs and gradients are bitwise those of the call without it (fp64).
- orda-kernel's forms of two keywords: a NumPy integer ``ignore_index`` and a one-element tensor
  ``gradient_materialization_scale``.
- A cache declared with ``logits_temperature`` holds ``t / T``, from which the teacher CE cannot be
  formed: ``teacher_ce_weight > 0`` raises, as in orda-kernel, on every rank of a tensor-parallel
  group, with no rank left in a collective.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import orda_tp
from orda_tp import DistillationLoss, EntropyGate, IgnoredArgumentWarning, PrecomputedTeacher, distillation_loss

from .support.cases import SMALL_CHUNKS, VARIANT_KWARGS, Problem, make_problem
from .support.distributed import run_distributed

# A value for each variant parameter, in range for the variants that do read it.
UNREAD_VALUES: dict[str, object] = {"kl_alpha": 0.5, "kl_beta": 0.25, "entropy_gate": EntropyGate(tau=0.2)}
READS = {
    "forward": "none of kl_alpha, kl_beta, entropy_gate",
    "alpha_divergence": "only kl_alpha",
    "skew_js": "only kl_beta",
    "entropy_adaptive": "only entropy_gate",
    "dkd": "only kl_alpha and kl_beta",
}


def unread_keywords(variant: str) -> dict[str, object]:
    """The variant parameters ``variant`` does not read, each with a value."""
    return {keyword: value for keyword, value in UNREAD_VALUES.items() if keyword not in VARIANT_KWARGS[variant]}


def call_inputs(problem: Problem) -> tuple[Any, ...]:
    """The positional arguments of a tied-teacher call."""
    return problem.student_hidden, problem.weight, problem.labels, problem.teacher("tied")


def outputs_and_grads(problem: Problem, call: Any, **keywords: object) -> list[Tensor]:
    """The four outputs of ``call(...)`` on a tied teacher and the gradients of every input."""
    inputs = [problem.student_hidden, problem.weight, problem.teacher_hidden]
    out = call(*call_inputs(problem), **keywords)
    return [*out, *torch.autograd.grad(out.loss, inputs, allow_unused=True)]


def assert_identical(actual: list[Tensor | None], expected: list[Tensor | None]) -> None:
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), index
        assert a is None or torch.equal(a, e), f"output {index} differs: {a} vs {e}"


def ignored(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, IgnoredArgumentWarning)]


def test_the_warning_is_a_user_warning_exported_at_the_top() -> None:
    assert issubclass(IgnoredArgumentWarning, UserWarning)
    assert "IgnoredArgumentWarning" in orda_tp.__all__ and orda_tp.IgnoredArgumentWarning is IgnoredArgumentWarning


@pytest.mark.parametrize("variant", list(VARIANT_KWARGS))
def test_an_unread_variant_parameter_warns_once_per_call_and_changes_nothing(variant: str) -> None:
    problem = make_problem(rows=24, vocab=53)  # several row chunks with SMALL_CHUNKS (7 rows each)
    keywords = dict(
        kl_weight=1.3, kl_temperature=2.0, kl_divergence=variant, config=SMALL_CHUNKS, **VARIANT_KWARGS[variant]
    )
    unread = unread_keywords(variant)
    assert unread  # every variant leaves at least one of the three unread
    expected = outputs_and_grads(problem, distillation_loss, **keywords)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # every warn() call is recorded: one per call, not per row or chunk
        actual = outputs_and_grads(problem, distillation_loss, **keywords, **unread)
    messages = ignored(record)
    assert len(messages) == len(unread), messages
    for message, (keyword, value) in zip(messages, unread.items()):
        assert message.startswith(f"{keyword}={value!r} is ignored: kl_divergence={variant!r} reads ")
        assert message.endswith(f"; leave {keyword}=None to silence this warning")
    if variant in READS:
        assert all(f"reads {READS[variant]};" in message for message in messages)
    assert_identical(actual, expected)


def test_unread_values_are_neither_checked_nor_used() -> None:
    """Values that would be out of range, or of the wrong type, for a variant that reads them."""
    problem = make_problem(rows=12, vocab=31)
    expected = outputs_and_grads(problem, distillation_loss, kl_weight=1.0)
    unread = {"kl_alpha": 5.0, "kl_beta": -1, "entropy_gate": "not a gate"}
    with pytest.warns(IgnoredArgumentWarning) as record:
        actual = outputs_and_grads(problem, distillation_loss, kl_weight=1.0, **unread)
    assert [str(w.message).split(" is ignored")[0] for w in record] == [
        "kl_alpha=5.0",
        "kl_beta=-1",
        "entropy_gate='not a gate'",
    ]
    assert_identical(actual, expected)
    # The parameters a variant does read are still checked.
    with pytest.raises(ValueError, match="kl_alpha must lie in"):
        distillation_loss(*call_inputs(problem), kl_divergence="renyi", kl_alpha=5.0)


def test_distillation_loss_module_warns_at_construction_only() -> None:
    problem = make_problem(rows=24, vocab=53)
    keywords = dict(kl_weight=1.0, kl_divergence="skew_forward", kl_beta=0.3, config=SMALL_CHUNKS)
    expected = outputs_and_grads(problem, DistillationLoss(**keywords))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        module = DistillationLoss(**keywords, kl_alpha=0.7, entropy_gate=EntropyGate())
        built = ignored(record)
        first = outputs_and_grads(problem, module)
        second = outputs_and_grads(problem, module)
    assert len(built) == 2
    assert built[0].startswith("kl_alpha=0.7 is ignored: kl_divergence='skew_forward' reads only kl_beta;")
    assert built[1].startswith("entropy_gate=EntropyGate(alpha_min=0.0, alpha_max=1.0, tau=0.5, scale=0.1) is ignored")
    assert ignored(record) == built  # nothing more from the forwards
    assert_identical(first, expected)
    assert_identical(second, expected)


def test_the_warning_names_the_callers_line_and_shows_once_per_call_site() -> None:
    problem = make_problem(rows=6, vocab=11)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # Python's default for UserWarning: once per location
        for _ in range(3):
            distillation_loss(*call_inputs(problem), kl_alpha=0.5)  # one call site
        DistillationLoss(kl_beta=0.5)
        DistillationLoss(kl_beta=0.5)  # another call site
    assert [str(w.message).split(" is")[0] for w in record] == ["kl_alpha=0.5", "kl_beta=0.5", "kl_beta=0.5"]
    assert {w.filename for w in record} == {__file__}
    assert record[1].lineno + 1 == record[2].lineno


def test_logits_level_losses_still_reject_unread_parameters() -> None:
    """KDLoss and flash_ce_kd_loss are not orda-kernel APIs (NeMo's KDLoss has no variant keywords)."""
    with pytest.raises(ValueError, match="kl_alpha=0.5 is not used by kl_divergence='forward'"):
        orda_tp.KDLoss(kl_alpha=0.5)


def test_numpy_integer_ignore_index_and_tensor_materialization_scale() -> None:
    """orda-kernel takes any integral ``ignore_index`` and its scale as a one-element fp32 tensor
    (on the CPU the scale has no effect)."""
    problem = make_problem(rows=12, vocab=31, ignore_index=-1)
    expected = outputs_and_grads(problem, distillation_loss, kl_weight=1.0, ignore_index=-1)
    actual = outputs_and_grads(
        problem,
        distillation_loss,
        kl_weight=1.0,
        ignore_index=np.int64(-1),
        gradient_materialization_scale=torch.tensor([1024.0]),
    )
    assert_identical(actual, expected)
    module = DistillationLoss(
        kl_weight=1.0, ignore_index=np.int32(-1), gradient_materialization_scale=torch.tensor(8.0)
    )
    assert type(module.options.ignore_index) is int
    assert_identical(outputs_and_grads(problem, module), expected)


# ------------------------------------------------------------------------ a tempered cache under TP


def tempered_cache_worker(rank: int, world: int) -> tuple[list[str], float, float]:
    """Each rank passes its columns of a cache declared with ``logits_temperature`` and asks for
    the teacher CE; every rank must raise. A valid call afterwards (its collectives) must then give
    every rank the single-device result: had a rank been left in a collective, it would not."""
    problem = make_problem(rows=8, vocab=21)
    columns = torch.chunk(torch.arange(21), world)[rank]
    start, stop = int(columns[0]), int(columns[-1]) + 1
    hidden, labels = problem.student_hidden.detach(), problem.labels
    weight = problem.weight.detach()[start:stop]
    cache = problem.teacher_logits[:, start:stop] / 2.0
    group = dist.group.WORLD
    messages = []
    for teacher_ce_weight in (1.0, 0.5):
        try:
            distillation_loss(
                hidden,
                weight,
                labels,
                PrecomputedTeacher(logits=cache, logits_temperature=2.0),
                teacher_ce_weight=teacher_ce_weight,
                kl_weight=1.0,
                tp_group=group,
            )
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    out = distillation_loss(
        hidden, weight, labels, PrecomputedTeacher(logits=cache, logits_temperature=2.0), kl_weight=1.0, tp_group=group
    )
    single = distillation_loss(
        hidden,
        problem.weight.detach(),
        labels,
        PrecomputedTeacher(logits=problem.teacher_logits / 2.0, logits_temperature=2.0),
        kl_weight=1.0,
    )
    return messages, float(out.loss), float(single.loss)


def test_a_tempered_cache_with_teacher_ce_raises_on_every_rank() -> None:
    results = run_distributed(2, tempered_cache_worker, timeout=120.0, collective_timeout=30.0)
    for rank, (messages, loss, single) in enumerate(results):
        assert len(messages) == 2
        for message, weight in zip(messages, (1.0, 0.5)):
            assert message.startswith(f"teacher_ce_weight={weight} needs raw teacher logits"), (rank, message)
            assert "pass teacher_ce_weight=0.0, or pass the raw logits without logits_temperature" in message
        assert loss == pytest.approx(single, rel=1e-12, abs=0), rank
    assert results[0] == results[1]


def test_distillation_loss_keywords_are_the_options_fields() -> None:
    """The public signature and LossOptions (which validates it) list the same keywords, with the
    same defaults, so that neither can drift from the other."""
    import dataclasses
    import inspect

    from orda_tp.arguments.options import LossOptions

    signature = inspect.signature(distillation_loss).parameters.values()
    keywords = {p.name: p.default for p in signature if p.kind is inspect.Parameter.KEYWORD_ONLY}
    del keywords["num_valid_tokens"], keywords["token_weights"]  # properties of the batch, not of the loss
    del keywords["bias"]  # a tensor of the head, beside its weight
    fields = {f.name: f.default for f in dataclasses.fields(LossOptions) if f.init}
    assert keywords == fields
