"""How many rows one chunk of the loss processes: :class:`ChunkSize`, with orda-kernel's
constructors (``ChunkSize.nrows(n)``, ``.dynamic()``, ``.fast()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .checks import check_flag

__all__ = ["ChunkSize"]


@dataclass(frozen=True)
class ChunkSize:
    """How many rows (tokens) one chunk of the loss processes at a time.

    - ``nrows``: a fixed row count per chunk (``None``: from the workspace, see
      :class:`KernelConfig`).
    - ``dynamic``: when True, a given ``nrows`` is lowered where one chunk's workspace would exceed
      an explicit ``KernelConfig.workspace_mib``; when False it is used as is.
    - ``fast``: trade memory for speed: four times the workspace and the minimum rows (fewer,
      larger GEMMs and launches).

    orda-kernel's constructors share these names; on the class they construct (on an instance the
    names read the fields):

    - ``ChunkSize.nrows(n)``: exactly ``n`` rows per chunk, ``ChunkSize(nrows=n, dynamic=False)``;
    - ``ChunkSize.dynamic()``: rows from the workspace, ``ChunkSize()``;
    - ``ChunkSize.fast()``: ``ChunkSize(fast=True)``.
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

    # orda-kernel's read-only properties.
    @property
    def is_dynamic(self) -> bool:
        """orda-kernel's reading: the rows per chunk are chosen for the call (no ``nrows``, not
        ``fast``). Not the ``dynamic`` field, which only matters with an ``nrows``."""
        return self.nrows is None and not self.fast

    @property
    def is_fast(self) -> bool:
        """orda-kernel's reading of ``fast``."""
        return self.fast

    @property
    def value(self) -> int:
        """orda-kernel's reading: the fixed ``nrows`` (``TypeError`` when there is none)."""
        if self.nrows is None:
            raise TypeError(f"{self!r} has no nrows value")
        return self.nrows


class _ClassConstructor:
    """A :class:`ChunkSize` field name that is also an orda-kernel constructor: read on the class
    it is the constructor (``ChunkSize.nrows(512)``); an instance keeps its fields in its
    ``__dict__``, which a descriptor without ``__set__`` does not shadow
    (``ChunkSize(nrows=512).nrows == 512``)."""

    def __init__(self, build: Callable[..., ChunkSize]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    def __get__(self, instance: object, owner: type | None = None) -> Callable[..., ChunkSize]:
        return self.build


def _exact_rows(n: int) -> ChunkSize:
    """``ChunkSize.nrows(n)``: exactly ``n`` rows per chunk (at most the call's rows), never
    lowered to fit a workspace: ``ChunkSize(nrows=n, dynamic=False)``."""
    return ChunkSize(nrows=n, dynamic=False)


def _workspace_rows() -> ChunkSize:
    """``ChunkSize.dynamic()``: rows per chunk from the workspace: ``ChunkSize()``."""
    return ChunkSize()


def _fast_rows() -> ChunkSize:
    """``ChunkSize.fast()``: four times the workspace and the minimum rows: ``ChunkSize(fast=True)``."""
    return ChunkSize(fast=True)


# Installed after @dataclass, which would otherwise read them as the fields' default values. The
# class attribute becomes a descriptor while the instances keep the fields' types, which mypy
# cannot express: hence the ignores.
ChunkSize.nrows = _ClassConstructor(_exact_rows)  # type: ignore[assignment]
ChunkSize.dynamic = _ClassConstructor(_workspace_rows)  # type: ignore[assignment]
ChunkSize.fast = _ClassConstructor(_fast_rows)  # type: ignore[assignment]
