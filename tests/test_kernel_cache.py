"""The kernel cache (``orda_tp.kernels.cache``): generated modules run from their text in memory and,
by default, write no file; with ``ORDA_TP_KERNEL_CACHE`` set they are also written there, and what
runs is still the text in memory, never what another writer left on disk.

Every test starts with an empty in-process module table and points ``ORDA_TP_KERNEL_CACHE`` (or,
for the default path, ``HOME`` and ``XDG_CACHE_HOME``) into ``tmp_path``, so the real home is never
touched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import linecache
import multiprocessing
import os
import py_compile
import stat
import subprocess
import sys
import warnings
from multiprocessing.synchronize import Barrier
from pathlib import Path
from types import ModuleType

import pytest
import torch

from orda_tp.kernels import cache
from orda_tp.kernels.cache import CACHE_ENV, kernel_cache_dir, load_generated_module

REPO_ROOT = Path(__file__).resolve().parent.parent
TEXT = 'VALUE = "verified"\n\n\ndef double(x):\n    return 2 * x\n'
STEM = "example"
TAMPERED = "tampered by another writer"


@pytest.fixture
def cache_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A kernel cache directory (not yet created) under ``tmp_path``, with no module loaded yet."""
    path = tmp_path / "kernels"
    monkeypatch.setenv(CACHE_ENV, str(path))
    monkeypatch.setattr(cache, "_MODULES", {})
    return path


@pytest.fixture
def no_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default path: ``ORDA_TP_KERNEL_CACHE`` unset, the home and cache home an empty
    ``tmp_path / "home"`` (not created), no module loaded yet."""
    home = tmp_path / "home"
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setattr(cache, "_MODULES", {})
    return home


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def planted_code(marker: Path) -> str:
    """Code that leaves ``marker`` behind if it ever runs."""
    return f'\nopen({str(marker)!r}, "w").write("planted")\nVALUE = {TAMPERED!r}\n'


def only_cached_file(directory: Path) -> Path:
    [path] = directory.glob(f"{STEM}_*.py")
    return path


def reload_text() -> ModuleType:
    """Load ``TEXT`` again as a new process would (the in-process module table emptied first)."""
    cache._MODULES.clear()
    return load_generated_module(TEXT, STEM)


def test_the_default_path_runs_a_module_from_memory_and_writes_no_file(no_cache_dir: Path, tmp_path: Path) -> None:
    module = load_generated_module(TEXT, STEM)
    filename = f"<orda_tp generated {STEM}_{hashlib.sha256(TEXT.encode()).hexdigest()[:12]}.py>"
    assert module.VALUE == "verified" and module.double(3) == 6
    assert module.__file__ == filename
    assert linecache.getlines(filename) == TEXT.splitlines(keepends=True)
    assert inspect.getsource(module.double) == "def double(x):\n    return 2 * x\n"
    assert kernel_cache_dir() is None
    assert load_generated_module(TEXT, STEM) is module
    assert list(tmp_path.iterdir()) == []  # not even the home directory


def test_a_module_runs_from_a_private_content_addressed_file(cache_path: Path) -> None:
    module = load_generated_module(TEXT, STEM)
    path = only_cached_file(cache_path)
    assert module.VALUE == "verified" and module.double(3) == 6
    assert module.__file__ == str(path) and path.read_text() == TEXT
    assert mode(cache_path) == 0o700 and mode(path) == 0o600
    assert load_generated_module(TEXT, STEM) is module
    assert [p.name for p in cache_path.iterdir()] == [path.name]  # no temporary file left behind


def test_file_names_say_what_they_hold_and_the_hash_of_their_text(cache_path: Path) -> None:
    """``<stem>_<the first 12 hex digits of the text's SHA-256>.py``; another text under the same
    stem is another file, and a stem is letters, digits and underscores only."""
    load_generated_module(TEXT, "sums_terms_reverse")
    load_generated_module(TEXT + "# another text\n", "sums_terms_reverse")
    digests = [hashlib.sha256(text.encode()).hexdigest()[:12] for text in (TEXT, TEXT + "# another text\n")]
    assert sorted(p.name for p in cache_path.iterdir()) == sorted(f"sums_terms_reverse_{d}.py" for d in digests)
    for stem in ("", "../escape", "with space", "dots.py", "x" * 65):
        with pytest.raises(ValueError, match="kernel cache file stem"):
            load_generated_module(TEXT, stem)


@pytest.mark.parametrize("tamper", ["append", "truncate", "loosen"])
def test_a_tampered_cached_file_is_not_executed_and_is_rewritten(cache_path: Path, tmp_path: Path, tamper: str) -> None:
    """A file changed after it was written (or left writable by others) is never what runs, and a
    new process writes the text again."""
    load_generated_module(TEXT, STEM)
    path = only_cached_file(cache_path)
    marker = tmp_path / "marker"
    if tamper == "append":
        with path.open("a") as file:
            file.write(planted_code(marker))
    elif tamper == "truncate":
        path.write_text(TEXT[: len(TEXT) // 2])
    else:  # the right text, but a file others may write
        os.chmod(path, 0o666)
    module = reload_text()
    assert not marker.exists()
    assert module.VALUE == "verified"
    assert path.read_text() == TEXT and mode(path) == 0o600


def test_a_symlinked_cached_file_is_replaced_not_followed(cache_path: Path, tmp_path: Path) -> None:
    load_generated_module(TEXT, STEM)
    path = only_cached_file(cache_path)
    marker = tmp_path / "marker"
    victim = tmp_path / "victim.py"
    victim.write_text(planted_code(marker))
    path.unlink()
    path.symlink_to(victim)
    module = reload_text()
    assert not marker.exists() and module.VALUE == "verified"
    assert not path.is_symlink() and path.read_text() == TEXT
    assert victim.read_text() == planted_code(marker)  # nothing written through the link


def test_a_planted_bytecode_file_is_never_imported(cache_path: Path, tmp_path: Path) -> None:
    """An unchecked-hash ``.pyc`` beside the source is what ``import`` would run without looking
    at the source; the loader never imports, so it is ignored (and raises no warning)."""
    load_generated_module(TEXT, STEM)
    path = only_cached_file(cache_path)
    marker = tmp_path / "marker"
    planted = tmp_path / "planted.py"
    planted.write_text(planted_code(marker))
    py_compile.compile(
        str(planted),
        cfile=importlib.util.cache_from_source(str(path)),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        doraise=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = reload_text()
    assert not marker.exists() and module.VALUE == "verified"


SCALE_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=ok) * 0.375, mask=ok)
"""


