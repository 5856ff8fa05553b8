"""How a call walks its rows in groups: its default workspace, the rows per chunk and per
gradient group within it, and what a group does with its staged logit gradients (their dtype, the
input gradients' buffers and the gradient GEMMs).

A chunk of ``R`` rows keeps its logits (``R × C × logit_bytes``: fp32 student and teacher rows of
the ``C`` local columns); a group of ``G`` rows (``G`` a multiple of ``R``) stages its logit
gradients for one pair of gradient GEMMs (``G × C × staged_bytes``). The workspace is the sum,
``C·(R·logit_bytes + G·staged_bytes)`` bytes.

The default workspace grows with the device (:func:`default_workspace_mib`): on CUDA the largest
of :data:`WORKSPACE_STEPS_MIB` that is at most 1/:data:`FREE_MEMORY_SHARE` of the memory free
there, taken in steps so that the layout stays the same from call to call while free memory moves
a little (a new layout changes the rounding of the head's gradient; results are bitwise
reproducible for a given layout); under a tensor-parallel group every rank walks the smallest
rank's (agreed in the handshake) over the widest shard's columns. ``KernelConfig(workspace_mib=...)``
replaces it. Within a workspace, the layout is the one with the lowest measured cost
(:data:`LAYOUT_COSTS`, from ``benchmarks/layout_sweep.py`` on an H200): fewer, longer chunks save
launches and the GEMMs' tile tails; fewer, longer groups save passes over ``dW``.

A group's staged ``dS`` (rows × real local columns) feeds ``dh[rows] += dS·W`` and
``dW += dSᵀ·h[rows]`` (and the same for the teacher's tensors): two GEMMs per side and group, but
one ``dW += [dS_s; dS_t]ᵀ·[h_s; h_t]`` for a tied head that both sides train (one pass over ``dW``,
both contributions summed in the GEMM's fp32 accumulator): the staging holds the teacher's rows
after the student's (``LogitGrads.stacked``). Logit gradients are staged in the call's staging
dtype (``engine.fused``'s call layout): bf16 for bf16 operands on CUDA (the kernels write them
once, in bf16), otherwise in the statistics dtype. fp16 operands then meet an fp32 staging through a
``scale`` (``gradient_materialization_scale``, or the GradScaler's scale) that keeps the small
gradients out of fp16's subnormal range, lowered on the device where it would push the largest
gradient past fp16's range; the product is divided by it. Without a scale fp16 gradient GEMMs run
in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..arguments.config import HOST_WORKSPACE_MIB, ExecutionConfig
from .logits import HeadTensors, LogitGrads

__all__ = [
    "CHUNKS_PER_GROUP",
    "FAST_FACTOR",
    "FREE_MEMORY_SHARE",
    "HOST_WORKSPACE_MIB",
    "LAYOUT_COSTS",
    "MIN_CHUNK_ROWS",
    "WORKSPACE_STEPS_MIB",
    "GemmPolicy",
    "GradNeeds",
    "GradientBuffers",
    "RowLayout",
    "allocate_buffers",
    "default_workspace_mib",
    "row_layout",
    "run_gradient_gemms",
    "scale_by_upstream",
]

#: The default workspaces on a CUDA device, largest first; the last one also where less is free.
WORKSPACE_STEPS_MIB = (2048, 1024, 512)
#: The default workspace is at most this fraction's inverse of the free device memory.
FREE_MEMORY_SHARE = 16


def default_workspace_mib(device: torch.device) -> int:
    """The default workspace of a call on ``device``, in MiB: on CUDA the largest step of
    :data:`WORKSPACE_STEPS_MIB` at most 1/:data:`FREE_MEMORY_SHARE` of the free memory (free to
    the driver, plus what PyTorch's allocator holds unused), else the smallest; elsewhere
    :data:`HOST_WORKSPACE_MIB`. Reads the allocator's and the driver's counters, never a tensor:
    no synchronization with the device."""
    if device.type != "cuda":
        return HOST_WORKSPACE_MIB
    free_bytes, _ = torch.cuda.mem_get_info(device)
    free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    share_mib = free_bytes // FREE_MEMORY_SHARE >> 20
    return next((step for step in WORKSPACE_STEPS_MIB if step <= share_mib), WORKSPACE_STEPS_MIB[-1])


#: The default's rows per chunk are at least this (× the group's size, × FAST_FACTOR with
#: ``ChunkSize(fast=True)``), whatever the workspace: below it, launches cost more than memory saves.
MIN_CHUNK_ROWS = 256
#: ``ChunkSize(fast=True)``: this many times the workspace and the minimum rows.
FAST_FACTOR = 4
#: Chunks per gradient group where the rows per chunk are asked for (``nrows``, ``num_chunks``,
#: ``max_chunks``) or the workspace is too small for every layout of :data:`LAYOUT_COSTS`.
CHUNKS_PER_GROUP = 3

#: The layouts the default chooses from: (chunk rows, group rows) → the call's time walked so,
#: relative to the fastest layout measured (2048/8192), averaged over the problems of
#: ``benchmarks/layout_sweep.py`` on an H200 (KD at BT = 8192 and 32768 at V = 128256 and at
#: V = 256000, CE at V = 128256; docs/benchmarks.md). Layouts that another one beats in less memory
#: are left out. Under a tensor-parallel group the rows are multiplied by its size (a shard holds
#: 1/tp of the columns: the same memory).
LAYOUT_COSTS: dict[tuple[int, int], float] = {
    (256, 512): 1.145,
    (256, 768): 1.111,
    (256, 1024): 1.094,
    (256, 2048): 1.056,
    (512, 1024): 1.060,
    (512, 1536): 1.047,
    (512, 2048): 1.028,
    (512, 4096): 1.024,
    (1024, 2048): 1.015,
    (1024, 4096): 1.008,
    (2048, 4096): 1.004,
    (2048, 8192): 1.001,
}


@dataclass(frozen=True)
class RowLayout:
    """How a call walks its rows: ``chunk_rows`` rows share one pass of logits and statistics;
    ``group_rows`` (a multiple of ``chunk_rows``) share one pair of gradient GEMMs."""

    chunk_rows: int
    group_rows: int

    def workspace_bytes(self, columns: int, logit_bytes: int, staged_bytes: int) -> int:
        """``C·(R·logit_bytes + G·staged_bytes)``: a chunk's logits and a group's staged logit
        gradients over ``columns`` columns."""
        return columns * (self.chunk_rows * logit_bytes + self.group_rows * staged_bytes)


def row_layout(
    config: ExecutionConfig,
    total_rows: int,
    local_vocab: int,
    logit_bytes: int,
    staged_bytes: int,
    shards: int = 1,
    workspace_mib: int = HOST_WORKSPACE_MIB,
) -> RowLayout:
    """Rows per chunk and per gradient group for ``local_vocab`` columns (``KernelConfig``'s
    chunking fields).

    ``logit_bytes``: bytes one row of a chunk keeps per column (4 per fp32 logits side);
    ``staged_bytes``: bytes one staged row takes per column (0 when no gradient is formed);
    ``shards``: the tensor-parallel group's size; ``workspace_mib``: the default workspace
    (:func:`default_workspace_mib`), which ``config.workspace_mib`` replaces.

    - Rows asked for: ``chunk_size.nrows``, or ``ceil(rows / num_chunks)``, or
      ``ceil(rows / max_chunks)`` where the workspace's layout would make more than ``max_chunks``
      chunks; a dynamic ``chunk_size`` lowers them to fit an explicit ``workspace_mib``. Groups of
      :data:`CHUNKS_PER_GROUP` chunks.
    - Otherwise the workspace's layout (the workspace × FAST_FACTOR with ``chunk_size.fast``): the
      layout of :data:`LAYOUT_COSTS` of lowest cost that fits (rows × ``shards``: a shard's chunk
      does a single device's work per record exchange in no more memory). Where none fits, the
      most rows that fit with :data:`CHUNKS_PER_GROUP` chunks per group, a multiple of 64 (default
      workspace: at least ``MIN_CHUNK_ROWS × shards``) or of 16 (explicit workspace: at least 1).
    """
    size = config.chunk_size
    factor = FAST_FACTOR if size.fast else 1
    explicit = config.workspace_mib is not None
    budget = (workspace_mib if config.workspace_mib is None else config.workspace_mib) * factor * (1 << 20)
    columns = max(local_vocab, 1)
    rows = max(total_rows, 1)
    # The most rows with CHUNKS_PER_GROUP chunks per group, and those as a multiple of 16 (at least 1).
    fitting = budget // (columns * (logit_bytes + CHUNKS_PER_GROUP * staged_bytes))
    fitting_16 = max(1, fitting - fitting % 16 if fitting >= 16 else fitting)
    candidates = [(cost, RowLayout(chunk * shards, group * shards)) for (chunk, group), cost in LAYOUT_COSTS.items()]
    fits = [(cost, c) for cost, c in candidates if c.workspace_bytes(columns, logit_bytes, staged_bytes) <= budget]
    layout = min(fits, key=lambda fit: fit[0])[1] if fits else None
    if layout is None:
        chunk = fitting_16 if explicit else max(MIN_CHUNK_ROWS * factor * shards, fitting - fitting % 64)
        layout = RowLayout(chunk, chunk * CHUNKS_PER_GROUP)
    requested = None
    if size.nrows is not None:
        requested = size.nrows
    elif config.num_chunks is not None:
        requested = -(-rows // config.num_chunks)
    elif config.max_chunks is not None and -(-rows // layout.chunk_rows) > config.max_chunks:
        requested = -(-rows // config.max_chunks)
    if requested is not None:
        if explicit and size.dynamic:
            requested = min(requested, fitting_16)
        layout = RowLayout(requested, requested * CHUNKS_PER_GROUP)
    chunk = max(1, min(layout.chunk_rows, rows))
    group = layout.group_rows if staged_bytes > 0 else chunk
    group = max(chunk, min(group - group % chunk, -(-total_rows // chunk) * chunk))
    return RowLayout(chunk_rows=chunk, group_rows=group)


FP16_HEADROOM = 6.0e4  # below fp16's largest finite value, 65504
_ADDMM_OUT_DTYPE = [True]  # cleared once if this torch has no addmm(..., out_dtype=...)


class GradNeeds(NamedTuple):
    """Whether each head input receives a gradient (requires_grad, grad mode and the plan's
    routing already applied), in :class:`HeadTensors` order."""

    student_hidden: bool
    weight: bool
    teacher_hidden: bool
    teacher_weight: bool


class GradientBuffers(NamedTuple):
    """Gradients of the head inputs that receive one (None for the others), summed over row
    groups, in :class:`HeadTensors` order.

    Hidden gradients are in the inputs' dtype on one device, where each row is written once, and
    in the statistics dtype on a shard, whose partial sums still have to be added; a head weight's
    in ``KernelConfig.grad_weight_accumulation``'s dtype: its own for "compute" (and "auto" with a
    bf16 weight: no extra memory, one rounding per group), else the statistics dtype."""

    student_hidden: Tensor | None
    weight: Tensor | None
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None


def allocate_buffers(
    head: HeadTensors,
    needs: GradNeeds,
    sharded: bool,
    statistics: torch.dtype,
    accumulation: str,
    written_columns: int,
) -> GradientBuffers:
    """Gradient buffers of the inputs that need one (see :class:`GradientBuffers`), left for the
    row walk to write.

    The walk's gradient GEMMs write what they cover without reading it first (β = 0,
    :func:`run_gradient_gemms`): every row of a hidden gradient (each row group writes its own
    rows), and a head gradient's first ``written_columns`` rows (the real local columns, written
    by the first row group). Only what no GEMM writes is zeroed here: a padded shard's rows past
    ``written_columns``, and everything when the call has no rows."""
    buffers: list[Tensor | None] = []
    walked = head.student_hidden.shape[0] > 0
    for tensor, need, is_weight in zip(head[:4], needs, (False, True, False, True)):
        if not need or tensor is None:
            buffers.append(None)
            continue
        if is_weight:
            own = accumulation == "compute" or (accumulation == "auto" and tensor.dtype == torch.bfloat16)
        else:
            own = not sharded
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype if own else statistics, device=tensor.device)
        if not walked:
            buffer.zero_()
        elif is_weight:
            buffer[written_columns:].zero_()
        buffers.append(buffer)
    return GradientBuffers(*buffers)


@dataclass(frozen=True)
class GemmPolicy:
    """How staged logit gradients meet the gradient GEMMs: ``scale`` for fp16 materialization."""

    scale: float | Tensor | None = None

    def accumulate(self, target: Tensor, staged: Tensor, operand: Tensor, beta: float) -> None:
        """``target = beta·target + staged · operand`` with ``staged`` in the call's staging dtype and
        ``beta`` 1 (add) or 0 (overwrite: ``target`` is not read, so it may hold anything, NaN
        included).

        bf16 on CUDA: one GEMM that adds into ``target`` in its epilogue (fp32 or bf16 target,
        fp32 accumulation inside the GEMM). fp16 with a scale: the staged fp32 gradient is scaled
        into fp16 for the tensor cores and the product unscaled. Otherwise in ``staged``'s dtype."""
        if staged.dtype == torch.bfloat16:
            if target.dtype == torch.bfloat16:
                target.addmm_(staged, operand, beta=beta)
                return
            if _ADDMM_OUT_DTYPE[0] and target.dtype == torch.float32 and target.is_contiguous():
                try:
                    torch.addmm(target, staged, operand, beta=beta, out_dtype=torch.float32, out=target)
                    return
                except TypeError:  # a torch without addmm(out_dtype=...)
                    _ADDMM_OUT_DTYPE[0] = False
            product = torch.mm(staged, operand, torch.float32)
        elif operand.is_cuda and operand.dtype == torch.float16 and self.scale is not None:
            # Lowered on the device where scale·max|gradient| would leave fp16's range.
            factor = torch.clamp(FP16_HEADROOM / staged.abs().amax(), max=self.scale)
            scaled = (staged * factor).to(torch.float16)
            product = torch.mm(scaled, operand, torch.float32) / factor
        else:
            product = staged @ operand.to(staged.dtype)
        if beta == 0:
            target.copy_(product)
        else:
            target += product.to(target.dtype)


