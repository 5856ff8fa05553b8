"""Generated kernel modules (:mod:`.variant_terms`), run from their text in memory under a
pseudo-filename that :mod:`linecache` serves; a file is written only under
``ORDA_TP_KERNEL_CACHE``, and what runs is never read from it (docs/architecture.md, "The kernel
cache").
"""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import re
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["CACHE_ENV", "PSEUDO_FILENAME", "kernel_cache_dir", "load_generated_module"]

CACHE_ENV = "ORDA_TP_KERNEL_CACHE"
PSEUDO_FILENAME = "<orda_tp generated {}.py>"  # a name in angle brackets: linecache never looks on disk for it
DIGEST_CHARS = 12  # of the SHA-256, in a module's file name
STEM = re.compile(r"[A-Za-z0-9_]{1,64}")

_MODULES: dict[str, ModuleType] = {}  # the modules executed in this process, by the SHA-256 of their text


def kernel_cache_dir() -> Path | None:
    """The directory that ``$ORDA_TP_KERNEL_CACHE`` names, made absolute; None when it is unset or
    empty (the default: no file is written)."""
    directory = os.environ.get(CACHE_ENV)
    return Path(os.path.abspath(directory)) if directory else None


def load_generated_module(text: str, stem: str) -> ModuleType:
    """The module that ``text`` defines, executed from ``text`` itself once per process under
    ``STEM_HASH`` (``stem``: 1 to 64 letters, digits or underscores; ``HASH``: the first 12 hex
    digits of the text's SHA-256), and written to the kernel cache directory when one is set."""
    if not STEM.fullmatch(stem):
        raise ValueError(f"a kernel cache file stem is 1 to 64 letters, digits or underscores, got {stem!r}")
    digest = hashlib.sha256(text.encode()).hexdigest()
    module = _MODULES.get(digest)
    if module is None:
        name = f"{stem}_{digest[:DIGEST_CHARS]}"
        directory = kernel_cache_dir()
        if directory is None:
            filename = PSEUDO_FILENAME.format(name)
        else:
            path = directory / f"{name}.py"
            _write_atomically(path, text.encode())
            filename = str(path)
        module = _execute(text, filename, f"orda_tp_generated_{name}")
        _MODULES[digest] = module
    return module


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a unique ``0o600`` temporary file beside ``path``, then move it over
    ``path`` (replacing a link there, never writing through it)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a missing directory: this user's alone
    # Beside the target: os.replace is atomic only within one file system.
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        # Atomic: ranks writing one file at once each leave it whole, and a link there is replaced.
        os.replace(temporary, path)
    # Also on KeyboardInterrupt: no temporary file is left behind.
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _execute(text: str, filename: str, name: str) -> ModuleType:
    """Run ``text`` as module ``name`` whose source file is ``filename``. The linecache entry has
    no modification time, so ``linecache.checkcache`` keeps it and ``inspect.getsource`` returns
    ``text`` whatever is (or is not) on disk under ``filename``."""
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    exec(compile(text, filename, "exec"), module.__dict__)
    return module
