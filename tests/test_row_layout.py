"""How a call walks its rows: the default workspace (from the device's free memory, agreed by the
ranks of a group), the layout chosen within it (the measured table), the rows asked for, and a
deferred backward walking the forward's chunks."""

from __future__ import annotations

import pytest
import torch

import orda_tp
from orda_tp import ChunkSize, KernelConfig, TiedTeacher
from orda_tp.engine.workspace import (
    CHUNKS_PER_GROUP,
    HOST_WORKSPACE_MIB,
    LAYOUT_COSTS,
    MIN_CHUNK_ROWS,
    RowLayout,
    default_workspace_mib,
    row_layout,
)
from orda_tp.parallel.layout import ShardClaim, _layout_from_claims

from .support.cases import make_problem

MIB = 1 << 20


def cheapest_fitting(budget_mib: int, columns: int, logit_bytes: int, staged_bytes: int, rows: int) -> RowLayout:
    """The table's layout of lowest cost whose workspace fits, written out independently."""
    fitting = [
        (cost, RowLayout(chunk, group))
        for (chunk, group), cost in LAYOUT_COSTS.items()
        if columns * (chunk * logit_bytes + group * staged_bytes) <= budget_mib * MIB
    ]
    cost, layout = min(fitting, key=lambda entry: entry[0])
    chunk = min(layout.chunk_rows, rows)
    return RowLayout(chunk, min(layout.group_rows, -(-rows // chunk) * chunk))


@pytest.mark.parametrize("budget_mib", [512, 1024, 2048, 4096])
@pytest.mark.parametrize(("columns", "logit_bytes"), [(128256, 8), (256000, 8), (128256, 4), (32768, 8)])
def test_the_default_is_the_cheapest_measured_layout_that_fits(budget_mib: int, columns: int, logit_bytes: int) -> None:
    long_batch = 1 << 20
    layout = row_layout(KernelConfig(), long_batch, columns, logit_bytes, 2, workspace_mib=budget_mib)
    smallest = min(columns * (c * logit_bytes + g * 2) for c, g in LAYOUT_COSTS)
    if smallest > budget_mib * MIB:  # nothing of the table fits: the most rows that do, 3 chunks a group
        assert layout.group_rows == CHUNKS_PER_GROUP * layout.chunk_rows
        assert (
            layout.chunk_rows == MIN_CHUNK_ROWS or layout.workspace_bytes(columns, logit_bytes, 2) <= budget_mib * MIB
        )
        return
    assert layout == cheapest_fitting(budget_mib, columns, logit_bytes, 2, long_batch)
    assert layout.workspace_bytes(columns, logit_bytes, 2) <= budget_mib * MIB
    # A larger workspace never gives a layout of higher cost.
    larger = row_layout(KernelConfig(), long_batch, columns, logit_bytes, 2, workspace_mib=2 * budget_mib)
    assert LAYOUT_COSTS[(larger.chunk_rows, larger.group_rows)] <= LAYOUT_COSTS[(layout.chunk_rows, layout.group_rows)]


def test_rows_depend_on_the_workspace_and_vocabulary_not_on_a_long_batch() -> None:
    config = KernelConfig()
    layout = row_layout(config, 1 << 20, 128256, 8, 2, workspace_mib=2048)
    assert row_layout(config, 1 << 22, 128256, 8, 2, workspace_mib=2048) == layout
    # A short batch is one chunk (and one group); a batch of a few chunks, groups no longer than it.
    assert row_layout(config, 100, 128256, 8, 2, workspace_mib=2048) == RowLayout(100, 100)
    few = row_layout(config, layout.chunk_rows + 1, 128256, 8, 2, workspace_mib=2048)
    assert few.chunk_rows == layout.chunk_rows and few.group_rows == min(layout.group_rows, 2 * layout.chunk_rows)
    # Without a gradient a group is one chunk.
    forward_only = row_layout(config, 1 << 20, 128256, 8, 0, workspace_mib=2048)
    assert forward_only.group_rows == forward_only.chunk_rows


def test_shards_and_fast_scale_the_rows_in_the_same_memory() -> None:
    config = KernelConfig()
    single = row_layout(config, 1 << 20, 128256, 8, 2, workspace_mib=2048)
    sharded = row_layout(config, 1 << 20, 128256 // 2, 8, 2, shards=2, workspace_mib=2048)
    assert sharded == RowLayout(2 * single.chunk_rows, 2 * single.group_rows)
    fast = row_layout(orda_tp.PROFILES["fast"], 1 << 20, 128256, 8, 2, workspace_mib=512)
    assert fast.workspace_bytes(128256, 8, 2) <= 4 * 512 * MIB
    assert fast.chunk_rows >= row_layout(config, 1 << 20, 128256, 8, 2, workspace_mib=512).chunk_rows


def test_an_explicit_workspace_replaces_the_default_and_caps_asked_rows() -> None:
    for mib in (64, 700, 3000):
        layout = row_layout(KernelConfig(workspace_mib=mib), 1 << 20, 128256, 8, 2, workspace_mib=2048)
        assert layout.workspace_bytes(128256, 8, 2) <= mib * MIB
    tiny = row_layout(KernelConfig(workspace_mib=64), 1 << 20, 128256, 8, 2)
    assert tiny.chunk_rows % 16 == 0 and tiny.group_rows == CHUNKS_PER_GROUP * tiny.chunk_rows
    # Asked-for rows: groups of CHUNKS_PER_GROUP chunks, lowered to an explicit workspace when dynamic.
    asked = row_layout(KernelConfig(chunk_size=ChunkSize(nrows=100)), 1 << 20, 128256, 8, 2, workspace_mib=2048)
    assert asked == RowLayout(100, 100 * CHUNKS_PER_GROUP)
    capped = row_layout(KernelConfig(chunk_size=ChunkSize(nrows=10**4), workspace_mib=64), 1 << 20, 128256, 8, 2)
    assert capped == tiny
    fixed = KernelConfig(chunk_size=ChunkSize(nrows=3, dynamic=False), workspace_mib=1)
    assert row_layout(fixed, 100, 10**6, 8, 0).chunk_rows == 3


def test_the_default_workspace_follows_free_memory_in_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_workspace_mib(torch.device("cpu")) == HOST_WORKSPACE_MIB
    state = {"free": 0, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 141 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    cuda = torch.device("cuda", 0)
    expected = {140 << 30: 2048, 32 << 30: 2048, 31 << 30: 1024, 16 << 30: 1024, 12 << 30: 512, 1 << 30: 512}
    for free, mib in expected.items():
        state["free"] = free
        assert default_workspace_mib(cuda) == mib, free
    # Memory PyTorch's allocator holds unused counts as free.
    state.update(free=8 << 30, reserved=30 << 30, allocated=6 << 30)
    assert default_workspace_mib(cuda) == 2048


def test_ranks_walk_the_smallest_ranks_workspace() -> None:
    claims = [ShardClaim(local_columns=10, label_rows=4, workspace_mib=mib) for mib in (2048, 512, 1024)]
    layout = _layout_from_claims(claims, 1, None)  # type: ignore[arg-type]
    assert layout.workspace_mib == 512
    unclaimed = _layout_from_claims([ShardClaim(local_columns=10, label_rows=4)] * 2, 0, None)  # type: ignore[arg-type]
    assert unclaimed.workspace_mib == HOST_WORKSPACE_MIB


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_deferred_backward_walks_the_forward_chunks(backend: str) -> None:
    """reduction="none" saves each chunk's statistics in the forward, which forms no gradient, and
    forms the gradients in backward: both walk the chunks sized for the gradient's staging (a
    forward sized without it would take longer chunks than the backward can)."""
    p = make_problem(rows=300, vocab=1000, hidden=8, dtype=torch.float32)
    config = KernelConfig(workspace_mib=1)  # 128 rows without staging, 64 with
    assert row_layout(config, 300, 1000, 8, 0).chunk_rows != row_layout(config, 300, 1000, 8, 4).chunk_rows
    grads = {}
    for reduction in ("none", "sum"):
        hidden, weight = p.student_hidden.clone().requires_grad_(), p.weight.clone().requires_grad_()
        out = orda_tp.distillation_loss(
            hidden, weight, p.labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0, reduction=reduction,
            backend=backend, config=config,
        ).loss  # fmt: skip
        grads[reduction] = torch.autograd.grad(out.sum(), (hidden, weight))
    for deferred, eager in zip(grads["none"], grads["sum"]):
        torch.testing.assert_close(deferred, eager, rtol=1e-5, atol=1e-6)
