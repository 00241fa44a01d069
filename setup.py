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
    """setuptools' build_ext, parallel by default (-j still wins), linking no
    run-time search path of the build machine into the extensions."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel and JOBS > 1:
            self.parallel = JOBS

    def build_extensions(self):
        # An interpreter built with an rpath (pyenv's -Wl,-rpath,<its lib>)
        # passes it to every extension; they need no libpython of their own,
        # and an installed file must not search the build machine's paths.
        self.compiler.linker_so = [a for a in self.compiler.linker_so
                                   if not a.startswith(("-Wl,-rpath", "-Wl,-R"))]
        super().build_extensions()

    def run(self):
        # Only a build of the extensions decides what they were built with
        # (an sdist, made without the libucx wheel, must not record it).
        if LEFT_OUT and os.environ.get("FABRIC_REQUIRE_ALL") == "1":    # a release build (tools/wheel.sh)
            sys.exit("fabric: FABRIC_REQUIRE_ALL=1, and this build would leave out: "
                     + "; ".join(f"{k}: {v}" for k, v in sorted(LEFT_OUT.items())))
        # The record goes where these extensions go: beside them in the tree
        # (in place, or an editable install), else into build_lib, which
        # build_py filled before this ran. A build elsewhere (tools/fuzz.py's
        # sanitizer copy) leaves the tree's record alone.
        if self.inplace or getattr(self, "editable_mode", False):
            write_build_config("fabric")
        else:
            os.makedirs(os.path.join(self.build_lib, "fabric"), exist_ok=True)
            write_build_config(os.path.join(self.build_lib, "fabric"))
        super().run()
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
                [os.path.join(prefix, "lib")], "prefix")
    if choice in ("auto", "wheel"):
        try:
            import libucx
            base = os.path.dirname(libucx.__file__)
            if os.path.exists(os.path.join(base, "include", "ucp", "api", "ucp.h")):
                lib = os.path.join(base, "lib")
                # fabric calls libucx.load_library() before importing the
                # backend (as ucx-py and ucxx do); the relative path, where the
                # wheel's libraries sit beside fabric in site-packages, serves
                # an import of the module alone. No build path is recorded.
                return (os.path.join(base, "include"), lib, ["$ORIGIN/../../libucx/lib"], "wheel")
        except ImportError:
            pass
        if choice == "wheel":
            sys.exit("FABRIC_UCX=wheel, but the libucx wheel is not importable (pip install libucx-cu12)")
    if choice in ("auto", "system") and shutil.which("pkg-config"):
        try:
            inc = subprocess.check_output(["pkg-config", "--variable=includedir", "ucx"], text=True).strip()
            lib = subprocess.check_output(["pkg-config", "--variable=libdir", "ucx"], text=True).strip()
            if os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")):
                return inc, lib, [], "system"
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

# What this build left out, and why: printed loudly at the end of the build
# and recorded in fabric/_build_config.py, so that Fabric("verbs") and
# `python -m fabric info` name the reason instead of "not built".
LEFT_OUT = {}

# TLS for the tcp fabric, where OpenSSL's headers are (libssl-dev); without
# them the tcp fabric still builds and Fabric("tcp", ssl=...) says why not.
# It links the system's libssl.so.3, the one Python's own ssl module uses
# (a wheel does not graft it: tools/wheel.sh excludes it from repair).
if os.environ.get("FABRIC_TLS", "auto") == "off":
    LEFT_OUT["tls"] = "FABRIC_TLS=off at build time"
elif not os.path.exists("/usr/include/openssl/ssl.h"):
    LEFT_OUT["tls"] = "OpenSSL's headers were missing at build time (apt install libssl-dev, then reinstall)"
else:
    extensions.append(ext("fabric.backends.tls", libraries=["ssl", "crypto"]))

# Test-only (tests/test_memory_fabric.py): the in-memory fabric, never a
# user-facing backend (not in fabric.backends.KNOWN). FABRIC_MEMORY_FABRIC=off skips it.
if os.environ.get("FABRIC_MEMORY_FABRIC", "auto") != "off":
    extensions.append(ext("fabric.backends._memory"))

# verbs links no libibverbs (verbs_shim.h loads the host's at run time): the
# header is all the build needs.
if os.environ.get("FABRIC_VERBS", "auto") == "off":
    LEFT_OUT["verbs"] = "FABRIC_VERBS=off at build time"
elif not os.path.exists("/usr/include/infiniband/verbs.h"):
    LEFT_OUT["verbs"] = ("rdma-core's header infiniband/verbs.h was missing at build time "
                         "(apt install libibverbs-dev, then reinstall)")
else:
    extensions.append(ext("fabric.backends.verbs", include_dirs=["fabric/backends"], libraries=["dl"]))

ucx = find_ucx()
UCX_ORIGIN = None
if ucx is None:
    LEFT_OUT["ucx"] = ("no UCX headers at build time (pip install 'fabric-transport[ucx]' builds against "
                       "the libucx-cu12 wheel; or apt install libucx-dev, then reinstall)"
                       if os.environ.get("FABRIC_UCX", "auto").lower() != "off" else "FABRIC_UCX=off at build time")
else:
    inc, lib, rpaths, UCX_ORIGIN = ucx
    print(f"fabric: building the ucx backend against UCX from the {UCX_ORIGIN}: {inc}", file=sys.stderr)
    extensions.append(ext("fabric.backends.ucx", include_dirs=[inc, "fabric/backends"],
                          library_dirs=[lib], libraries=["ucp", "ucs"], runtime_library_dirs=rpaths))


def write_build_config(package_dir):
    with open(os.path.join(package_dir, "_build_config.py"), "w") as f:
        f.write('"""Written by setup.py at build time: what this installation was built with."""\n')
        f.write("from __future__ import annotations\n\n")
        f.write(f"UCX_ORIGIN: str | None = {UCX_ORIGIN!r}   # 'wheel' (libucx-cu12), 'system', 'prefix' or None\n")
        f.write(f"LEFT_OUT: dict[str, str] = {LEFT_OUT!r}   # what was not built, and why\n")


def report_left_out():
    """The banner at the end of the build (pip shows it with -v; the same
    reasons reach the user at run time through fabric/_build_config.py)."""
    if not LEFT_OUT:
        return
    bar = "=" * 78
    lines = [bar, "fabric: this build LEFT OUT some backends:"]
    lines += [f"  {name}: {why}" for name, why in sorted(LEFT_OUT.items())]
    lines += ["Fabric(<name>) and `python -m fabric info` will say the same at run time.", bar]
    print("\n".join(lines), file=sys.stderr)


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
report_left_out()      # again after the compiler's output, where it is seen
