"""gpuio's optional C hot path (gpuio/_hotpath.c); everything else is in pyproject.toml.

Built where a C compiler and CPython's headers are present, as one abi3 extension for CPython 3.11 and
later; anywhere else (no compiler, another interpreter, CPython 3.10, the free-threaded build) the
build skips it and gpuio uses the same stores written in Python.
"""

import sys
import sysconfig

from setuptools import Extension, setup

WANTED = (sys.implementation.name == "cpython" and sys.version_info >= (3, 11)
          and not sysconfig.get_config_var("Py_GIL_DISABLED"))

extensions = [Extension("gpuio._hotpath", ["gpuio/_hotpath.c"], py_limited_api=True, optional=True,
                        extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration",
                                            "-Werror=incompatible-pointer-types", "-Werror=int-conversion"])]

setup(ext_modules=extensions if WANTED else [],
      options={"bdist_wheel": {"py_limited_api": "cp311"}} if WANTED else {})
