"""Every door's path after its own argument checks: a failure raised on every rank
(:func:`raised_on_every_rank`), the call's layout (:func:`agree`) and the one problem type the
engine reads (:func:`prepare_call` → :class:`Call`); docs/architecture.md, "Every door's path".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..arguments.config import ExecutionConfig
from ..arguments.options import setting_text
from ..arguments.validation import ValueChecks, check_label_range, check_values, runs_host_checks
from ..parallel.layout import LocalShard, VocabLayout, agree_layout, fail_on_every_rank
from ..parallel.local_shards import local_error
from ..parallel.shard_exchange import ShardExchange
from ..teachers.source import TeacherBlocks
from .block_math import BlockMath, select_backend
from .gradient_gemms import GemmPolicy
from .workspace import default_workspace_mib

__all__ = ["Call", "RecordExchange", "agree", "call_text", "prepare_call", "raised_on_every_rank"]


class RecordExchange(Protocol):
    """How a shard's statistics and gradients meet those of the other vocabulary shards
    (:class:`orda_tp.parallel.shard_exchange.ShardExchange`); a call on one device has none."""

    def merge_partitions(
        self, local: Tensor, num_families: int, merge_stacked: Callable[[Tensor, int], Tensor]
    ) -> Tensor:
        """Round 1: the packed record of all shards' columns, identical on every shard, from this
        shard's ``local`` record of ``num_families`` families; ``merge_stacked`` merges a (shards,
        rows, K₁) stack of packed records (the backend's merge)."""
        ...

    def sum_over_shards(self, local: Tensor) -> Tensor:
        """Round 2: the sums over all shards' columns, identical on every shard."""
        ...

    def gather_stacked(self, local: Tensor) -> Tensor:
        """Every shard's (rows, K) ``local`` tensor of the same rows, stacked (shards, rows, K) in
        rank order, identical on every shard (the top-k extraction's candidates)."""
        ...

    def finish(self, like: Tensor) -> None:
        """End of the forward statistics (lets a call with no rows still agree on errors)."""
        ...

    def gather_rows(self, tensors: list[Tensor]) -> list[Tensor]:
        """The full batch's rows of each hidden tensor (sequence parallelism), else the inputs."""
        ...

    def start_row_gradient_sum(self, grads: list[Tensor], begin: int, end: int) -> None:
        """Rows ``[begin, end)`` of the hidden gradients ``grads`` are complete on this device:
        their sum over the shards may start now, overlapping the rows still to come."""
        ...

    def reduce_row_gradients(self, grads: list[Tensor]) -> list[Tensor]:
        """Hidden gradients summed over the shards (this rank's rows under sequence parallelism)."""
        ...


class Plan(Protocol):
    """What the constructor reads of a door's plan: its execution settings."""

    @property
    def config(self) -> ExecutionConfig: ...


P = TypeVar("P", bound=Plan)


@dataclass(frozen=True)
class Call(Generic[P]):
    """A call prepared for the engine: everything it reads besides the tensors it differentiates.

    ``plan``: what to compute; ``layout``: this device's columns; ``math``: the chunked backend's
    block math (None: the reference); ``exchange``: None on one device; ``labels``: (rows,) as the
    statistics read them (a valid row's label where a term reads it, else column 0, which exactly
    one rank owns); ``valid``: (rows,) the rows that count; ``denominator``: N of "mean" (a number,
    or a 0-d tensor never read on the host); ``row_weights``: (rows,) weights of the rows' losses;
    ``teacher_blocks``: a teacher that forms its blocks itself (a top-k cache).
    """

    plan: P
    layout: VocabLayout
    math: BlockMath | None
    exchange: RecordExchange | None
    labels: Tensor
    valid: Tensor
    denominator: float | Tensor = 1.0
    row_weights: Tensor | None = None
    gemms: GemmPolicy = GemmPolicy()
    teacher_blocks: TeacherBlocks | None = None


@contextmanager
def raised_on_every_rank(group: Callable[[], dist.ProcessGroup | None]) -> Iterator[None]:
    """A ValueError or TypeError raised inside is raised on every rank of the call's ``group()``
    (:func:`~orda_tp.parallel.layout.fail_on_every_rank`); on one device (None) as it is."""
    try:
        yield
    except (ValueError, TypeError) as error:
        # group() only now: the keyword that names the group may be what failed.
        fail_on_every_rank(error, group())


def call_text(settings: str, teacher: str, token_weights: object, denominator: tuple[str, object]) -> str:
    """A tensor-parallel call's settings, which every rank must share, as ``name=value`` lines: its
    keywords' ``settings``, its ``teacher``'s, whether ``token_weights`` were given, and its given
    denominator ``(name, value)`` (a tensor by its presence: it is never read)."""
    name, value = denominator
    weights = f"token_weights={'<given>' if token_weights is not None else None}"
    return "\n".join([settings, teacher, weights, f"{name}={setting_text(value)}"])


def agree(
    group: dist.ProcessGroup | None, shard: LocalShard, host_checks: bool | None, call_text: Callable[[], str]
) -> VocabLayout:
    """The call's layout from this rank's checked ``shard``: on one device the whole head; on a
    ``group`` the handshake (:func:`~orda_tp.parallel.layout.agree_layout`), which also proves that
    the ranks' settings (``call_text()``) and the tensors they must hold alike agree."""
    device = shard.head.tensor.device
    # This rank's default; under a group the handshake takes the smallest, so every rank walks the same chunks.
    workspace_mib = default_workspace_mib(device) if shard.workspace_mib is None else shard.workspace_mib
    if group is not None:
        return agree_layout(group, shard, workspace_mib, host_checks, call_text())
    columns = shard.head.tensor.shape[shard.head.vocab_dim]
    vocab_size = columns if shard.vocab_size is None else shard.vocab_size
    return VocabLayout(
        vocab_start=0,
        vocab_stop=columns,
        total_columns=columns,
        vocab_size=vocab_size,
        max_local_columns=columns,
        local_columns=columns,
        real_local_columns=vocab_size,
        workspace_mib=workspace_mib,
    )


def prepare_call(
    plan: P,
    layout: VocabLayout,
    labels: Tensor,
    *,
    backend: str,
    dtype: torch.dtype,
    ignore_index: int | None,
    reads_labels: bool = True,
    refused: str | None = None,
    denominator: float | Tensor | None = None,
    values: ValueChecks | None = None,
    row_weights: Tensor | None = None,
    gemms: GemmPolicy | None = None,
    teacher_blocks: TeacherBlocks | None = None,
) -> Call[P]:
    """The :class:`Call` of ``plan`` over this rank's ``layout``.

    ``labels``: (rows,) global label ids, the same on every rank; ``ignore_index`` marks the rows
    that do not count (None: every row counts); ``reads_labels``: whether a term reads the label
    column. ``backend`` and ``dtype`` (the statistics dtype) select the block math; ``refused``:
    why the kernels cannot run this call ("auto" then takes the torch backend). ``denominator``: N
    of "mean" (None: the valid rows, counted on the device). ``values``: the value checks of a call
    where one can fail: they raise on one device and on every rank of a group.
    """
    config, device = plan.config, labels.device
    host_checks = runs_host_checks(config.host_checks, device)
    valid = torch.ones_like(labels, dtype=torch.bool) if ignore_index is None else labels != ignore_index
    # A host read of the labels, so only where host checks run (by default CPU tensors: no device sync).
    if reads_labels and host_checks and not config.assume_valid_labels:
        check_label_range(labels, layout.vocab_size, ignore_index, one_device=layout.group is None)
    # An ignored row (every row, where no term reads the label) reads column 0: finite, masked.
    stats_labels = torch.where(valid, labels, 0) if reads_labels else torch.zeros_like(labels)
    exchange = None
    if layout.group is not None:
        # A shard's failed value check does not raise here: it travels with the first record exchange.
        error = None if values is None else local_error(values, layout, host_checks)
        # Decided by the plan alike on every rank, so every rank's first exchange has the same width.
        shares_errors = values is not None
        exchange = ShardExchange(layout.group, layout.sequence_parallel, error, shares_errors, layout.inconsistent)
    elif values is not None:
        check_values(values, layout.real_local_columns, host_checks)
    math = select_backend(backend, device.type, dtype, refused)
    if denominator is None:
        # Counted on the device, never read on the host; at least 1, so an all-ignored batch gives 0, not NaN.
        denominator = valid.sum().clamp_min(1)
    gemms = GemmPolicy() if gemms is None else gemms
    return Call(plan, layout, math, exchange, stats_labels, valid, denominator, row_weights, gemms, teacher_blocks)
