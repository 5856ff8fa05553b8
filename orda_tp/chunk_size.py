"""How many rows one chunk of the loss processes: :class:`ChunkSize`."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_flag
from .orda_kernel import ChunkSizeSpellings, chunk_size_constructors

__all__ = ["ChunkSize"]


@chunk_size_constructors
@dataclass(frozen=True)
class ChunkSize(ChunkSizeSpellings):
    """How many rows (tokens) one chunk of the loss processes at a time.

    - ``nrows``: a fixed row count per chunk (``None``: from the workspace, see
      :class:`~orda_tp.config.KernelConfig`).
    - ``dynamic``: when True, a given ``nrows`` is lowered where one chunk's workspace would exceed
      an explicit ``KernelConfig.workspace_mib``; when False it is used as is.
    - ``fast``: trade memory for speed: four times the workspace and the minimum rows (fewer,
      larger GEMMs and launches).

    orda-kernel's constructors share these names: read on the class they construct
    (``ChunkSize.nrows(n)``, ``.dynamic()``, ``.fast()``), read on an instance they are the fields
    (:mod:`orda_tp.orda_kernel`).
    """

    nrows: int | None = None
    dynamic: bool = True
    fast: bool = False

    def __post_init__(self) -> None:
        check_flag("ChunkSize.dynamic", self.dynamic)
        check_flag("ChunkSize.fast", self.fast)
        if self.nrows is not None:
            if not (isinstance(self.nrows, int) and not isinstance(self.nrows, bool) and self.nrows > 0):
                raise ValueError(f"ChunkSize.nrows must be a positive int or None, got {self.nrows!r}")
