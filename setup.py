"""Maps the top-level folders into the one import namespace `epdserve`.

`shared/` -> `epdserve.shared`, `kernels/` -> `epdserve.kernels`, and so on; `shared/api/` is the
top-level `epdserve` package itself (the public offline API). The package list is computed from the
folders on disk so that a new sub-package cannot be forgotten here.
"""
from pathlib import Path

from setuptools import setup

FOLDERS = ("shared", "kernels", "transport", "services")
ROOT_PACKAGE_DIR = "shared/api"

package_dir = {"epdserve": ROOT_PACKAGE_DIR}
for folder in FOLDERS:
    for init in sorted(Path(folder).rglob("__init__.py")):
        pkg_path = init.parent.as_posix()
        if pkg_path == ROOT_PACKAGE_DIR:
            continue
        package_dir["epdserve." + pkg_path.replace("/", ".")] = pkg_path

# Sources compiled at run time (the C++ CPU kernels) travel with the package.
setup(packages=list(package_dir), package_dir=package_dir, package_data={"epdserve.kernels": ["csrc/*.cpp", "csrc/*.h"]})
