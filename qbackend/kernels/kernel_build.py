"""Compiling qbackend's C kernels once per machine, and loading only what this user built.

- The cache directory (``$QBACKEND_CACHE_DIR``, else ``~/.cache/qbackend``; a per-user
  temporary one where that cannot be made) is used only if it is a directory itself (not a
  symlink: ``lstat``), this user owns it and no one else can write it: else another local user
  could plant a library that runs in this process.
- A library is written under a name no other process or thread uses, flushed to disk, then
  renamed into place, with its SHA-256 beside it; a cached one loads only if both files are
  this user's and the bytes match the digest (a truncated library killed every process that
  loaded it with SIGBUS; an empty one disabled the kernels until deleted by hand).
- ``load`` runs the very file it checked: opened once without following symlinks, its owner
  and mode read from the open file, hashed from it and loaded through ``/proc/self/fd``, so
  no file put in its place between the check and the load runs.
- The key: the sources, the flags and the compiler as its ``--version`` names it (``$CC`` is
  split into words, as make does: ``ccache gcc``), so an upgraded compiler builds again.
- A wheel carries the libraries prebuilt (``setup.py`` runs ``build_prebuilt``, the flags name
  no CPU beyond the ISA the kernels check for at run time): they load first, where their key
  (sources and flags) and digest match and neither they nor their directory can be written by
  another user than this one or root; the build here is the fallback.

This module imports no torch: the package build loads it by path.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, NamedTuple, Optional

CSRC = Path(__file__).parent / "csrc"
PREBUILT = Path(__file__).parent / "prebuilt"
COMPILE_SECONDS = 300  # (one file: ~40 s on a quiet core; the bound is for a compiler that hangs)
log = logging.getLogger("qbackend")

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
# Two libraries: every kernel for AVX2, and the int8 conv kernels, attention and the weight-only
# kernels again for AVX512-VNNI (optional: a compiler without these flags or a CPU without VNNI
# leaves the AVX2 ones; the AVX512-BF16 kernel there checks its CPU and compiler itself).
VNNI_ONLY = (CSRC / "conv_gemm_int8_vnni.c", CSRC / "conv_gemm_int8_vnni512.c", CSRC / "conv_gemm_int8_amx.c",
             CSRC / "depthwise_conv_int8_vnni.c", CSRC / "depthwise_conv_int8_vnni512.c",
             CSRC / "stem_conv_int8_vnni.c", CSRC / "grouped_conv_int8_vnni.c", CSRC / "weight_only_bf16.c")
VNNI_SOURCES = VNNI_ONLY + (CSRC / "attention_f32.c", CSRC / "weight_only_int16.c", CSRC / "struct_layout.c")
SOURCES = tuple(sorted(set(CSRC.glob("*.c")) - set(VNNI_ONLY)))
VNNI_FLAGS = FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni")
LIBRARIES = {"qbackend_kernels": (SOURCES, FLAGS), "qbackend_vnni": (VNNI_SOURCES, VNNI_FLAGS)}


def cache_dir() -> Path:
    root = os.environ.get("QBACKEND_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qbackend"
    return Path(root)


MINE = (os.getuid(),)
ROOT_OR_MINE = (0, os.getuid())  # (a wheel installed by root)


def _safe(info: os.stat_result, owners: tuple) -> bool:
    return info.st_uid in owners and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def trusted(path: Path, owners: tuple = MINE) -> bool:
    """A directory or regular file itself (``lstat``: a symlink's target is not what a later
    open finds), owned by one of ``owners`` (this user) and writable by no one else."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)) and _safe(info, owners)


def _open_private(path: Path, owners: tuple = MINE) -> int:
    """A descriptor of ``path``, opened without following a symlink, once ``fstat`` shows a
    regular file of one of ``owners`` that no one else can write; OSError else. What was checked
    is then the open file itself, whatever is renamed into place later."""
    # (O_NONBLOCK: a FIFO put there must not hang the open)
    handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(handle)
        if not (stat.S_ISREG(info.st_mode) and _safe(info, owners)):
            raise OSError(f"{path} is not a regular file that only its owner ({info.st_uid}) can write")
    except BaseException:
        os.close(handle)
        raise
    return handle


def read_private(path: Path, most: int, owners: tuple = MINE) -> bytes:
    """The bytes of ``path`` (``_open_private``), at most ``most``; OSError else."""
    with os.fdopen(_open_private(path, owners), "rb") as file:
        data = file.read(most + 1)
    if len(data) > most:
        raise OSError(f"{path} holds more than {most} bytes")
    return data


