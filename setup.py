"""Build of fabric's Cython extensions.

Each backend is its own extension module so that a missing optional library
(UCX, libibverbs) never breaks `import fabric`; the engine only cimports the
fabric interface (fabric/backends/interface.pxd), never a concrete backend.
Set FABRIC_DEBUG_BUILD=1 for bounds/None checks and assertions in the C code.
"""
import os
import shutil
import subprocess
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

DEBUG = os.environ.get("FABRIC_DEBUG_BUILD") == "1"
# the extensions compile in parallel, one job per core (FABRIC_BUILD_JOBS=1: one at a time)
JOBS = int(os.environ.get("FABRIC_BUILD_JOBS") or 0) or os.cpu_count() or 1


class build_ext(_build_ext):
    """setuptools' build_ext, parallel by default (-j still wins)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel and JOBS > 1:
            self.parallel = JOBS
CFLAGS = ["-O0", "-g"] if DEBUG else ["-O2"]


def ext(name, **kw):
    path = name.replace(".", "/") + ".pyx"
    return Extension(name, [path], extra_compile_args=CFLAGS + ["-Wno-unused-function"], **kw)


def find_ucx():
    """Where to build the ucx backend from, by this rule (README, "UCX builds"):
    FABRIC_UCX_PREFIX=<dir with include/ and lib/> wins; else FABRIC_UCX=wheel
    uses the libucx-cu12 wheel, FABRIC_UCX=system uses pkg-config ucx (Debian's
    libucx-dev), FABRIC_UCX=off skips; the default (auto) tries the wheel, then
    the system. Returns (include_dir, lib_dir, rpaths, origin) or None."""
    choice = os.environ.get("FABRIC_UCX", "auto").lower()
    prefix = os.environ.get("FABRIC_UCX_PREFIX")
    if choice == "off":
        return None
    if prefix:
        return (os.path.join(prefix, "include"), os.path.join(prefix, "lib"),
                [os.path.join(prefix, "lib")], "prefix " + prefix)
    if choice in ("auto", "wheel"):
        try:
            import libucx
            base = os.path.dirname(libucx.__file__)
            if os.path.exists(os.path.join(base, "include", "ucp", "api", "ucp.h")):
                lib = os.path.join(base, "lib")
                # the wheel's libraries sit beside fabric in site-packages
                return (os.path.join(base, "include"), lib, [lib, "$ORIGIN/../../libucx/lib"], "wheel libucx")
        except ImportError:
            pass
        if choice == "wheel":
            sys.exit("FABRIC_UCX=wheel, but the libucx wheel is not importable (pip install libucx-cu12)")
    if choice in ("auto", "system") and shutil.which("pkg-config"):
        try:
            inc = subprocess.check_output(["pkg-config", "--variable=includedir", "ucx"], text=True).strip()
            lib = subprocess.check_output(["pkg-config", "--variable=libdir", "ucx"], text=True).strip()
            if os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")):
                return inc, lib, [], "system (pkg-config ucx)"
        except (OSError, subprocess.CalledProcessError):
            pass
    if choice == "system":
        sys.exit("FABRIC_UCX=system, but pkg-config finds no UCX (apt install libucx-dev)")
    return None


extensions = [
    ext("fabric.backends.interface"),
    ext("fabric.backends.sockets"),
    ext("fabric.backends.bootstrap"),   # the ucx and verbs connection set-up
    ext("fabric.backends.auth", include_dirs=["fabric/backends"]),   # test hooks of the authentication crypto
    ext("fabric.backends.tcp"),
    ext("fabric.protocol.frame"),
    ext("fabric.protocol.engine", include_dirs=["fabric/backends", "fabric/protocol/core"]),   # hmac_sha256.h, ready_memory.h
    ext("fabric._buffers"),
    # fabric.grpc's HTTP/2 core: HPACK and the connection state machine
    ext("fabric.grpc._hpack"),
    ext("fabric.grpc._h2"),
]

# TLS for the tcp fabric, where OpenSSL's headers are (libssl-dev); without
# them the tcp fabric still builds and Fabric("tcp", ssl=...) says why not.
if os.path.exists("/usr/include/openssl/ssl.h") and os.environ.get("FABRIC_TLS", "auto") != "off":
    extensions.append(ext("fabric.backends.tls", libraries=["ssl", "crypto"]))
else:
    print("fabric: no openssl/ssl.h; TLS on the tcp fabric is not built (apt install libssl-dev)",
          file=sys.stderr)

# Test-only (tests/test_memory_fabric.py): the in-memory fabric, never a
# user-facing backend (not in fabric.backends.KNOWN). FABRIC_MEMORY_FABRIC=off skips it.
if os.environ.get("FABRIC_MEMORY_FABRIC", "auto") != "off":
    extensions.append(ext("fabric.backends._memory"))

if os.path.exists("/usr/include/infiniband/verbs.h") and os.environ.get("FABRIC_VERBS", "auto") != "off":
    extensions.append(ext("fabric.backends.verbs", include_dirs=["fabric/backends"], libraries=["ibverbs"]))
else:
    print("fabric: no infiniband/verbs.h; the verbs backend is not built (apt install libibverbs-dev)",
          file=sys.stderr)

ucx = find_ucx()
if ucx is None:
    print("fabric: no UCX headers found; the ucx backend is not built "
          "(pip install libucx-cu12 or apt install libucx-dev, then rebuild)", file=sys.stderr)
else:
    inc, lib, rpaths, origin = ucx
    print(f"fabric: building the ucx backend against {origin}: {inc}", file=sys.stderr)
    extensions.append(ext("fabric.backends.ucx", include_dirs=[inc, "fabric/backends"],
                          library_dirs=[lib], libraries=["ucp", "ucs"], runtime_library_dirs=rpaths))

setup(
    cmdclass={"build_ext": build_ext},
    ext_modules=cythonize(
        extensions,
        nthreads=JOBS if JOBS > 1 else 0,
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
