"""Maps the repository's folders onto the `kvpilot.*` import names.

The folder roots carry no ``__init__.py``: a top-level package called
``operator`` would shadow the standard library module of that name and break
every ``python`` command run from the repository root.
"""

import os

from setuptools import setup

ROOTS = {
    "operator": "kvpilot.operator",
    "engine": "kvpilot.engine",
    "kernels": "kvpilot.kernels",
    "cli": "kvpilot.cli",
}
DATA = ["*.json"]  # the bundled tokenizer and the simulator's calibration


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for folder, name in ROOTS.items():
        for dirpath, dirnames, _ in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            rel = os.path.relpath(dirpath, folder)
            pkg = name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}"
            packages.append(pkg)
            package_dir[pkg] = dirpath
    return packages, package_dir


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={pkg: DATA for pkg in packages},
)
