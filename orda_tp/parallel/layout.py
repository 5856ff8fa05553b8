"""Where this rank's vocabulary columns sit (:class:`VocabLayout`), agreed by every rank of the
group in the handshake of every call (:func:`resolve_layout`): every check reads gathered values, so
every rank raises the same error or none does (docs/architecture.md, "The layout handshake").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import NoReturn

import torch
import torch.distributed as dist

from ..arguments.config import HOST_WORKSPACE_MIB
from ..arguments.validation import runs_host_checks
from .collectives import all_gather_rows, all_gather_texts, host_group
from .fingerprints import inconsistencies, value_checks

__all__ = [
    "FAILURE_TYPES",
    "HeadShard",
    "LocalShard",
    "ShardClaim",
    "VocabLayout",
    "agree_checks",
    "agree_layout",
    "fail_on_every_rank",
    "failure_code",
    "resolve_layout",
    "text_digest",
]


@dataclass(frozen=True, kw_only=True)
class VocabLayout:
    """This rank's share of the vocabulary (and of the rows, under sequence parallelism): global
    columns ``[vocab_start, vocab_stop)`` are its ``local_columns``, of which ``real_local_columns``
    lie below ``vocab_size`` (the rest is padding); ``total_columns``: all shards' columns;
    ``max_local_columns``: the widest shard's; ``workspace_mib``: the call's default chunk
    workspace, under a group the smallest rank's."""

    vocab_start: int
    vocab_stop: int
    total_columns: int
    vocab_size: int
    max_local_columns: int
    local_columns: int
    real_local_columns: int
    group: dist.ProcessGroup | None = None
    rank: int = 0
    world_size: int = 1
    sequence_parallel: bool = False
    workspace_mib: int = HOST_WORKSPACE_MIB
    #: Where host checks do not run under a group: a 0-d bool on the device, whether the ranks'
    #: labels differ or their heads are copies of one head (:func:`resolve_layout`).
    inconsistent: torch.Tensor | None = field(default=None, compare=False)


#: ``ShardClaim.failed``: the error a rank's own checks raised, as 1 + its index here (0: none).
FAILURE_TYPES: tuple[type[Exception], ...] = (ValueError, TypeError)


def failure_code(problem: Exception | None) -> int:
    """``ShardClaim.failed`` for this rank's own check failure ``problem`` (None: 0)."""
    if problem is None:
        return 0
    return 2 if isinstance(problem, TypeError) and not isinstance(problem, ValueError) else 1


def text_digest(text: str) -> int:
    """A signed 64-bit digest of ``text``, the same in every process (``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


@dataclass(frozen=True)
class ShardClaim:
    """What one rank brings to the handshake, host values (−1 where a field is not given): its
    shard's sizes and range, its label rows, whether its own checks failed (:func:`failure_code`),
    the digest of its call's settings (:func:`text_digest`) and its default chunk workspace in MiB."""

    local_columns: int = -1
    teacher_columns: int = -1
    range_start: int = -1
    range_stop: int = -1
    vocab_size: int = -1
    label_rows: int = -1
    sequence_parallel: int = 0
    failed: int = 0
    call_digest: int = 0
    workspace_mib: int = -1

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, spec.name) for spec in fields(self)], dtype=torch.int64)


def _agreed_or_raise(values: list[int], what: str) -> int:
    if len(set(values)) != 1:
        listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(f"{what} must be the same on every rank of tp_group, got {listing}")
    return values[0]


