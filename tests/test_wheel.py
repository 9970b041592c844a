"""The wheel ships what the tree has. Built from a copy of the tree, it holds every source and data
file of every package folder; installed (not editable) into a fresh venv, it compiles tiny-llama with
--tp 2 and runs it, from a directory where the source tree is not importable.

The fresh venv has no pip and no dependencies of its own: a .pth line puts this venv's site-packages
(torch and the rest) after it, so the test is offline and takes seconds. A .pth line only adds a
folder to sys.path, it runs none of that folder's .pth files, so the editable install stays out."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = {"llmc": "llmc", "compiler": "llmc/compiler", "passes": "llmc/passes", "codegen": "llmc/codegen",
                   "runtime": "llmc/runtime"}
BUILD_FILES = ["pyproject.toml", "setup.py", "README.md"]
SHIPPED = {".py", ".j2", ".c", ".h"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree (a build in place would race other builds over build/)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True)
    (built,) = out.glob("llmc_compiler-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The bin/ folder of a fresh venv holding the wheel, with this venv's packages behind it."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "llmc_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True)
    return venv / "bin"


def shipped_files(folder: str) -> set[str]:
    """The files under a package folder that belong in the wheel, as wheel paths."""
    return {f"{PACKAGE_FOLDERS[folder]}/{p.relative_to(ROOT / folder).as_posix()}"
            for p in (ROOT / folder).rglob("*") if p.suffix in SHIPPED and "__pycache__" not in p.parts}


def test_the_wheel_holds_every_file_of_every_package_folder(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in PACKAGE_FOLDERS:
        missing = shipped_files(folder) - names
        assert not missing, f"the wheel lacks {sorted(missing)}"
    assert "llmc/runtime/parallel/launch.py" in names


def run(bin_dir: Path, cwd: Path, *args) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_installed_wheel_compiles_and_runs_tiny_llama_on_two_ranks(installed, tmp_path):
    where = run(installed, tmp_path, installed / "python", "-c", "import llmc; print(llmc.__file__)")
    assert Path(where).is_relative_to(installed.parent), f"llmc imported from {where}, not the wheel"
    run(installed, tmp_path, installed / "llmc", "compile", "tiny-llama", "--tp", "2", "-o", "tiny.llmc", "-q")
    out = run(installed, tmp_path, installed / "llmc", "run", "tiny.llmc", "--prompt", "hi", "--max-tokens", "4")
    assert out.strip()
