"""Execution settings: chunking and profiles.

None of these change what is computed, only how (workspace size, checks). ``KernelConfig`` also
takes orda-kernel's fields (:class:`orda_tp.orda_kernel.OrdaKernelFields`), some of which override
loss keywords; a loss's options translate them (:mod:`orda_tp.orda_kernel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import check_flag, is_int
from .chunk_size import ChunkSize
from .orda_kernel import OrdaKernelFields

__all__ = ["HOST_WORKSPACE_MIB", "ChunkSize", "KernelConfig", "PROFILES"]

GRAD_WEIGHT_ACCUMULATIONS = ("auto", "compute", "fp32")
#: The default chunk workspace, in MiB, of a call whose tensors are not on a CUDA device.
HOST_WORKSPACE_MIB = 448


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, repr=False)  # OrdaKernelFields.__repr__: orda_tp's fields first
class KernelConfig(OrdaKernelFields):
    """Execution knobs of the chunked backends.

    - ``chunk_size``: rows per chunk (see :class:`ChunkSize`). A chunk keeps its fp32 logits
      (student and teacher); when a gradient is formed, the logit gradients of a group of chunks
      are staged for one pair of gradient GEMMs. Workspace: ``C·(R·8 + G·2)`` bytes for ``R`` rows
      per chunk, ``G`` per group and ``C`` local vocabulary columns (bf16 inputs, frozen teacher;
      fp32 staging: 4 bytes), e.g. 1024/4096 rows in 1957 MiB at V = 128256. Rows depend on the
      workspace, the vocabulary and the dtypes, never on a long batch's length (a batch shorter
      than a chunk is one chunk), unless ``num_chunks`` or ``max_chunks`` asks for it.
    - ``vocab_block``: columns per statistics block of the torch backend; the records of the blocks
      are merged exactly as the records of tensor-parallel shards are (the Triton kernels tile the
      columns themselves).
    - ``workspace_mib``: ``None`` (default): the workspace grows with the device
      (:func:`orda_tp.engine.row_groups.default_workspace_mib`: on CUDA 2048, 1024 or 512 MiB, the largest
      that is at most 1/16 of the free memory; elsewhere 448), and the layout is the measured
      fastest that fits it (:data:`orda_tp.engine.row_groups.LAYOUT_COSTS`), at least 256 rows
      per chunk; an int: the workspace in MiB, a hard cap, the fastest measured layout within it.
    - ``grad_weight_accumulation``: the dtype in which a head weight's gradient is summed over
      row groups: ``"fp32"`` (an fp32 buffer of the weight's size), ``"compute"`` (the weight's
      own dtype: no extra memory, one rounding per group), ``"auto"`` (``"compute"`` for bf16
      weights, ``"fp32"`` otherwise).
    - ``assume_valid_labels``: skip the range check of ``labels`` wherever it would run. A label
      outside ``[0, V)`` then gives a NaN row (never another class).
    - ``host_checks``: whether checks that read tensor values on the host run (the label range,
      a cached teacher's NaN/+inf): ``None`` runs them for CPU tensors only, where reading a value
      costs nothing; on CUDA they would synchronize with the device, so there a bad label or a
      non-finite cache shows as NaN rows instead (the ``debug`` profile sets True).
    - ``check_finite_inputs``: raise if a hidden state or weight holds NaN/inf instead of letting
      the affected rows come out NaN (the ``debug`` profile turns it on; it synchronizes).
    - ``num_chunks`` (keyword-only): split the rows into this many chunks (``ceil(rows /
      num_chunks)`` rows each); not with a ``ChunkSize`` that has ``nrows``.
    - ``max_chunks`` (keyword-only): at most this many chunks: the workspace's rows per chunk are
      raised to ``ceil(rows / max_chunks)`` where they would give more (no effect with ``nrows`` or
      ``num_chunks``). A row count asked for this way or by ``num_chunks`` is lowered to fit an
      explicit ``workspace_mib`` when ``chunk_size.dynamic``, as a given ``nrows`` is.

    How the chunking fields become rows per chunk and per group: ``orda_tp.engine.row_groups``.
    orda-kernel's other fields, keyword-only, come from :class:`~orda_tp.orda_kernel.OrdaKernelFields`.
    """

    chunk_size: ChunkSize = field(default_factory=ChunkSize)
    vocab_block: int = 8192
    workspace_mib: int | None = None
    grad_weight_accumulation: str = "auto"
    assume_valid_labels: bool = False
    host_checks: bool | None = None
    check_finite_inputs: bool = False
    num_chunks: int | None = field(default=None, kw_only=True)
    max_chunks: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        self._fill_orda_kernel_nones()
        _require(
            isinstance(self.chunk_size, ChunkSize),
            f"KernelConfig.chunk_size must be a ChunkSize, got {type(self.chunk_size).__name__}",
        )
        for name in ("assume_valid_labels", "check_finite_inputs"):
            check_flag(f"KernelConfig.{name}", getattr(self, name))
        if self.host_checks is not None:
            check_flag("KernelConfig.host_checks", self.host_checks)
        _require(
            self.grad_weight_accumulation in GRAD_WEIGHT_ACCUMULATIONS,
            f"KernelConfig.grad_weight_accumulation must be one of {GRAD_WEIGHT_ACCUMULATIONS}, "
            f"got {self.grad_weight_accumulation!r}",
        )
        for name in ("vocab_block", "workspace_mib"):
            value = getattr(self, name)
            if name == "workspace_mib" and value is None:
                continue
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"KernelConfig.{name} must be a positive int{' or None' if name == 'workspace_mib' else ''}, "
                f"got {value!r}",
            )
        for name in ("num_chunks", "max_chunks"):
            value = getattr(self, name)
            if value is not None:  # an int or e.g. a NumPy integer, kept as an int
                message = f"KernelConfig.{name} must be a positive int or None, got {value!r}"
                _require(is_int(value) and int(value) > 0, message)
                object.__setattr__(self, name, int(value))
        _require(
            self.num_chunks is None or self.chunk_size.nrows is None,
            f"KernelConfig.num_chunks={self.num_chunks} and chunk_size={self.chunk_size!r} both set the rows per "
            "chunk; give one of them (orda-kernel: chunk_size and num_chunks are mutually exclusive)",
        )
        self._check_orda_kernel_fields()


PROFILES: dict[str, KernelConfig] = {
    "balanced": KernelConfig(),
    "fast": KernelConfig(chunk_size=ChunkSize(fast=True), vocab_block=32768),
    "debug": KernelConfig(workspace_mib=4, vocab_block=1024, host_checks=True, check_finite_inputs=True),
}