def _partition(claims: list[ShardClaim]) -> list[tuple[int, int]]:
    """Every rank's column range: explicit ``vocab_range``s, or the shards in rank order."""
    given = [c.range_start >= 0 for c in claims]
    if any(given) and not all(given):
        ranks = [r for r, g in enumerate(given) if not g]
        raise ValueError(f"vocab_range must be given on every rank or on none; ranks {ranks} gave none")
    if not any(given):
        ranges, start = [], 0
        for claim in claims:
            ranges.append((start, start + claim.local_columns))
            start += claim.local_columns
        return ranges
    ranges = [(c.range_start, c.range_stop) for c in claims]
    for rank, (claim, (start, stop)) in enumerate(zip(claims, ranges)):
        if stop - start != claim.local_columns:
            raise ValueError(
                f"vocab_range on rank {rank} is ({start}, {stop}), {stop - start} columns, but its weight shard "
                f"has {claim.local_columns} rows"
            )
    expected = 0
    for start, stop in sorted(ranges):  # any order of ranks: sorted, the ranges must tile [0, total)
        if start > expected:
            raise ValueError(
                f"vocab_range partition across tp_group has a gap: columns [{expected}, {start}) are on no rank"
            )
        if start < expected:
            raise ValueError(
                f"vocab_range partition across tp_group overlaps: columns [{start}, {min(expected, stop)}) "
                "are on two ranks"
            )
        expected = stop
    return ranges


def _layout_from_claims(claims: list[ShardClaim], rank: int, group: dist.ProcessGroup) -> VocabLayout:
    for r, claim in enumerate(claims):
        if claim.teacher_columns >= 0 and claim.teacher_columns != claim.local_columns:
            raise ValueError(
                f"the teacher's vocabulary shard on rank {r} has {claim.teacher_columns} columns but the student's "
                f"weight shard has {claim.local_columns}; both heads must be sharded the same way"
            )
    ranges = _partition(claims)
    total = sum(stop - start for start, stop in ranges)
    vocab_size = _agreed_or_raise([c.vocab_size for c in claims], "vocab_size")
    vocab_size = total if vocab_size < 0 else vocab_size
    if not 1 <= vocab_size <= total:
        raise ValueError(f"vocab_size must lie in [1, {total}] (the columns of all shards), got {vocab_size}")
    _agreed_or_raise([c.label_rows for c in claims], "labels.shape[0] (labels are global)")
    # Each rank's own check made its hidden rows labels.shape[0] / world_size under it (check_inputs).
    sequence_parallel = bool(_agreed_or_raise([c.sequence_parallel for c in claims], "sequence_parallel"))
    start, stop = ranges[rank]
    workspaces = [c.workspace_mib for c in claims if c.workspace_mib > 0]
    return VocabLayout(
        vocab_start=start,
        vocab_stop=stop,
        total_columns=total,
        vocab_size=vocab_size,
        max_local_columns=max(c.local_columns for c in claims),  # sizes every rank's chunks alike
        local_columns=stop - start,
        real_local_columns=max(0, min(stop, vocab_size) - start),  # 0 on a shard of padding alone
        group=group,
        rank=rank,
        world_size=len(claims),
        sequence_parallel=sequence_parallel,
        workspace_mib=min(workspaces, default=HOST_WORKSPACE_MIB),  # the smallest: every rank walks the same chunks
    )


def _raise_local_failures(claims: list[ShardClaim], problem: Exception | None, group: dist.ProcessGroup) -> None:
    """If any rank's own checks failed, every rank raises the same error naming them and their
    messages: a TypeError where the first failing rank's was one, else a ValueError (on the
    failing ranks chained to their own error)."""
    failed = [rank for rank, claim in enumerate(claims) if claim.failed]
    if not failed:
        return
    # Every rank saw the same claims, so every rank enters this gather, or none does.
    messages = all_gather_texts("" if problem is None else f"{type(problem).__name__}: {problem}", group)
    details = "; ".join(f"rank {rank}: {messages[rank]}" for rank in failed)
    error_type = FAILURE_TYPES[claims[failed[0]].failed - 1]
    raise error_type(f"invalid inputs on tp_group rank(s) {failed}: {details}") from problem


