"""qbackend.kernels.kernel_build: the kernels' library is built once, and only this user's intact build loads."""
import ctypes
import os
import subprocess
import sys
import threading

import pytest

from qbackend.kernels import isa, kernel_build, registry
from qbackend.kernels import library

SOURCE = "int qb_answer(void) { return 42; }\n"
FLAGS = ("-O1", "-shared", "-fPIC")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QBACKEND_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    return tmp_path / "cache", source


def _answer(library) -> int:
    return ctypes.CDLL(str(library)).qb_answer()


def _intact(library) -> bool:
    handle = kernel_build._intact(library)
    if handle is not None:
        os.close(handle)
    return handle is not None


def test_a_blocked_or_foreign_cache_directory_gives_a_private_temporary_one(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    private = tmp_path / "tmp" / f"qbackend-{os.getuid()}"
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a directory below a file cannot be made, even by root
    assert kernel_build.kernel_dir(blocked / "qbackend") == private
    assert oct(private.stat().st_mode & 0o777) == oct(0o700)
    assert kernel_build.kernel_dir(tmp_path / "cache") == tmp_path / "cache"
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # (mkdir's mode passes through the umask)
    assert kernel_build.kernel_dir(shared) == private  # another user could plant a library there
    private.chmod(0o775)
    with pytest.raises(RuntimeError, match="that only this user can write"):
        kernel_build.kernel_dir(blocked / "qbackend")


def test_a_damaged_or_writable_library_is_built_again_not_loaded(cache):
    directory, source = cache
    library = kernel_build.build("answer", [source], FLAGS)
    assert library.parent == directory and _answer(library) == 42
    built = library.read_bytes()
    assert [p.name for p in directory.iterdir() if "partial" in p.name] == []  # (nothing half-written left)
    assert kernel_build.build("answer", [source], FLAGS) == library  # cached: not compiled again
    def replaced_by(data: bytes):  # (a new file, as an interrupted build leaves one: this process maps the old one,
        staged = library.with_suffix(".staged")  # and truncating a mapped library in place is SIGBUS here too)
        staged.write_bytes(data)
        os.replace(staged, library)

    for damage in (lambda: replaced_by(built[: len(built) // 2]),  # torn: SIGBUS if loaded
                   lambda: replaced_by(b""),
                   lambda: library.chmod(0o666),
                   lambda: (library.parent / (library.name + ".sha256")).unlink()):
        damage()
        assert not _intact(library)
        assert kernel_build.build("answer", [source], FLAGS) == library
        assert _intact(library) and library.read_bytes() == built


def test_cc_is_split_into_words_and_the_compiler_version_is_in_the_key(cache, monkeypatch):
    _, source = cache
    compiler = kernel_build.compiler
    compiler.cache_clear()
    try:
        monkeypatch.setenv("CC", "env cc")  # (a wrapper before the compiler, as "ccache gcc")
        words, version = kernel_build.compiler()
        assert words == ("env", "cc") and version
        first = kernel_build.build("answer", [source], FLAGS)
        assert _answer(first) == 42
        monkeypatch.setattr(kernel_build, "compiler", lambda: (words, version + " (upgraded)"))
        assert kernel_build.build("answer", [source], FLAGS) != first
    finally:
        compiler.cache_clear()  # (the next build asks the real $CC again)


BUILD_BY_PATH = """
import importlib.util, pathlib, sys
spec = importlib.util.spec_from_file_location("kernel_build", sys.argv[1])
kernel_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_build)
print(kernel_build.build("answer", [pathlib.Path(sys.argv[2])], ("-O1", "-shared", "-fPIC")))
"""


def test_processes_building_at_once_compile_once(cache, tmp_path):
    """pytest's workers, a server's processes: one compiles, the others wait and load its build
    (each compiling had put 4 compilers on 2 cores and passed the compile timeout)."""
    directory, source = cache
    calls = tmp_path / "calls"
    slow_cc = tmp_path / "slow-cc"  # (1 s a call: every process asks before the first build is done)
    slow_cc.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nsleep 1\nexec cc \"$@\"\n")
    slow_cc.chmod(0o755)
    env = dict(os.environ, QBACKEND_CACHE_DIR=str(directory), CC=str(slow_cc))
    processes = [subprocess.Popen([sys.executable, "-c", BUILD_BY_PATH, kernel_build.__file__, str(source)], env=env,
                                  stdout=subprocess.PIPE, text=True) for _ in range(3)]
    paths = {process.communicate(timeout=120)[0].strip() for process in processes}
    assert [process.returncode for process in processes] == [0, 0, 0]
    assert len(paths) == 1 and _answer(paths.pop()) == 42
    compiles = [line for line in calls.read_text().splitlines() if "--version" not in line]
    assert len(compiles) == 2, compiles  # one compile and one link in all


def test_threads_loading_at_once_load_once():
    calls = []
    barrier = threading.Barrier(8)

    @library.once
    def load():
        calls.append(1)
        return object()

    results = []

    def worker():
        barrier.wait()
        results.append(load())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1


@pytest.fixture
def switch(monkeypatch):
    """Sets $QBACKEND_KERNELS for this test (kernels.library reads it once per process)."""
    def set_to(value):
        monkeypatch.setenv(library.SWITCH, value)
        library.switch.cache_clear()

    yield set_to
    monkeypatch.undo()
    library.switch.cache_clear()


def test_the_kernel_switch_names_its_valid_values(switch):
    switch("fast")
    with pytest.raises(ValueError, match=r"QBACKEND_KERNELS='fast'; valid: 'auto', 'off', 'avx2'"):
        isa.gemm_build()


@pytest.mark.skipif(registry.available() is not None or isa.vnni_unavailable() is None,
                    reason="needs the own kernels, and a CPU without AVX512-VNNI")
def test_a_forced_build_the_cpu_lacks_is_a_clear_error(switch):
    switch("avx512_vnni_zmm")
    with pytest.raises(RuntimeError, match="needs the avx512_vnni kernels"):
        isa.gemm_build()


@pytest.mark.skipif(registry.available() is not None, reason="needs the own kernels")
def test_a_forced_build_is_the_one_that_runs(switch):
    switch(isa.gemm_build())  # (forcing the build this CPU runs anyway)
    assert isa.gemm_build() == os.environ[library.SWITCH]
    if isa.int8_build() == "avx512_vnni":
        for build in ("avx512_vnni", "avx512_vnni_zmm"):  # either register width, whatever the probe said
            switch(build)
            assert isa.gemm_build() == build


def test_a_prebuilt_library_loads_only_intact_unwritable_and_for_these_sources(cache, tmp_path, monkeypatch):
    directory, source = cache
    shipped = tmp_path / "package" / "prebuilt"
    monkeypatch.setattr(kernel_build, "PREBUILT", shipped)
    monkeypatch.setattr(kernel_build, "LIBRARIES", {"answer": ((source,), FLAGS)})
    (library,) = kernel_build.build_prebuilt(shipped)
    (tmp_path / "package").chmod(0o755)
    assert kernel_build.build("answer", [source], FLAGS) == library and _answer(library) == 42
    assert not directory.exists()  # (nothing compiled into the cache)
    assert kernel_build.prebuilt("answer", (source,), FLAGS + ("-O2",)) is None  # other flags: another key
    library.chmod(0o664)
    assert kernel_build.prebuilt("answer", (source,), FLAGS) is None  # another user could replace it
    library.chmod(0o644)
    shipped.chmod(0o777)
    assert kernel_build.prebuilt("answer", (source,), FLAGS) is None
    shipped.chmod(0o755)
    staged = library.with_suffix(".staged")  # (a new file: this process maps the loaded one)
    staged.write_bytes(library.read_bytes()[:100])
    os.replace(staged, library)
    assert kernel_build.prebuilt("answer", (source,), FLAGS) is None  # not the bytes built
    rebuilt = kernel_build.build("answer", [source], FLAGS)
    assert rebuilt.parent == directory and _answer(rebuilt) == 42  # the fallback: built here


def test_a_symlink_is_never_taken_for_the_cache_directory(tmp_path, monkeypatch):
    """``stat`` follows a link: a link accepted once points wherever its owner likes later (and
    in a shared temporary directory another user may make the name first)."""
    monkeypatch.setattr(kernel_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    private = tmp_path / "tmp" / f"qbackend-{os.getuid()}"
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(mine)
    assert kernel_build.kernel_dir(tmp_path / "link") == private
    private.rmdir()
    private.symlink_to(mine)  # (the temporary name, made first)
    with pytest.raises(RuntimeError, match="that only this user can write"):
        kernel_build.kernel_dir(tmp_path / "link")
    assert not kernel_build.trusted(private) and kernel_build.trusted(mine)


def _write_library(path, answer: int) -> None:
    source = path.with_suffix(".c")
    source.write_text(SOURCE.replace("42", str(answer)))
    kernel_build._compile(kernel_build.compiler()[0], (source,), FLAGS, path)


@pytest.mark.parametrize("linked", ["library", "digest"])
def test_a_cached_library_or_digest_that_is_a_symlink_is_built_again(cache, tmp_path, linked):
    directory, source = cache
    library = kernel_build.build("answer", [source], FLAGS)
    file = library if linked == "library" else library.with_name(library.name + ".sha256")
    elsewhere = tmp_path / f"elsewhere-{file.name}"  # (intact bytes, this user's: only the link is wrong)
    os.replace(file, elsewhere)
    file.symlink_to(elsewhere)
    assert not _intact(library)
    assert kernel_build.build("answer", [source], FLAGS) == library and not file.is_symlink() and _intact(library)


def test_load_runs_the_file_it_checked_not_one_renamed_into_place_after(cache, tmp_path, monkeypatch):
    """Checking a path, then loading it by its name, loads whatever is there by then."""
    directory, source = cache
    library = kernel_build.build("answer", [source], FLAGS)
    planted = tmp_path / "planted.so"
    _write_library(planted, 43)
    checked = kernel_build._intact

    def replaced_after_the_check(path):
        handle = checked(path)
        os.replace(planted, path)
        return handle

    monkeypatch.setattr(kernel_build, "_intact", replaced_after_the_check)
    assert kernel_build.load("answer", [source], FLAGS).qb_answer() == 42
    assert _answer(library) == 43  # (what loading the path, as before, ran)


def test_libraries_loaded_one_after_another_are_each_their_own(cache, tmp_path):
    """glibc returns a library already loaded under the same name (/proc/self/fd/N): a number
    closed after the first load and reused for the second would load the first again."""
    _, source = cache
    other = tmp_path / "other.c"
    other.write_text(SOURCE.replace("42", "43"))
    assert kernel_build.load("answer", [source], FLAGS).qb_answer() == 42
    assert kernel_build.load("other", [other], FLAGS).qb_answer() == 43


def test_a_prebuilt_library_or_directory_that_is_a_symlink_is_not_loaded(cache, tmp_path, monkeypatch):
    _, source = cache
    package = tmp_path / "package"
    shipped = package / "prebuilt"
    monkeypatch.setattr(kernel_build, "PREBUILT", shipped)
    monkeypatch.setattr(kernel_build, "LIBRARIES", {"answer": ((source,), FLAGS)})
    (library,) = kernel_build.build_prebuilt(shipped)
    package.chmod(0o755)
    assert kernel_build.build("answer", [source], FLAGS) == library
    elsewhere = tmp_path / "elsewhere.so"
    os.replace(library, elsewhere)
    library.symlink_to(elsewhere)
    assert kernel_build.prebuilt("answer", (source,), FLAGS) is None
    os.replace(elsewhere, library)
    real = tmp_path / "real-prebuilt"
    os.replace(shipped, real)
    shipped.symlink_to(real)
    assert kernel_build.prebuilt("answer", (source,), FLAGS) is None
    shipped.unlink()
    os.replace(real, shipped)
    built = kernel_build.prebuilt("answer", (source,), FLAGS)
    assert built is not None and built.path == library  # (the same files, no link: loaded)
    os.close(built.handle)
