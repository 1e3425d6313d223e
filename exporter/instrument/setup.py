"""gpuio's optional C hot path (gpuio/_hotpath.c); everything else is in pyproject.toml.

Built where a C compiler and CPython's headers are present, as one abi3 extension for CPython 3.11 and
later; anywhere else (no compiler, another interpreter, CPython 3.10, the free-threaded build) the
build skips it and gpuio uses the same stores written in Python.  GPUIO_PURE_PYTHON=1 skips it on purpose:
`make dist` builds that wheel (py3-none-any) beside the C one, for the Pythons and machines the C one does
not fit (CPython 3.10, aarch64).
"""

import os
import sys
import sysconfig

from setuptools import Extension, setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

WANTED = (sys.implementation.name == "cpython" and sys.version_info >= (3, 11)
          and not sysconfig.get_config_var("Py_GIL_DISABLED") and os.environ.get("GPUIO_PURE_PYTHON") != "1")

extensions = [Extension("gpuio._hotpath", ["gpuio/_hotpath.c"], py_limited_api=True, optional=True,
                        extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration",
                                            "-Werror=incompatible-pointer-types", "-Werror=int-conversion"])]



class Wheel(bdist_wheel):
    """cp311-abi3-<platform> where the C file was built; py3-none-any where the build skipped it (the
    wheel then holds Python only, and installs on any Python gpuio supports)."""

    def get_tag(self) -> tuple[str, str, str]:
        built = self.get_finalized_command("build_ext").get_outputs()
        if not any(os.path.exists(path) for path in built):
            self.root_is_pure, self.py_limited_api = True, False
        return super().get_tag()


setup(ext_modules=extensions if WANTED else [], cmdclass={"bdist_wheel": Wheel},
      options={"bdist_wheel": {"py_limited_api": "cp311"}} if WANTED else {})
