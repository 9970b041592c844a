"""The native kernels' build cache cannot be planted: a library put at the path llmc computes (the
name is a hash anyone can work out) is never loaded unless llmc built it into its private directory
and its recorded sha256 still holds; a cache directory others can write to is refused with one
warning line (the torch kernels run instead); a checked library missing a kernel is one error line.
Each planted library has a constructor that writes a marker file: the marker must stay absent."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from llmc_cli import error_line, llmc_in_process

from llmc.codegen import native_cache
from llmc.codegen.native import cpu_native
from llmc.errors import LlmcError

CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None or os.environ.get("LLMC_NATIVE") == "0", reason="no C compiler")

PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
%s
"""
# every symbol llmc binds, so that a loaded plant would pass for the real library
ALL_SYMBOLS = "\n".join(f"long {name}(void) {{ return 0; }}" for name in cpu_native.SIGNATURES)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The C compiler's output by flags, kept for the module: each test rebuilds into its fresh cache
    through the real _build (the checks, the atomic record), but the 20-50 s of compiling (two builds a
    test on a 2-core AVX2 host) runs once."""
    real, store, built = cpu_native._compile_and_link, tmp_path_factory.mktemp("compiled"), {}

    def compile_once(compiler, flags, objects, out):
        key = (compiler, flags)
        if key not in built:
            real(compiler, flags, objects, out)
            built[key] = store / f"{len(built)}.so"
            shutil.copyfile(out, built[key])
        shutil.copyfile(built[key], out)
    return compile_once


@pytest.fixture
def cache(tmp_path, monkeypatch, compiled):
    """A fresh LLMC_CACHE; the native kernels are loaded anew inside the test and after it."""
    monkeypatch.setattr(cpu_native, "_compile_and_link", compiled)
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(native_cache.SHARED_ENV, raising=False)
    cpu_native._load.cache_clear()
    yield tmp_path / "cache"
    cpu_native._load.cache_clear()


def _built(cache) -> Path:
    """The path llmc computes and builds its library at (as an attacker could compute it), built
    there but not loaded: the dynamic loader would keep a library loaded under that name."""
    library = cpu_native._build(CC, cpu_native.FLAGS + cpu_native.OPENMP)
    assert library.parent == cache / "native"
    return library


def _plant(path: Path, marker: Path, symbols: str = ALL_SYMBOLS) -> None:
    source = path.with_name("plant.c")
    source.write_text(PLANT % (marker, symbols))
    subprocess.run([CC, "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()


def _record_digest(library: Path) -> None:
    """What an attacker who can write the directory would also do: the sha256 file to match."""
    import hashlib
    native_cache.digest_path(library).write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")


def test_the_cache_directory_is_private_and_each_library_has_its_sha256_beside_it(cache, capsys):
    """`llmc cache build` (make setup runs it) builds the library a compile then finds built"""
    code, out, _ = llmc_in_process(capsys, "cache", "build")
    assert code == 0 and out.startswith("native kernels: on")
    built = sorted((cache / "native").glob("*.so"))
    library = _built(cache)
    assert built == [library]
    assert (cache / "native").stat().st_mode & 0o777 == 0o700
    assert library.stat().st_mode & 0o022 == 0
    import hashlib
    assert native_cache.digest_path(library).read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()


@pytest.mark.parametrize("digest", ["none", "stale"])
def test_a_planted_library_without_its_recorded_sha256_is_rebuilt_not_loaded(cache, tmp_path, digest):
    library = _built(cache)
    if digest == "none":
        native_cache.digest_path(library).unlink()
    marker = tmp_path / "marker"
    _plant(library, marker)
    assert cpu_native.available(), cpu_native.status()
    assert not marker.exists()
    assert b"planted code ran" not in library.read_bytes()   # replaced by llmc's own build


@pytest.mark.parametrize("how", ["group_writable", "another_user"])
def test_a_library_others_could_have_written_is_rebuilt_even_with_a_matching_sha256(cache, tmp_path, how):
    if how == "another_user" and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    library = _built(cache)
    marker = tmp_path / "marker"
    _plant(library, marker)
    _record_digest(library)
    library.chmod(0o775 if how == "group_writable" else 0o755)
    if how == "another_user":
        os.chown(library, 65534, 65534)
    assert cpu_native.available(), cpu_native.status()
    assert not marker.exists()


def test_a_symlink_at_the_library_path_is_replaced_not_followed(cache, tmp_path):
    library = _built(cache)
    marker, elsewhere = tmp_path / "marker", tmp_path / "elsewhere.so"
    _plant(elsewhere, marker)
    library.unlink()
    library.symlink_to(elsewhere)
    assert cpu_native.available()
    assert not marker.exists() and not library.is_symlink()


@pytest.mark.parametrize("which", ["native", "root"])
def test_a_cache_directory_others_can_write_is_refused_with_one_warning(cache, tmp_path, capfd, which):
    library = _built(cache)
    marker = tmp_path / "marker"
    _plant(library, marker)
    _record_digest(library)
    (cache / "native" if which == "native" else cache).chmod(0o777)
    capfd.readouterr()
    assert not cpu_native.available()
    assert not marker.exists()
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("llmc: warning: native kernels off") and "writable by others" in err[0]
    assert "writable by others" in cpu_native.status()


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user's needs root")
def test_a_cache_directory_of_another_user_is_refused(cache, tmp_path):
    library = _built(cache)
    marker = tmp_path / "marker"
    _plant(library, marker)
    _record_digest(library)
    os.chown(cache / "native", 65534, 65534)
    assert not cpu_native.available()
    assert not marker.exists()
    assert "belongs to uid 65534" in cpu_native.status()


def test_the_shared_cache_opt_in_trusts_a_writable_directory(cache, monkeypatch):
    _built(cache)
    (cache / "native").chmod(0o777)
    monkeypatch.setenv(native_cache.SHARED_ENV, "1")
    assert cpu_native.available()


def test_a_checked_library_missing_a_kernel_is_one_error_line(cache, tmp_path, capfd, monkeypatch):
    import llmc
    artifact = llmc.compile("tiny-llama", target="cpu", output=tmp_path / "tiny.llmc")
    cpu_native._load.cache_clear()   # loaded from this cache while compiling: plant at another path
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "second-cache"))
    cache = tmp_path / "second-cache"
    library = _built(cache)
    marker = tmp_path / "marker"
    _plant(library, marker, symbols="long llmc_openmp(void) { return 0; }")
    _record_digest(library)   # as if llmc had built it from other sources
    with pytest.raises(LlmcError, match="has no symbol llmc_decode_attention"):
        cpu_native._load()
    cpu_native._load.cache_clear()
    code, out, err = llmc_in_process(capfd, "run", artifact, "-p", "hello", "--max-tokens", "2")
    assert code == 2 and out == ""
    line = error_line(err)
    assert "has no symbol llmc_decode_attention" in line and str(library) in line


def test_a_symlinked_native_directory_is_refused_and_a_linked_cache_root_followed(cache, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "native").mkdir(parents=True)
    cache.mkdir()
    (cache / "native").symlink_to(elsewhere / "native")
    assert not cpu_native.available() and "is a symlink" in cpu_native.status()
    cpu_native._load.cache_clear()
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "root-link"))
    (tmp_path / "root-link").symlink_to(elsewhere)
    library = cpu_native._build(CC, cpu_native.FLAGS + cpu_native.OPENMP)
    assert library.parent == elsewhere.resolve() / "native"


def test_a_cache_root_that_is_a_file_is_refused_with_one_warning(cache, capfd):
    cache.write_text("not a directory")
    capfd.readouterr()
    assert not cpu_native.available()
    [line] = capfd.readouterr().err.splitlines()
    assert line.startswith("llmc: warning: native kernels off") and "cannot be made (Not a directory)" in line


def test_the_sources_build_where_a_compiler_exists(cache):
    """Where a C compiler is present the native library builds and loads: without this, a source that no
    longer compiles would turn every native-kernel test into a skip ("no native kernels here") and the
    suite would pass on the torch kernels alone."""
    lib, status = cpu_native._load()
    assert lib is not None, f"the native kernels did not build with {CC}: {status}"
    assert status.startswith("on")
