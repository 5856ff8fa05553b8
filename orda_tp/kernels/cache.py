"""A private per-user directory for generated kernel sources, and modules run from verified text.

Triton reads a ``@triton.jit`` function's source through ``inspect.getsource``, so each generated
module (:mod:`.variant_terms`) is kept as a real file in the kernel cache, named by what it holds
and the first 12 hex digits of its text's SHA-256 (``<hash>``): ``sums_terms_reverse_<hash>.py``,
``grads_student_reverse_<hash>.py``, ``rows_m0_m1_z0_z1_s_y_t_y_hits_<hash>.py``.

- **Location.** ``$ORDA_TP_KERNEL_CACHE`` when set, else ``$XDG_CACHE_HOME/orda_tp/kernels``
  (``~/.cache/orda_tp/kernels`` without an absolute ``XDG_CACHE_HOME``). Directories that do not
  exist are created with mode ``0o700`` (owner only).
- **Permission policy.** The cache directory must be a real directory (a symbolic link is not
  followed), owned by this user and writable by no one else; otherwise loading raises
  :class:`PermissionError` (:class:`NotADirectoryError` for a file) naming the directory and the
  fix. An existing directory is never chmod-ed: one that others can write may already hold their
  files, and loosening it may have been the user's choice, so tightening is left to the user.
- **Verification.** The module executed is always the text in memory: compiled with the file's
  path as its filename, its lines placed in :mod:`linecache` so that ``inspect.getsource`` (and so
  Triton) reads that same text. Nothing is imported from the file or from ``__pycache__``. The file
  is rewritten when it is missing, or is not a regular file of this user's, writable by no one
  else, holding exactly that text; the latter with a :class:`RuntimeWarning`, since complete
  atomic writes never leave such a file behind. Writes go to a uniquely named ``0o600`` temporary
  file in the cache directory, moved into place with ``os.replace``, so processes that write the
  same file at once (the ranks of one machine) each leave a complete file.

The directory's parents are trusted, as for any file under one's home.
"""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import re
import stat
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

__all__ = ["CACHE_ENV", "kernel_cache_dir", "load_generated_module"]

CACHE_ENV = "ORDA_TP_KERNEL_CACHE"
PRIVATE_DIR_MODE = 0o700
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH

_MODULES: dict[str, ModuleType] = {}  # the modules executed in this process, by the SHA-256 of their text
DIGEST_CHARS = 12  # of the SHA-256, in a file name
STEM = re.compile(r"[A-Za-z0-9_]{1,64}")


def _location() -> Path:
    """Where the kernel cache lives: ``$ORDA_TP_KERNEL_CACHE``, else the user's cache home."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(os.path.abspath(override))
    xdg_cache = os.environ.get("XDG_CACHE_HOME", "")
    cache_home = Path(xdg_cache) if os.path.isabs(xdg_cache) else Path.home() / ".cache"
    return cache_home / "orda_tp" / "kernels"


def kernel_cache_dir() -> Path:
    """The kernel cache directory, its missing parts created with mode ``0o700``; raises
    :class:`PermissionError` if it is a symbolic link, someone else's, or writable by others
    (:class:`NotADirectoryError` if it is a file)."""
    path = _location()
    _make_private_dirs(path)
    _check_private_dir(path)
    return path


def _make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents with mode ``0o700`` (another process may be
    creating them at the same time)."""
    missing = []
    for part in (path, *path.parents):
        if os.path.lexists(part):
            break
        missing.append(part)
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, PRIVATE_DIR_MODE)


def _check_private_dir(path: Path) -> None:
    """Raise unless ``path`` itself (not a link's target) is a directory of this user's that
    group and others cannot write; the message names the directory, the problem and the fix."""
    info = os.lstat(path)
    fix = f"set {CACHE_ENV} to a directory of your own (a missing one is created with mode 0o700)"
    if stat.S_ISLNK(info.st_mode):
        raise PermissionError(
            f"kernel cache directory {path} is a symbolic link, which is not followed; remove it or {fix}"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"kernel cache directory {path} is not a directory; remove it or {fix}")
    if info.st_uid != os.geteuid():
        raise PermissionError(
            f"kernel cache directory {path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}); {fix}"
        )
    if info.st_mode & WRITABLE_BY_OTHERS:
        raise PermissionError(
            f"kernel cache directory {path} is writable by group or others "
            f"(mode {oct(stat.S_IMODE(info.st_mode))}); run `chmod 700 {path}` or {fix}"
        )


def load_generated_module(text: str, stem: str) -> ModuleType:
    """The module that ``text`` defines, executed from ``text`` itself (once per process) after
    ``<kernel cache>/<stem>_<hash>.py`` was checked to hold exactly ``text`` or rewritten.
    ``stem`` says what the module holds: letters, digits and underscores, at most 64."""
    if not STEM.fullmatch(stem):
        raise ValueError(f"a kernel cache file stem is 1 to 64 letters, digits or underscores, got {stem!r}")
    data = text.encode()
    digest = hashlib.sha256(data).hexdigest()
    module = _MODULES.get(digest)
    if module is None:
        name = f"{stem}_{digest[:DIGEST_CHARS]}"
        path = kernel_cache_dir() / f"{name}.py"
        _store(path, data)
        module = _execute(text, path, f"orda_tp_generated_{name}")
        _MODULES[digest] = module
    return module


def _store(path: Path, data: bytes) -> None:
    """Leave ``data`` at ``path`` as a private regular file, rewriting whatever else is there."""
    present = os.path.lexists(path)
    if present and _private_file_bytes(path) == data:
        return
    if present:
        warnings.warn(
            f"kernel cache file {path} did not hold the generated source it is named after (modified, "
            "truncated, a link or not private); it was not executed and has been rewritten",
            RuntimeWarning,
            stacklevel=3,
        )
    _write_atomically(path, data)


def _private_file_bytes(path: Path) -> bytes | None:
    """``path``'s content if it is a regular file of this user's that no one else can write, else
    None (missing, a symbolic link, a FIFO or someone else's file: nothing is read through it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & WRITABLE_BY_OTHERS:
            return None
        return file.read()


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a unique ``0o600`` temporary file beside ``path``, then move it over
    ``path`` (replacing a link there, never writing through it)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _execute(text: str, path: Path, name: str) -> ModuleType:
    """Run ``text`` as module ``name`` whose source file is ``path``. The linecache entry has no
    modification time, so ``linecache.checkcache`` keeps it and ``inspect.getsource`` returns
    ``text`` even if the file changes afterwards."""
    filename = str(path)
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    exec(compile(text, filename, "exec"), module.__dict__)
    return module