def run_gradient_gemms(
    head: HeadTensors,
    staged: LogitGrads,
    begin: int,
    valid: Tensor,
    buffers: GradientBuffers,
    gemms: GemmPolicy,
    tied: bool,
) -> None:
    """Write the contribution of the group staged for rows ``[begin, begin + rows)`` to ``buffers``,
    side by side: ``dh[rows] = dS·W`` (each group owns its rows) and ``dW += dSᵀ·h[rows]``, which
    the first group (``begin == 0``) writes instead of adding to (β = 0: the buffers come unwritten
    from :func:`allocate_buffers`, no zero-fill and no read of zeros). ``valid`` marks the group's rows
    that are not ignored (the others' hidden rows are not read, so a non-finite ignored row stays
    out). ``tied``: the teacher reads the student's head (``LossPlan.tied_head``); where it trains,
    its weight gradient adds to the student head's in one GEMM over both sides' rows, the
    staging's ``stacked`` (``buffers.teacher_weight`` is None then)."""
    one_gemm = tied and staged.teacher is not None
    sides = [(staged.student, head.student_hidden, head.weight, buffers.student_hidden, buffers.weight)]
    if staged.teacher is not None and head.teacher_hidden is not None:
        teacher_weight = head.weight if tied else head.teacher_weight
        assert teacher_weight is not None
        sides.append(
            (staged.teacher, head.teacher_hidden, teacher_weight, buffers.teacher_hidden, buffers.teacher_weight)
        )
    end, columns = begin + staged.student.shape[0], staged.student.shape[1]
    weight_beta = 0.0 if begin == 0 else 1.0
    # cuBLAS may not reduce split-K partial sums in bf16/fp16 here (torch allows it for bf16/fp16
    # outputs): a gradient GEMM then rounds once, to its output, as its fp32-output counterpart on
    # a vocabulary shard does.
    flags = torch.backends.cuda.matmul
    saved = (flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction)
    flags.allow_bf16_reduced_precision_reduction = False
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        for logit_grads, hidden, weight, hidden_grad, weight_grad in sides:
            if hidden_grad is not None:
                gemms.accumulate(hidden_grad[begin:end], logit_grads, weight.detach()[:columns], beta=0.0)
            if weight_grad is not None and not one_gemm:
                rows = torch.where(valid[:, None], hidden.detach()[begin:end], 0.0)
                gemms.accumulate(weight_grad[:columns], logit_grads.T, rows, beta=weight_beta)
        if one_gemm and buffers.weight is not None:  # one GEMM over both sides' rows
            assert staged.stacked is not None and head.teacher_hidden is not None
            both = torch.cat([head.student_hidden.detach()[begin:end], head.teacher_hidden.detach()[begin:end]])
            rows = torch.where(valid.repeat(2)[:, None], both, 0.0)
            gemms.accumulate(buffers.weight[:columns], staged.stacked.T, rows, beta=weight_beta)
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


def scale_by_upstream(grads: Sequence[Tensor], upstream: Tensor) -> None:
    """Gradients formed in the forward for a unit upstream gradient (an eager call's), scaled in
    place by the 0-d ``upstream`` that backward receives: one launch per tensor with the scale read
    on the device (``triton_math.scale_in_place``, which skips a scale of exactly 1) for contiguous
    CUDA tensors, ``torch._foreach_mul_`` otherwise."""
    if not grads:
        return
    if grads[0].is_cuda and all(grad.is_contiguous() for grad in grads):
        from .triton_math import scale_in_place  # imports triton: only where it runs

        scale_in_place(grads, upstream)
    else:
        torch._foreach_mul_(list(grads), upstream)
