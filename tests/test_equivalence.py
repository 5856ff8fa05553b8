"""The chunked torch backend against the fp64 reference: every variant × teacher mode × reduction.

Values and every gradient agree within 1e-10 (fp64) and 1e-5 (fp32) relative, with T_s ≠ T_t
where the variant allows it, ignored rows, several row chunks and V not a multiple of the block.
"""

from __future__ import annotations

import pytest
import torch

from orda_tp import KL_VARIANTS

from .support.cases import (
    COTRAINED,
    SMALL_CHUNKS,
    TEACHER_MODES,
    call_kwargs,
    loss_and_grads,
    make_problem,
    relative_error,
    separate_problem,
    stable_seed,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("mode", TEACHER_MODES)
@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_chunked_matches_reference(variant: str, mode: str, reduction: str, dtype: torch.dtype) -> None:
    base = make_problem(seed=stable_seed(variant, mode, reduction))
    if mode == "separate":
        base = separate_problem(base)
    kwargs = call_kwargs(variant, mode, reduction)
    if variant in COTRAINED and mode == "precomputed":
        with pytest.raises(ValueError, match="PrecomputedTeacher"):
            loss_and_grads(base, mode, backend="torch", **kwargs)
        return
    upstream = None
    if reduction == "none":
        upstream = torch.rand(base.labels.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    expected, expected_grads = loss_and_grads(base, mode, upstream, backend="reference", **kwargs)
    problem = base.to(dtype)
    actual, actual_grads = loss_and_grads(
        problem, mode, None if upstream is None else upstream.to(dtype), backend="torch", config=SMALL_CHUNKS, **kwargs
    )
    tolerance = TOLERANCE[dtype]
    for field in ("loss", "student_ce", "teacher_ce", "kl"):
        value, reference = getattr(actual, field), getattr(expected, field)
        assert value.shape == reference.shape, field
        assert relative_error(value, reference) <= tolerance, (field, value, reference)
    assert expected.kl.abs().sum() > 0 and expected.teacher_ce.abs().sum() > 0
    for index, (grad, reference) in enumerate(zip(actual_grads, expected_grads)):
        assert (grad is None) == (reference is None), f"input {index}: {grad is None} vs {reference is None}"
        if grad is not None:
            assert grad.dtype == dtype
            assert relative_error(grad, reference) <= tolerance, (index, relative_error(grad, reference))
