"""Maps the top-level folders into the one import namespace `epdserve`, and builds the C++ CPU kernels.

`shared/` -> `epdserve.shared`, `kernels/` -> `epdserve.kernels`, and so on; `shared/api/` is the
top-level `epdserve` package itself (the public offline API). The package list is computed from the
folders on disk so that a new sub-package cannot be forgotten here.

The kernels of kernels/csrc are compiled once per CPU level of kernels/cpu_levels.py into
`epdserve.kernels.prebuilt` (in an editable install: kernels/prebuilt/), against the torch of the build
environment, which must be the torch that runs them: build with torch installed and
`pip install --no-build-isolation`. Without torch here they are left out, and the runtime compiles them
when it first needs them (kernels/cpu_build.py).
"""
import importlib.util
import json
import os
import platform
import sys
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

# By its path: the package is not importable before it is installed.
_spec = importlib.util.spec_from_file_location("cpu_levels", "kernels/cpu_levels.py")
cpu_levels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_levels)


def kernel_build():
    """(ext_modules, cmdclass) of the prebuilt kernels, or none where torch is not importable."""
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("epdserve: torch is not importable in this build environment, so the C++ CPU kernels are not "
              "prebuilt; they are compiled at run time instead", file=sys.stderr)
        return [], {}
    levels = [level for level in cpu_levels.LEVELS if level.machine == platform.machine()]
    # Every source and header as a dependency of each module: a build that finds its modules newer than all of
    # them compiles nothing (the image's wheel, built after its kernels' own layer).
    depends = sorted(str(path) for path in Path("kernels/csrc").iterdir() if path.suffix in (".cpp", ".h"))
    extensions = [CppExtension(f"epdserve.kernels.prebuilt.{cpu_levels.module_name(source, level)}",
                               [f"kernels/csrc/{source}.cpp"], depends=depends,
                               extra_compile_args=[*cpu_levels.COMMON_CFLAGS, *level.cflags, *flags])
                  for level in levels for source, flags in cpu_levels.SOURCES.items()]

    class BuildKernels(BuildExtension.with_options(use_ninja=False)):
        """Every kernel at once (one compiler per core), then the manifest the runtime checks them by."""

        def finalize_options(self):
            super().finalize_options()
            if self.parallel is None:
                self.parallel = os.cpu_count()

        def run(self):
            # torch's compile step swaps the shared compiler command for a ccache-wrapped copy and back,
            # around each source: compiles running side by side would stack the wrappers.
            os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"
            # In an editable install, kernels/prebuilt/, which setuptools copies the modules into but does
            # not create.
            prebuilt = Path(self.get_ext_fullpath(extensions[0].name)).parent
            prebuilt.mkdir(parents=True, exist_ok=True)
            super().run()
            manifest = {"torch": torch.__version__, "sources": cpu_levels.sources_digest()}
            (prebuilt / cpu_levels.MANIFEST).write_text(json.dumps(manifest))

        def build_extensions(self):
            # Without Python's own CFLAGS (debug info, signed overflow that wraps, Debian's stack protector):
            # the flags are those of a build at run time, and the level's.
            for command in ("compiler_so", "compiler_so_cxx"):  # (older setuptools compile C++ with the first)
                self.compiler.set_executable(command, [self.compiler.compiler_cxx[0], "-fPIC"])
            # distutils names an object after its source, so the levels, compiled side by side, would write
            # the same objects: each extension compiles a file of its own that includes its source.
            for ext in self.extensions:
                own = Path(self.build_temp, "levels", ext.name + ".cpp")
                own.parent.mkdir(parents=True, exist_ok=True)
                # What the module is built from and with: rewritten only when that changes, since a rewritten
                # file is newer than the module and compiles it again.
                text = (f"// torch {torch.__version__}, flags {ext.extra_compile_args}\n"
                        f'#include "{Path(ext.sources[0]).resolve()}"\n')
                if not own.exists() or own.read_text() != text:
                    own.write_text(text)
                ext.sources = [str(own)]
            super().build_extensions()

    return extensions, {"build_ext": BuildKernels} if extensions else {}


ext_modules, cmdclass = kernel_build()
# The sources travel with the package, as a data-only package of their own (setuptools would otherwise warn
# that kernels/csrc looks importable and is listed nowhere): the runtime compiles them where no prebuilt
# level fits.
package_dir["epdserve.kernels.csrc"] = "kernels/csrc"
setup(packages=list(package_dir), package_dir=package_dir,
      package_data={"epdserve.kernels.csrc": ["*.cpp", "*.h"]}, ext_modules=ext_modules, cmdclass=cmdclass)
