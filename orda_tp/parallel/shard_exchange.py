"""Record exchange across the vocabulary shards of a tensor-parallel group (:class:`ShardExchange`):
one all-gather per statistics round, bitwise-identical merged records on every rank, the errors
only one rank can see (:class:`LocalError`) raised on every rank, and the hidden-gradient sums
(docs/architecture.md, "Errors that only one rank can see", "The hidden-gradient sum").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import BackendLoan, all_gather_rows, gather_sequence_rows, reduce_scatter_rows

__all__ = ["LocalError", "LocalErrorCode", "ShardExchange"]


class LocalErrorCode(Enum):
    """What a rank found wrong in its own tensors; exchanged as its int value (0: nothing)."""

    TEACHER_LOGITS_NOT_FINITE = 1  # NaN or +inf in the shard of a cached teacher's logits
    CACHE_MODIFIED = 2  # a PrecomputedTeacher modified in place after it was built
    INPUT_NOT_FINITE = 3  # NaN or inf in a hidden state or head weight (check_finite_inputs)
    CACHE_NOT_FINITE = 4  # NaN or inf in a cached teacher's hidden states or head


_MESSAGES = {
    LocalErrorCode.TEACHER_LOGITS_NOT_FINITE: "teacher.logits must be finite or -inf; rank {rank}'s shard holds NaN "
    "or +inf at row {row}, global column {column}",
    LocalErrorCode.CACHE_MODIFIED: "PrecomputedTeacher was modified in place after it was built (seen on rank "
    "{rank}); build a new PrecomputedTeacher",
    LocalErrorCode.INPUT_NOT_FINITE: "student_hidden, weight, bias and the teacher's tensors must be finite; rank "
    "{rank} holds NaN or inf (row {row}, column {column} of its shard)",
    LocalErrorCode.CACHE_NOT_FINITE: "PrecomputedTeacher.teacher_hidden, teacher_weight and teacher_bias must be "
    "finite; rank {rank}'s shard holds NaN or inf",
}
NO_ERROR = 0  # the header's code when a rank found nothing


@dataclass(frozen=True)
class LocalError:
    """An input problem found on one rank: ``code`` says what; ``row``, ``column`` (global) where."""

    code: LocalErrorCode
    row: int = 0
    column: int = 0

    def message(self, rank: int) -> str:
        """The ValueError's message, as every rank raises it."""
        return _MESSAGES[self.code].format(rank=rank, row=self.row, column=self.column)


class ShardExchange:
    """The tensor-parallel :class:`orda_tp.engine.call.RecordExchange`: every collective it starts is
    waited, and its host tensors settled, before the forward (:meth:`finish`) or the backward
    (:meth:`reduce_row_gradients`) that started it returns."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        sequence_parallel: bool,
        local_error: LocalError | None,
        shares_errors: bool,
        inconsistent: Tensor | None = None,
    ) -> None:
        """``local_error``: this rank's, or None; ``shares_errors``: whether the ranks' errors are
        exchanged at all (the same on every rank); ``inconsistent``: ``VocabLayout.inconsistent``,
        which, when set, makes every merged record NaN."""
        assert shares_errors or local_error is None
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.local_error = local_error
        # Nothing to exchange where no rank's check can fail: no error columns, no host read.
        self.errors_exchanged = not shares_errors
        self.inconsistent = inconsistent
        self.pending_sums: list[dist.Work] = []  # row-group gradient sums in flight
        self.summed_rows = BackendLoan()  # the rows those sums were handed

    def _header(self, rows: int, like: Tensor) -> Tensor:
        """(rows, 3) error columns: this rank's error code (:data:`NO_ERROR` if none), row, column."""
        error = self.local_error
        header = [NO_ERROR, 0, 0] if error is None else [error.code.value, error.row, error.column]
        return torch.tensor(header, dtype=like.dtype, device=like.device).expand(rows, 3)

    def _raise_gathered_errors(self, headers: Tensor) -> None:
        """``headers``: (world, rows, 3) error columns, one host read."""
        self.errors_exchanged = True
        # The call's host read of the errors: each rank's first row, the same on every rank.
        for rank, (code, row, column) in enumerate(headers[:, 0].tolist()):
            if code != NO_ERROR:
                raise ValueError(LocalError(LocalErrorCode(int(code)), int(row), int(column)).message(rank))

    def merge_partitions(
        self, local: Tensor, num_families: int, merge_stacked: Callable[[Tensor, int], Tensor]
    ) -> Tensor:
        packed, width = local, local.shape[1]
        if not self.errors_exchanged:
            # The call's first round carries the error columns: no collective of their own.
            packed = torch.cat([packed, self._header(packed.shape[0], packed)], dim=1)
        gathered = all_gather_rows(packed, self.group)
        if packed.shape[1] > width:
            # Every rank reads every rank's error, so all raise the same one, before the merge.
            self._raise_gathered_errors(gathered[..., width:])
            gathered = gathered[..., :width].contiguous()
        if self.inconsistent is not None:  # labels that differ, or copies of one head: NaN, no host read
            gathered = torch.where(self.inconsistent, float("nan"), gathered)
        # The same gathered stack and the same ops on every rank: the merged record is bitwise the same.
        return merge_stacked(gathered, num_families)

    def sum_over_shards(self, local: Tensor) -> Tensor:
        # Gathered, then summed with the same op on every rank: the same sums on every rank.
        return all_gather_rows(local, self.group).sum(dim=0)

    def gather_stacked(self, local: Tensor) -> Tensor:
        return all_gather_rows(local, self.group)

    def finish(self, like: Tensor) -> None:
        """Exchange the errors if no round did (a call with no rows), and wait for the gradient sums
        the forward started: a forward returns with no collective in flight."""
        self._wait_for_sums()
        if not self.errors_exchanged:  # no round ran: the errors alone, so that no rank skips a collective
            gathered = all_gather_rows(self._header(1, like), self.group)
            self._raise_gathered_errors(gathered)

    def gather_rows(self, tensors: list[Tensor]) -> list[Tensor]:
        if not self.sequence_parallel:
            return tensors
        return gather_sequence_rows(tensors, self.group)

    def start_row_gradient_sum(self, grads: list[Tensor], begin: int, end: int) -> None:
        """Without sequence parallelism, an asynchronous all-reduce of each gradient's rows
        ``[begin, end)``, waited by :meth:`finish` in the forward or :meth:`reduce_row_gradients`
        in the backward; under it nothing (:meth:`reduce_row_gradients` reduce-scatters)."""
        if self.sequence_parallel:
            # A row group's rows are not one rank's rows: the one reduce-scatter at the end keeps those.
            return
        for grad in grads:
            # In place on the rows' view, lent through the loan that _wait_for_sums settles.
            rows = self.summed_rows.alias(grad[begin:end])
            # Asynchronous: it overlaps the next row groups' logits, kernels and GEMMs.
            self.pending_sums.append(dist.all_reduce(rows, group=self.group, async_op=True))

    def _wait_for_sums(self) -> None:
        """Wait for every gradient sum in flight, then for the process group to let go of their
        rows."""
        works, self.pending_sums = self.pending_sums, []
        while works:
            works.pop().wait()  # no name keeps a waited work (and its rows) alive
        self.summed_rows.settle()

    def reduce_row_gradients(self, grads: list[Tensor]) -> list[Tensor]:
        if not self.sequence_parallel:  # the row walk started every row group's sum
            self._wait_for_sums()
            return grads
        # No hidden gradient (decided alike on every rank, by the plan): no collective.
        return reduce_scatter_rows(grads, self.group) if grads else grads
