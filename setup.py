"""Build of fabric's Cython extensions.

Each backend is its own extension module so that a missing optional library
(UCX, libibverbs) never breaks `import fabric`; the engine only cimports the
fabric interface (fabric/backends/interface.pxd), never a concrete backend.
Set FABRIC_DEBUG_BUILD=1 for bounds/None checks and assertions in the C code.
"""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("FABRIC_DEBUG_BUILD") == "1"
CFLAGS = ["-O0", "-g"] if DEBUG else ["-O2"]


def ext(name, **kw):
    path = name.replace(".", "/") + ".pyx"
    return Extension(name, [path], extra_compile_args=CFLAGS + ["-Wno-unused-function"], **kw)


extensions = [
    ext("fabric.backends.interface"),
    ext("fabric.backends.sockets"),
    ext("fabric.backends.tcp"),
    ext("fabric.protocol.frame"),
    ext("fabric.protocol.engine"),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": DEBUG,
            "wraparound": False,
            "initializedcheck": DEBUG,
            "cdivision": True,
            "embedsignature": True,
        },
    ),
)
