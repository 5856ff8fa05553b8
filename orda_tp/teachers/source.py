"""What the loss asks of a teacher (:class:`TeacherSource`), and the teachers read through an LM head:
:class:`TiedTeacher`, :class:`SeparateTeacher`, :class:`TeacherHead`."""

from __future__ import annotations

from dataclasses import Field, dataclass, fields, is_dataclass
from typing import ClassVar, NamedTuple, Protocol

import torch
from torch import Tensor, nn

__all__ = [
    "TEACHER_MODES",
    "ExpectedShape",
    "LogitsInputs",
    "SeparateTeacher",
    "ShardReader",
    "SparseLogits",
    "TeacherHead",
    "TeacherBlocks",
    "TeacherSource",
    "TiedTeacher",
    "ValueCheck",
    "bias_shapes",
    "check_tensor",
    "columns",
]


def check_tensor(value: object, name: str, dims: int = 2) -> torch.Tensor:
    """A floating-point tensor of ``dims`` dimensions (2: hidden states, a head; 1: a head's bias)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if value.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(value.shape)}")
    return value


class ShardReader(Protocol):
    """How a tensor-parallel call takes this rank's part of a teacher tensor that may be a
    DTensor (:class:`orda_tp.parallel.local_shards.DTensorShards`); plain tensors pass through."""

    def hidden(self, tensor: Tensor, name: str) -> Tensor:
        """Hidden states: the rows this rank holds (sequence parallelism like the student's)."""
        ...

    def head(self, tensor: Tensor, name: str) -> Tensor:
        """A head weight: this rank's vocabulary rows."""
        ...

    def logits(self, tensor: Tensor, name: str) -> Tensor:
        """Logits: this rank's vocabulary columns."""
        ...


class ExpectedShape(NamedTuple):
    """The shape a teacher tensor must have (``meaning`` explains it in the error message)."""

    name: str
    tensor: Tensor
    shape: tuple[int, ...]
    meaning: str


class SparseLogits(NamedTuple):
    """A block of logits held as a few listed values per row and one fill value elsewhere (a top-k
    cache's block, as the Triton kernels read it, never formed): entry ``(r, c)`` is ``values[r, m]``
    where ``ids[r, m]`` is global column ``c``, else ``fill[r]``."""

    ids: Tensor  # (rows, k) int64, ascending in each row, distinct
    values: Tensor  # (rows, k), in the ids' order, with the same strides
    fill: Tensor  # (rows,)


class TeacherBlocks(Protocol):
    """A teacher's logits that are neither a head product nor stored logits (a top-k cache): a
    source of its blocks, as the row walk reads them (``orda_tp.engine.logits.SideLogits``)."""

    def block(
        self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool
    ) -> Tensor | SparseLogits:
        """Rows ``[begin, end)`` on local columns ``[start, stop)``, in ``dtype``; ``as_stored``:
        as the teacher stores them, which may be :class:`SparseLogits`."""
        ...


class LogitsInputs(NamedTuple):
    """Where a teacher's logits come from; the fields that do not apply are None."""

    hidden: Tensor | None  # hidden states, read through a head
    weight: Tensor | None  # that head: the teacher's own, or None for the student's
    logits: Tensor | None  # stored logits
    blocks: TeacherBlocks | None  # blocks the teacher forms itself (a top-k cache)
    bias: Tensor | None = None  # its own head's bias (a tied teacher reads the student's)


class ValueCheck(NamedTuple):
    """A teacher tensor whose values a check reads: finite everywhere, or finite or −inf
    (``allow_neg_inf``, a logits cache where −inf marks an impossible token)."""

    name: str
    tensor: Tensor
    allow_neg_inf: bool


class TeacherSource:
    """What the loss asks of a teacher descriptor (the defaults are a trainable teacher's); a new kind
    of teacher is one subclass (docs/architecture.md, "… a teacher kind")."""

    #: The plan's routing: "tied", "separate", "precomputed_logits", "precomputed_hidden" or "precomputed_topk".
    kind: str
    #: Whether a loss term may send it a gradient. One that may not is a cache: its tensors are watched for
    #: in-place changes (:meth:`check_unmodified`) and its values checked where read (:meth:`checked_values`).
    trainable: ClassVar[bool] = True
    #: ``teacher_ce_weight`` when the call leaves it None.
    default_ce_weight: ClassVar[float] = 0.0
    #: The temperature a cache of logits was already divided by, or None.
    cache_temperature: float | None = None
    #: A top-k cache's: the temperature its log-probabilities were made at (the teacher at another
    #: temperature is a re-tempering of them, :meth:`check_read_at`); None for the other teachers.
    made_at_temperature: float | None = None
    #: A top-k cache's: the soft-cap of the logits it was made from (None: not capped, or not a top-k cache).
    made_at_softcap: float | None = None
    #: Whether the teacher has no mass on most columns (a renormalized top-k cache): the plan
    #: refuses the variants that are then +inf on every row.
    sparse_support: bool = False
    #: Whether its logits are a head product (``teacher_logit_softcap`` caps them), not a cache of
    #: logits or log-probabilities (taken as already capped).
    reads_head: bool = True
    #: The role ("trained", "frozen", "cotrained") the descriptor asserts, or None: the plan raises
    #: where the loss weights give it another (``TiedTeacher.mode``).
    mode: str | None = None

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        raise NotImplementedError

    def logits_inputs(self, vocab_start: int, vocab_size: int) -> LogitsInputs:
        """Where its logits come from over this device's local columns, whose first is global
        column ``vocab_start`` of a real vocabulary of ``vocab_size`` columns."""
        raise NotImplementedError

    def expected_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> list[ExpectedShape]:
        """The shapes its tensors must have, in the order they are checked, given the student's
        ``rows`` × ``width`` hidden states and ``label_rows`` labels; ``vocab``: the student head's
        rows, or None on a vocabulary shard (whose column counts the handshake compares)."""
        raise NotImplementedError

    def localized(self, reader: ShardReader) -> TeacherSource:
        """This descriptor over this rank's shards of its (possibly DTensor) tensors."""
        raise NotImplementedError

    def vocab_columns(self) -> int | None:
        """The vocabulary columns of its own head or logits (None: it reads the student's head)."""
        return None

    def checked_values(self, real_columns: int) -> list[ValueCheck]:
        """The cached values a host check reads (``real_columns``: its local real columns)."""
        return []

    def check_cache_values(self, vocab_size: int) -> None:
        """Raise on a cache whose values cannot stand for a teacher of ``vocab_size`` real columns
        (a host check: it reads the values). The tensors it reads are the same on every rank of
        a tensor-parallel group (as the labels), so every rank raises alike."""

    def trained_tensors(self) -> list[tuple[str, Tensor]]:
        """The tensors ``KernelConfig.check_finite_inputs`` covers (a cache has its own checks)."""
        return [(f"teacher {name}", tensor) for name, tensor in self.named_tensors()]

    def check_read_at(self, temperature: float, vocab_size: int) -> None:
        """Raise unless the loss may read this teacher at ``temperature`` (a cache made at another
        one: exact, or allowed; :class:`orda_tp.PrecomputedTeacher`)."""

    def check_unmodified(self) -> None:
        """Raise if a cached tensor changed in place since the descriptor was built."""

    def check_shardable(self) -> None:
        """Raise if the descriptor cannot be read as one vocabulary shard of a teacher."""

    def replicated_tensors(self) -> list[tuple[str, Tensor]]:
        """Its tensors that every rank of a tensor-parallel group holds whole and alike (a top-k
        cache's, like the labels), with their names; the handshake compares their checksums."""
        return []

    def settings_text(self) -> str:
        """``name=value`` lines of what the descriptor says beside its tensors' values (its class, mode,
        tail, temperature): what every rank of a tensor-parallel call must give alike."""
        lines = [f"teacher={type(self).__name__}"]
        specs: tuple[Field[object], ...] = fields(self) if is_dataclass(self) else ()
        for spec in specs:
            if spec.init:
                value = getattr(self, spec.name)
                # A tensor by its presence only: its values are never read here (a host read would synchronize).
                lines.append(f"teacher.{spec.name}={'<tensor>' if isinstance(value, Tensor) else repr(value)}")
        return "\n".join(lines)


def columns(tensor: Tensor, axis: int, vocab: int | None) -> int:
    """The column count a teacher tensor must have: the student's vocabulary, or its own on a shard."""
    return tensor.shape[axis] if vocab is None else vocab


TEACHER_MODES = ("trained", "frozen", "cotrained")


@dataclass(frozen=True)
class TiedTeacher(TeacherSource):
    """Teacher hidden states ``hidden`` (BT, H) read through the student's own head ``weight``.
    ``mode`` ("trained", "frozen", "cotrained") optionally asserts the role that the loss weights
    imply; a mismatch raises instead of changing the routing."""

    hidden: torch.Tensor
    mode: str | None = None

    def __post_init__(self) -> None:
        check_tensor(self.hidden, "TiedTeacher.hidden")
        if self.mode is not None and self.mode not in TEACHER_MODES:
            raise ValueError(f"TiedTeacher.mode must be one of {TEACHER_MODES} or None, got {self.mode!r}")

    kind = "tied"
    default_ce_weight: ClassVar[float] = 1.0

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("hidden", self.hidden)]

    def logits_inputs(self, vocab_start: int, vocab_size: int) -> LogitsInputs:
        return LogitsInputs(self.hidden, None, None, None)

    def expected_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> list[ExpectedShape]:
        return [ExpectedShape("teacher.hidden", self.hidden, (rows, width), "same shape as student_hidden")]

    def localized(self, reader: ShardReader) -> TiedTeacher:
        return TiedTeacher(reader.hidden(self.hidden, "teacher.hidden"), self.mode)


