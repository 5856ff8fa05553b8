"""``flash_ce_kd_loss``: per-token CE and KD scores from the student's logits and the teacher's
hidden states and LM head, the teacher's logits formed block by block and never all at once."""

from __future__ import annotations

import torch
from torch import Tensor

from .arguments.config import HOST_WORKSPACE_MIB, ExecutionConfig
from .arguments.options import LogitsOptions, check_group
from .arguments.plan import LossPlan
from .arguments.validation import (
    check_count,
    check_flag,
    check_floating,
    check_labels,
    check_same_device,
)
from .engine.call import agree, prepare_call, raised_on_every_rank
from .engine.given_logits import chunks_of, row_statistics
from .engine.logits import HeadLogits, PairedLogits, StoredLogits, statistics_dtype
from .engine.stats import RowStats
from .parallel.dtensor import MeshAxis
from .parallel.layout import HeadShard, LocalShard
from .parallel.logits_shards import local_companion, local_head_weight, local_student, logits_call_group, logits_group

__all__ = ["flash_ce_kd_loss"]


def _check_scoring_inputs(
    student: object, hidden: object, weight: object, labels: object
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Types, shapes and devices of this rank's tensors (no value is read); returns them."""
    specs = (("student_logits", student, "[N, V]"), ("teacher_hidden", hidden, "[N, D]"),
             ("teacher_lm_head_weight", weight, "[V, D]"))  # fmt: skip
    # Every type first, then every shape: a wrong type is named before a shape it cannot have.
    for name, value, shape in specs:
        check_floating(name, value, shape)
    student, hidden, weight = (check_floating(name, value, shape, dims=2) for name, value, shape in specs)
    rows, columns = student.shape
    if hidden.shape[0] != rows:
        raise ValueError(
            f"teacher_hidden must have shape ({rows}, D) (one row per row of student_logits), got {tuple(hidden.shape)}"
        )
    if tuple(weight.shape) != (columns, hidden.shape[1]):
        raise ValueError(
            f"teacher_lm_head_weight must have shape {(columns, hidden.shape[1])} (student_logits' vocabulary "
            f"columns × teacher_hidden's width), got {tuple(weight.shape)}"
        )
    labels = check_labels(labels, (rows,), "one label per row of student_logits")
    named = [("teacher_hidden", hidden), ("teacher_lm_head_weight", weight), ("labels", labels)]
    check_same_device("student_logits", student.device, named)
    return student, hidden, weight, labels


def _divergence(stats: RowStats) -> Tensor:
    """The rows' ``D = KL(q‖p)``, without ``T²``."""
    assert stats.kl_stats is not None  # the scoring plan has a KL term
    return stats.kl_stats.divergence


def _local_inputs(
    student_logits: object, teacher_hidden: object, weight: object, labels: object, axis: MeshAxis | None
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], LocalShard]:
    """This rank's checked ``(student_logits, teacher_hidden, teacher_lm_head_weight, labels)``, its share."""
    given_hidden = local_companion(teacher_hidden, student_logits, axis, "teacher_hidden", vocabulary=False)
    given_weight = local_head_weight(weight, axis, "teacher_lm_head_weight")
    given_labels = local_companion(labels, student_logits, axis, "labels", vocabulary=False)
    given_student, vocab_range = local_student(student_logits, axis)
    checked = _check_scoring_inputs(given_student, given_hidden, given_weight, given_labels)
    student, _, weight, local_labels = checked
    head = HeadShard("student_logits", student, -1)
    shard = LocalShard(
        head=head,
        labels=local_labels,
        vocab_range=vocab_range,
        teacher_columns=weight.shape[0],
        workspace_mib=HOST_WORKSPACE_MIB,
    )
    return checked, shard


# Inside torch.compile'd code the scoring runs eagerly behind one graph break.
@torch.compiler.disable
def flash_ce_kd_loss(
    student_logits: Tensor,
    teacher_hidden: Tensor,
    teacher_lm_head_weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -1,
    chunk_size: int = 16384,
    upcast: bool = True,
    tp_group: object | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Per-token ``(ce, kd)``, each ``(N,)``: ``ce = LSE(s) − s_y`` on the raw logits (0 at
    ``ignore_index``) and ``kd = KL(softmax(t/T) ‖ softmax(s/T))`` on every row, not multiplied by
    ``T²``, with the teacher's logits ``t = teacher_hidden · teacher_lm_head_weightᵀ`` formed block
    by block. Forward only: nothing is differentiated or kept for a backward.

    ``student_logits`` (N, V), ``teacher_hidden`` (N, D), ``teacher_lm_head_weight`` (V, D),
    ``labels`` (N,) ``torch.long`` (in ``[0, V)`` or ``ignore_index``). ``chunk_size``: columns per
    block of the torch backend; rows are walked in chunks of a 448 MiB workspace, whatever N is.
    ``upcast``: the scores are computed in fp32 (fp64 for fp64 inputs) and returned so;
    ``upcast=False`` returns them rounded to ``student_logits.dtype``.

    Tensor parallelism (``tp_group``, or ``student_logits`` a DTensor sharded on its last dimension):
    ``student_logits`` and ``teacher_lm_head_weight`` hold this rank's vocabulary columns, the others
    every row; every rank returns the single-device scores.
    """
    with raised_on_every_rank(lambda: logits_call_group(student_logits, tp_group)):
        options = LogitsOptions.resolve(
            temperature=temperature,
            kl_divergence="forward",
            ignore_index=ignore_index,
            backend=backend,
            tp_group=check_group(tp_group),
            config=ExecutionConfig(vocab_block=check_count("chunk_size", chunk_size, 1)),
        )
        check_flag("upcast", upcast)
        group, axis = logits_group(student_logits, options.tp_group)
        checked, shard = _local_inputs(student_logits, teacher_hidden, teacher_lm_head_weight, labels, axis)
    student, hidden, weight, local_labels = checked
    layout = agree(group, shard, options.config.host_checks, lambda: f"{options.settings_text}\nupcast={upcast!r}")
    # Student CE weight 1, per row, a frozen teacher read through its head: both scores in one walk.
    plan = LossPlan.for_logits(options, 1.0, "none", "precomputed_hidden", layout.vocab_size)
    dtype = statistics_dtype(student, hidden, weight)
    call = prepare_call(
        plan, layout, local_labels, backend=options.backend, dtype=dtype, ignore_index=options.ignore_index
    )
    source = PairedLogits(StoredLogits(student), HeadLogits(hidden, weight))
    # Statistics in fp32/fp64 whatever autocast would pick; one side (the teacher's) is formed per chunk.
    with torch.no_grad(), torch.autocast(student.device.type, enabled=False):
        walked = row_statistics(call, source, dtype, chunks_of(call, dtype, formed_sides=1))
    empty = torch.zeros(0, dtype=dtype, device=student.device)  # no row: no chunk to concatenate
    ce = torch.cat([stats.student_ce for stats in walked]) if walked else empty
    kd = torch.cat([_divergence(stats) for stats in walked]) if walked else empty
    # An ignored row's KD is reported (the label is not read for it), its CE is 0.
    ce = torch.where(call.valid, ce, 0.0)
    out_dtype = dtype if upcast else student.dtype
    return ce.to(out_dtype), kd.to(out_dtype)