def run_scale_kernel(module: ModuleType) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(device)
    expected = values * 0.375
    module.scale_kernel[(3,)](values, values.numel(), BLOCK=128)
    torch.testing.assert_close(values, expected, rtol=0.0, atol=0.0)


def test_triton_runs_a_generated_kernel_that_has_no_file(no_cache_dir: Path, tmp_path: Path) -> None:
    """``@triton.jit`` reads its source through ``inspect``/``linecache`` (under the interpreter, at
    the first launch), which hold the text under its pseudo-filename: no file is needed."""
    module = load_generated_module(SCALE_KERNEL, "scale_example")
    assert module.__file__ is not None and not os.path.exists(module.__file__)
    run_scale_kernel(module)
    assert list(tmp_path.iterdir()) == []


def test_triton_compiles_the_verified_text_even_if_the_file_changes_after_loading(cache_path: Path) -> None:
    """With a kernel cache directory, Triton must still see the text in memory, not a file edited
    after it was written."""
    module = load_generated_module(SCALE_KERNEL, "scale_example")
    [path] = cache_path.glob("scale_example_*.py")
    path.write_text(SCALE_KERNEL.replace("* 0.375", "* 0.375 + 1000.0"))
    run_scale_kernel(module)


def _load_each_text_together(barrier: Barrier, texts: list[str]) -> None:
    """Child process: load every text at the same moment as the other children, then again as a
    new process would while they may still be writing; any warning (a partly written file seen)
    fails the child."""
    warnings.simplefilter("error")
    try:
        for text in texts:
            barrier.wait(timeout=60)
            for _ in range(5):
                cache._MODULES.clear()
                assert load_generated_module(text, "concurrent").VALUE == int(text.split()[2])
    except BaseException:
        barrier.abort()  # the other children stop at their next wait instead of timing out
        raise


def test_processes_writing_one_file_at_once_each_leave_it_complete(cache_path: Path) -> None:
    """Ranks of one machine write the same files at once: a write in place would let a child read
    a partial file, a shared temporary name would let one child move another's file away."""
    texts = [f"VALUE = {index}\n" + "# padding, so that the writes overlap\n" * 5000 for index in range(40)]
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    children = [context.Process(target=_load_each_text_together, args=(barrier, texts)) for _ in range(4)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
    assert [child.exitcode for child in children] == [0] * 4
    files = sorted(cache_path.iterdir())
    assert len(files) == len(texts) and all(path.suffix == ".py" for path in files)
    assert sorted(path.read_text() for path in files) == sorted(texts)


LOSS_SCRIPT = """
import torch
import orda_tp
from tests.support.cases import make_problem, relative_error

p = make_problem(rows=6, vocab=40).to(torch.float32)
kwargs = dict(kl_weight=1.0, teacher_ce_weight=0.5, kl_divergence="forward")
teacher = orda_tp.TiedTeacher(p.teacher_hidden)
out = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, backend="triton", **kwargs)
ref = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, backend="reference", **kwargs)
print(relative_error(out.loss, ref.loss))
"""


def run_loss_in_a_fresh_process() -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "TRITON_INTERPRET": "1"}  # CACHE_ENV: the cache_path fixture's
    return subprocess.run(
        [sys.executable, "-c", LOSS_SCRIPT], cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=300
    )


def test_a_fresh_process_runs_correct_kernels_from_a_tampered_cache(cache_path: Path, tmp_path: Path) -> None:
    first = run_loss_in_a_fresh_process()
    assert first.returncode == 0, first.stderr
    files = sorted(cache_path.glob("*.py"))
    assert files, "the triton backend wrote no kernel source"
    originals = [path.read_text() for path in files]
    marker = tmp_path / "marker"
    for path in files:
        with path.open("a") as file:
            file.write(planted_code(marker))
    second = run_loss_in_a_fresh_process()
    assert second.returncode == 0, second.stderr
    assert not marker.exists()
    assert float(second.stdout.split()[-1]) <= 1e-5
    assert [path.read_text() for path in files] == originals