def _sha256(handle: int) -> str:
    digest = hashlib.sha256()
    os.lseek(handle, 0, os.SEEK_SET)
    while chunk := os.read(handle, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _open_matching(library: Path, digest: str, owners: tuple = MINE) -> int:
    """``library`` opened (``_open_private``) when its bytes hash to ``digest``; OSError else."""
    handle = _open_private(library, owners)
    if _sha256(handle) != digest:
        os.close(handle)
        raise OSError(f"{library} is not the library built (its digest differs)")
    return handle


def kernel_dir(preferred: Path) -> Path:
    """``preferred``, or a per-user temporary directory where it cannot be made or is not
    trusted (a read-only home; a directory another user made first, or a symlink another user
    can point elsewhere once it was checked)."""
    for directory in (preferred, Path(tempfile.gettempdir()) / f"qbackend-{os.getuid()}"):
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if trusted(directory) and os.access(directory, os.W_OK):
            return directory
    raise RuntimeError(f"no directory for the compiled kernels that only this user can write ({preferred} or the "
                       "temporary directory)")


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[tuple[str, ...], str]:
    """(the command that compiles, what its ``--version`` says); RuntimeError if none runs."""
    words = tuple(shlex.split(os.environ.get("CC", ""))) or tuple(filter(None, [shutil.which("cc") or shutil.which("gcc")]))
    if not words:
        raise RuntimeError("no C compiler found (cc / gcc, or $CC)")
    try:
        version = subprocess.run([*words, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"running {' '.join(words)} failed: {error}") from None
    if version.returncode:
        raise RuntimeError(f"{' '.join(words)} --version failed: {(version.stderr or version.stdout).strip()[-200:]}")
    return words, version.stdout.strip()


@functools.lru_cache(maxsize=None)
def sources_digest() -> str:
    """A hash of every C file and header (the VNNI library includes the AVX2 one's source)."""
    return hashlib.sha256(b"".join(source.read_bytes() for source in sorted(CSRC.glob("*.[ch]")))).hexdigest()


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> Optional[int]:
    """An open descriptor of this user's library whose bytes match the digest written beside it
    when it was built, or None."""
    try:
        return _open_matching(library, read_private(_digest_file(library), 256).decode().strip())
    except (OSError, ValueError):  # (ValueError: a digest file that is not text)
        return None


def _write_durably(directory: Path, prefix: str, suffix: str, write) -> Path:
    """A new file in ``directory`` filled by ``write(path)``, flushed to disk; its unique name."""
    handle, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    os.close(handle)
    try:
        write(Path(name))
        with open(name, "rb") as written:
            os.fsync(written.fileno())
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def _run_compiler(words: tuple, arguments: list) -> None:
    try:
        done = subprocess.run([*words, *arguments], capture_output=True, text=True, timeout=COMPILE_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"running {' '.join(words)} failed: {error}") from None
    if done.returncode:
        raise RuntimeError(f"{' '.join(words)} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")


def _compile(words: tuple, sources: tuple, flags: tuple, path: Path) -> None:
    """``sources`` compiled one object each, as many at once as this process may use CPUs (the
    AVX512 GEMM alone takes 24 of the 81 s one core spends on both libraries), then linked."""
    object_flags = [flag for flag in flags if flag != "-shared"]
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".objects-") as objects:
        outputs = [Path(objects) / f"{index}-{source.stem}.o" for index, source in enumerate(sources)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(sources), len(os.sched_getaffinity(0))))) as pool:
            for done in [pool.submit(_run_compiler, words, [*object_flags, "-c", str(source), "-o", str(output)])
                         for source, output in zip(sources, outputs)]:
                done.result()
        _run_compiler(words, [*flags, *map(str, outputs), "-o", str(path)])


def _prebuilt_key(sources: tuple, flags: tuple) -> str:
    return hashlib.sha256("\n".join((sources_digest(), *(s.name for s in sources), " ".join(flags))).encode()).hexdigest()


def build_prebuilt(directory: Path) -> list[Path]:
    """Compile every library of ``LIBRARIES`` into ``directory`` with the key and digest
    ``prebuilt`` checks (the package build calls this). RuntimeError when one cannot be built."""
    words, _ = compiler()
    directory.mkdir(parents=True, exist_ok=True)
    built = []
    for name, (sources, flags) in LIBRARIES.items():
        library = directory / f"{name}.so"
        _compile(words, sources, flags, library)
        digest = hashlib.sha256(library.read_bytes()).hexdigest()
        _digest_file(library).write_text(f"{_prebuilt_key(sources, flags)} {digest}\n")
        library.chmod(0o755)  # (a umask of 002 made them group-writable: never loaded)
        _digest_file(library).chmod(0o644)
        built.append(library)
    return built