def bias_shapes(name: str, bias: Tensor | None, weight: Tensor, vocab: int | None) -> list[ExpectedShape]:
    """The expected shape of a head's ``bias`` (none when it has none): its weight's rows."""
    if bias is None:
        return []
    return [ExpectedShape(name, bias, (columns(weight, 0, vocab),), "one entry per row of the head's weight")]


@dataclass(frozen=True)
class SeparateTeacher(TeacherSource):
    """Teacher with its own hidden states ``hidden`` (BT, D_t), head ``weight`` (V, D_t) and optional
    head ``bias`` (V,): its logits are ``hidden · weightᵀ + bias``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor(self.hidden, "SeparateTeacher.hidden")
        check_tensor(self.weight, "SeparateTeacher.weight")
        if self.hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(
                "SeparateTeacher.hidden and SeparateTeacher.weight must share their last dimension, got "
                f"hidden {tuple(self.hidden.shape)} and weight {tuple(self.weight.shape)}"
            )
        if self.bias is not None:
            check_tensor(self.bias, "SeparateTeacher.bias", dims=1)

    kind = "separate"

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("hidden", self.hidden), ("weight", self.weight), *([] if self.bias is None else [("bias", self.bias)])]

    def logits_inputs(self, vocab_start: int, vocab_size: int) -> LogitsInputs:
        return LogitsInputs(self.hidden, self.weight, None, None, self.bias)

    def expected_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> list[ExpectedShape]:
        depth = self.hidden.shape[1]
        return [
            ExpectedShape("teacher.hidden", self.hidden, (rows, depth), "one row per row of student_hidden"),
            ExpectedShape(
                "teacher.weight", self.weight, (columns(self.weight, 0, vocab), depth), "the student's vocab size"
            ),
            *bias_shapes("teacher.bias", self.bias, self.weight, vocab),
        ]

    def localized(self, reader: ShardReader) -> SeparateTeacher:
        bias = None if self.bias is None else reader.head(self.bias, "teacher.bias")
        return SeparateTeacher(
            reader.hidden(self.hidden, "teacher.hidden"), reader.head(self.weight, "teacher.weight"), bias
        )

    def vocab_columns(self) -> int | None:
        return self.weight.shape[0]


@dataclass(frozen=True)
class TeacherHead:
    """A separate teacher read through its own LM-head module: hidden states ``hidden`` (BT, D_t)
    and ``head``, a module whose ``weight`` is (V, D_t) and whose ``bias``, where it is a tensor,
    is (V,) (``nn.Linear(D_t, V)``, an :class:`orda_tp.DistillationHead`, possibly under
    ``fully_shard`` or tensor-parallel). The loss is that of ``SeparateTeacher(hidden, head.weight,
    head.bias)``, both read as the head's forward would: where FSDP2 holds them sharded they are
    gathered for the call and released afterwards, and then must not require grad (a gathered
    parameter sends no gradient back to FSDP's shards)."""

    hidden: torch.Tensor
    head: nn.Module

    def __post_init__(self) -> None:
        check_tensor(self.hidden, "TeacherHead.hidden")
        if not isinstance(self.head, nn.Module):
            raise TypeError(f"TeacherHead.head must be an nn.Module with a weight, got {type(self.head).__name__}")
        weight = getattr(self.head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(
                f"TeacherHead.head must have a 2-D weight (vocab × hidden), got {type(self.head).__name__} "
                f"with weight {None if weight is None else tuple(weight.shape)}"
            )
        bias = getattr(self.head, "bias", None)
        if isinstance(bias, torch.Tensor):  # nn.Linear(bias=False) holds None: no bias
            check_tensor(bias, "TeacherHead.head.bias", dims=1)