def agree_checks(group: dist.ProcessGroup, problem: Exception | None) -> None:
    """Every rank of ``group`` raises if any rank's checks failed (``problem``: this rank's, or
    None), in one all-gather of a flag per rank over the host group: for checks that must be
    agreed before collectives other than the handshake run (a model's forward)."""
    host = host_group(group)
    # Host values on the host group: reading them never waits for the device.
    flags = all_gather_rows(torch.tensor([[failure_code(problem)]], dtype=torch.int64), host).view(-1).tolist()
    _raise_local_failures([ShardClaim(failed=int(flag)) for flag in flags], problem, host)


def _settings(text: str) -> dict[str, str]:
    """``name=value`` lines of a call text, as a mapping."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _raise_differing_calls(claims: list[ShardClaim], call_text: str, group: dist.ProcessGroup) -> None:
    """If the ranks' call settings differ (their digests do), every rank raises the same error
    naming the settings that differ and each rank's value: a keyword given differently on one rank
    would make the ranks compute different losses, or walk different chunks and wait on each
    other."""
    if len({claim.call_digest for claim in claims}) == 1:
        return
    # The texts travel only when the digests differ, to name each setting that does.
    settings = [_settings(text) for text in all_gather_texts(call_text, group)]
    names = list(dict.fromkeys(name for setting in settings for name in setting))
    differing = [name for name in names if len({setting.get(name) for setting in settings}) > 1]
    listing = "; ".join(
        f"{name}: "
        + ", ".join(f"rank {rank}: {setting.get(name, '(not given)')}" for rank, setting in enumerate(settings))
        for name in differing
    )
    raise ValueError(f"a tensor-parallel call must be made with the same settings on every rank of tp_group: {listing}")


@dataclass(frozen=True)
class HeadShard:
    """The tensor holding this rank's vocabulary slices (the head weight's rows, or logits'
    columns along ``vocab_dim``), fingerprinted in the handshake and named in its error."""

    name: str
    tensor: torch.Tensor
    vocab_dim: int


@dataclass(frozen=True, kw_only=True)
class LocalShard:
    """What a rank's checked inputs say about its share of a call, whichever loss it calls: its
    vocabulary slices (``head``), its flat global labels, its global column range if known (None:
    the shards lie in rank order), its teacher's columns where a separate head must match,
    ``vocab_size`` (None: every column is real), whether its hidden states hold only its rows
    (sequence parallelism), its default chunk workspace in MiB (None: the device's,
    :func:`orda_tp.engine.workspace.default_workspace_mib`), and the tensors besides the labels
    that every rank must hold alike (``replicated``, named for the error)."""

    head: HeadShard
    labels: torch.Tensor
    vocab_range: tuple[int, int] | None = None
    teacher_columns: int | None = None
    vocab_size: int | None = None
    sequence_parallel: bool = False
    workspace_mib: int | None = None
    replicated: Sequence[tuple[str, torch.Tensor]] = ()


def _replicated_head_error(claims: list[ShardClaim], name: str) -> ValueError:
    return ValueError(
        f"{name} holds the same values on every rank of tp_group ({claims[0].local_columns} vocabulary "
        f"entries each): a full, unsharded head passed on every rank? With tp_group each rank passes its own "
        f"vocabulary shard (e.g. weight.chunk(world_size)[rank], or a Shard(0) DTensor); without tensor "
        "parallelism, leave tp_group=None"
    )


def _differ_error(names: list[str]) -> ValueError:
    listed = " and ".join(names)
    verb = "differs" if len(names) == 1 else "differ"
    return ValueError(
        f"{listed} must be identical on every rank of tp_group (every rank holds the whole batch's rows); "
        f"{listed} {verb} between ranks"
    )


def resolve_layout(
    group: dist.ProcessGroup,
    claim: ShardClaim,
    replicated: Sequence[tuple[str, torch.Tensor]],
    head: HeadShard | None,
    problem: Exception | None,
    host_checks: bool | None = None,
    call_text: str = "",
) -> VocabLayout:
    """The layout agreed by every rank of ``group``, in two all-gathers: ``claim``, this rank's
    ``problem`` (its own check failure, if any) and ``call_text`` (its settings, ``name=value``
    lines), then the checksums of the ``replicated`` tensors (named) and ``head``'s fingerprint.
    A failure on any rank, settings that differ, shards or sizes that do not agree, replicated
    tensors that differ or one full head on every rank raise the same error on every rank (a
    ValueError, or the first failing rank's TypeError); where ``host_checks``
    (``KernelConfig.host_checks``) do not run, the last two set ``VocabLayout.inconsistent``
    instead, on the device.
    """
    world = dist.get_world_size(group)
    host = host_group(group)
    # The claims are host values on the host group: gathering them never waits for the device.
    gathered = all_gather_rows(claim.as_tensor().view(1, -1), host).view(world, -1).tolist()
    claims = [ShardClaim(*(int(v) for v in values)) for values in gathered]
    # Failures first: a failed rank's other fields carry nothing.
    _raise_local_failures(claims, problem, host)
    _raise_differing_calls(claims, call_text, host)
    layout = _layout_from_claims(claims, dist.get_rank(group), group)
    nccl = dist.get_backend(group) == dist.Backend.NCCL
    # The second gather lives on the group's device: the current CUDA device under NCCL.
    device = replicated[0][1].device if replicated else torch.device("cpu")
    if nccl and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    head_tensor, vocab_dim = (head.tensor, head.vocab_dim) if head is not None else (None, 0)
    local_checks = value_checks([tensor for _, tensor in replicated], head_tensor, vocab_dim, device)
    # One width on every rank: the first gather agreed on the settings (the teacher's kind, token weights).
    checks = all_gather_rows(local_checks.view(1, -1), group).view(world, -1)
    same_size = head is not None and len(claims) > 1 and len({claim.local_columns for claim in claims}) == 1
    differ, copies = inconsistencies(checks, same_size)
    # Decided by the group's backend, not by this rank's tensors, so every rank decides alike.
    if not runs_host_checks(host_checks, torch.device("cuda" if nccl else "cpu")):
        # Compared on the device: the record exchange turns it into NaN records, with no host read.
        return replace(layout, inconsistent=differ.any() | copies)
    # Read on the host (a synchronization under NCCL), only where host checks run.
    differing = [name for (name, _), flag in zip(replicated, differ.tolist()) if flag]
    if differing:
        raise _differ_error(differing)
    if bool(copies):
        assert head is not None
        raise _replicated_head_error(claims, head.name)
    return layout


def agree_layout(
    group: dist.ProcessGroup, shard: LocalShard, workspace_mib: int, host_checks: bool | None, call_text: str
) -> VocabLayout:
    """The layout of a call whose own checks passed on this rank, agreed across ``group`` from
    every rank's :class:`LocalShard` and default workspace (:func:`resolve_layout`)."""
    start, stop = shard.vocab_range if shard.vocab_range is not None else (-1, -1)
    claim = ShardClaim(
        local_columns=shard.head.tensor.shape[shard.head.vocab_dim],
        teacher_columns=-1 if shard.teacher_columns is None else shard.teacher_columns,
        range_start=start,
        range_stop=stop,
        vocab_size=-1 if shard.vocab_size is None else shard.vocab_size,
        label_rows=shard.labels.shape[0],
        sequence_parallel=int(shard.sequence_parallel),
        call_digest=text_digest(call_text),
        workspace_mib=workspace_mib,
    )
    tensors = [("labels", shard.labels), *shard.replicated]
    return resolve_layout(group, claim, tensors, shard.head, None, host_checks, call_text)


def fail_on_every_rank(problem: Exception, group: dist.ProcessGroup | None) -> NoReturn:
    """Raise ``problem``, this rank's own check failure, on every rank of ``group`` (None: one
    device) at once, so that no rank waits for this one in a collective."""
    if group is None:
        raise problem
    # This rank enters the handshake with only its failure, where the others enter it with their claims.
    resolve_layout(group, ShardClaim(failed=failure_code(problem)), (), None, problem)
    raise AssertionError("the handshake raises for a failed rank")  # pragma: no cover
