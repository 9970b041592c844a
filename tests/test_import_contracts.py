"""The import contracts of pyproject.toml ([tool.importlinter]) hold on the tree, and an upward import
added to a scratch copy breaks them: codegen importing the runtime, a pass importing codegen, the IR's
floor or lowering importing a pass.
lint-imports reads the packages as installed (llmc/compiler, …), so the copy is laid out that way."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGE_FOLDERS = ("compiler", "passes", "codegen", "runtime")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def installed_layout(dest: Path) -> Path:
    """A copy of the sources as the wheel installs them (dest/llmc/compiler, …), with pyproject.toml."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "llmc", dest / "llmc", ignore=ignore)
    for folder in STAGE_FOLDERS:
        shutil.copytree(ROOT / folder, dest / "llmc" / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "pyproject.toml", "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_contracts_hold_on_the_tree(tmp_path):
    done = lint_imports(installed_layout(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("importer, upward, contract", [
    ("codegen/plan.py", "llmc.runtime.executor", "codegen imports neither runtime nor driver"),
    ("codegen/ort/ort_lowering.py", "llmc.compiler.driver.tuning.ort_timing",
     "codegen imports neither runtime nor driver"),
    ("passes/cast_dtype.py", "llmc.codegen.plan", "each layer imports only the layers below"),
    # the floor (the scheme table here) and lowering import no pass; the driver's tuning no pipeline piece
    ("compiler/schemes.py", "llmc.passes.registry", "each layer imports only the layers below"),
    ("compiler/lower_moe.py", "llmc.passes.base", "each layer imports only the layers below"),
    ("compiler/driver/tuning/run_site.py", "llmc.compiler.recipes", "each layer imports only the layers below"),
    ("runtime/engine.py", "llmc.passes.registry", "runtime imports no pass, frontend, pipeline"),
])
def test_an_upward_import_breaks_a_contract(tmp_path, importer, upward, contract):
    tree = installed_layout(tmp_path)
    with open(tree / "llmc" / importer, "a") as module:
        module.write(f"\nimport {upward}  # noqa: E402\n")
    done = lint_imports(tree)
    assert done.returncode != 0
    assert f"{contract} BROKEN" in done.stdout, done.stdout
    assert f"llmc.{importer[:-3].replace('/', '.')} -> {upward}" in done.stdout
