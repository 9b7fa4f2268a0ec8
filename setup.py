"""Build gpudash's compiled allocator core where a C compiler exists.

``gpudash/_core.pyx`` (Cython, fetched from PyPI for the build) becomes the extension
``gpudash._core``. When it cannot be built (no C compiler, ``CC=/bin/false``), the package
installs without it and the pure-Python allocator models run: the build says so, and so do
``gpudash info`` and a warning at run time.
"""

import runpy
import shutil
import sys
import warnings
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# setuptools' note on every editable install of a flat layout ("be careful with folders in
# your working directory with the same name as your package") says nothing useful here.
warnings.filterwarnings("ignore", message="Editable installation")
QUICKSTART = "notebooks/01_quickstart.ipynb"


def _say(message: str) -> None:
    print(f"gpudash: {message}", file=sys.stderr, flush=True)


class OptionalBuildExt(build_ext):
    """build_ext that leaves the extension out, saying so, when it cannot be built."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure means "no compiled core"
            self._skipped(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._skipped(exc)

    @staticmethod
    def _skipped(exc: Exception) -> None:
        _say(f"the compiled allocator core was not built ({type(exc).__name__}: {exc}); "
             "installing the pure-Python allocator models (about 10x slower). Install a C "
             "compiler and reinstall to build it.")


class BuildPyWithNotebook(build_py):
    """build_py that also packs the quick-start notebook (``gpudash lab`` opens it)."""

    def run(self) -> None:
        super().run()
        src = HERE / QUICKSTART
        if src.exists() and not self.editable_mode:
            dst = Path(self.build_lib) / "gpudash" / QUICKSTART
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def _extensions() -> list:
    try:
        from Cython.Build import cythonize
    except ImportError as exc:
        _say(f"Cython is missing ({exc}); installing the pure-Python allocator models")
        return []
    # the sources' fingerprint, built in: gpudash._accel refuses an extension older than them
    digest = runpy.run_path(str(HERE / "gpudash" / "_sourcehash.py"))["source_hash"](
        HERE / "gpudash")
    ext = Extension("gpudash._core", ["gpudash/_core.pyx"], extra_compile_args=["-O3"],
                    define_macros=[("GPUDASH_SOURCE_HASH", f'"{digest}"')])
    return cythonize([ext], build_dir="build/cython", quiet=True,
                     compiler_directives={"language_level": 3})


setup(ext_modules=_extensions(),
      cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithNotebook})
