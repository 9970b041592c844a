"""Build script for the one import package `llmc`: its packages are found from the tree, so a new
package folder ships in the wheel without editing a list (a hand-kept list once left out
`llmc.runtime.parallel`). pyproject.toml holds everything else.

The stage folders the product was specified with are mapped into `llmc` (`compiler/` →
`llmc.compiler`, …); setuptools' `packages.find` cannot prefix a folder's name, hence this file."""

from setuptools import find_packages, setup

PACKAGE_DIRS = {"llmc": "llmc", "llmc.compiler": "compiler", "llmc.passes": "passes", "llmc.codegen": "codegen",
                "llmc.runtime": "runtime"}


def llmc_packages() -> list[str]:
    """Every folder with an `__init__.py` under a stage folder, named as `llmc` imports it."""
    return [name for prefix, folder in PACKAGE_DIRS.items()
            for name in [prefix, *(f"{prefix}.{sub}" for sub in find_packages(folder))]]


setup(packages=llmc_packages(), package_dir=PACKAGE_DIRS)