class Built(NamedTuple):
    path: Path
    handle: int  # open: the file whose owner, mode and digest were checked


def prebuilt(name: str, sources: tuple, flags: tuple) -> Optional[Built]:
    """The library the wheel carries for these sources and flags, or None (none shipped, other
    sources or flags, bytes not the ones built, it or its directory writable by another user
    than this one or root, or a symlink)."""
    library = PREBUILT / f"{name}.so"
    if not (trusted(PREBUILT.parent, ROOT_OR_MINE) and trusted(PREBUILT, ROOT_OR_MINE)):
        return None
    try:
        key, digest = read_private(_digest_file(library), 256, ROOT_OR_MINE).decode().split()
        return Built(library, _open_matching(library, digest, ROOT_OR_MINE)) if key == _prebuilt_key(sources, flags) else None
    except (OSError, ValueError):
        return None


def _built(name: str, sources: tuple, flags: tuple) -> Built:
    """``build``'s library, open."""
    shipped = prebuilt(name, sources, flags)
    if shipped is not None:
        return shipped
    words, version = compiler()
    key = hashlib.sha256("\n".join((sources_digest(), " ".join(words), version, " ".join(flags))).encode()).hexdigest()
    directory = kernel_dir(cache_dir())
    target = directory / f"{name}-{key[:16]}.so"
    cached = _intact(target)
    if cached is not None:
        return Built(target, cached)
    with _build_lock(directory / f".{target.stem}.lock"):
        cached = _intact(target)  # (built by the process this one waited for)
        return Built(target, cached) if cached is not None else _compile_and_place(name, words, sources, flags, directory, target)


@contextlib.contextmanager
def _build_lock(path: Path):
    """One build at a time of a library: processes started together (pytest's workers, a
    server's) had each compiled it, 4 compilers on 2 cores, until one file passed
    COMPILE_SECONDS and the kernels were left out. The others wait here, then load its build."""
    handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # (releases the lock)


def _compile_and_place(name: str, words: tuple, sources: tuple, flags: tuple, directory: Path, target: Path) -> Built:
    """``sources`` compiled into ``target`` in ``directory``, its digest beside it; the library open."""
    # (a warning: the one-time build is a pause of up to a minute in a user's first compile, which
    # no log level showed; Python prints warnings without any logging set up)
    log.warning("qbackend: compiling its C kernels (%s) for this machine with %s (once, 15-80 s on 2 cores; later processes "
                "load them from %s; to warm a container image: python -m qbackend warm)", name, words[0], directory)
    started = time.monotonic()
    library = _write_durably(directory, f".{target.stem}-", ".partial.so", lambda path: _compile(words, sources, flags, path))
    log.info("qbackend: %s compiled in %.0f s", name, time.monotonic() - started)
    try:
        os.chmod(library, 0o700)  # (whatever mode the compiler gave it: only this user's to write)
        handle = _open_private(library)
    except OSError:
        os.unlink(library)
        raise
    try:
        _place(directory, library, target, _sha256(handle))
    except BaseException:
        os.close(handle)
        raise
    return Built(target, handle)


def _place(directory: Path, library: Path, target: Path, digest: str) -> None:
    """The compiled ``library`` renamed to ``target``, ``digest`` beside it, durably."""
    digest_file = _write_durably(directory, f".{target.stem}-", ".partial.sha256", lambda path: path.write_text(digest))
    os.replace(library, target)  # (the library first: a digest never vouches for bytes not yet in place)
    os.replace(digest_file, _digest_file(target))
    directory_handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_handle)  # (the renames too)
    finally:
        os.close(directory_handle)


def build(name: str, sources: Iterable[Path], flags: tuple) -> Path:
    """The shared library for these sources and flags: the wheel's prebuilt one, else one built
    here by this compiler (compiled if no intact one is cached). RuntimeError with the reason
    when it cannot be built. To run it, ``load``: the path opened again may be another file."""
    built = _built(name, tuple(sources), flags)
    os.close(built.handle)
    return built.path


def load(name: str, sources: Iterable[Path], flags: tuple) -> ctypes.CDLL:
    """``build``'s library, loaded from the very file whose owner, mode and digest were checked
    (``/proc/self/fd``). RuntimeError when it cannot be built, OSError when it does not load."""
    built = _built(name, tuple(sources), flags)
    try:
        # (the descriptor stays open while the process runs: glibc returns a library already
        # loaded under the same name, so its number, closed and reused, would load this one again)
        return ctypes.CDLL(f"/proc/self/fd/{built.handle}")
    except OSError as error:
        os.close(built.handle)
        raise OSError(f"{built.path} did not load: {error}") from None
