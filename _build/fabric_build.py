"""The PEP 517 build backend of fabric-transport: setuptools' own, plus the
libucx wheel in the (isolated) build environment when the ucx backend is to
be built against it, so that `pip install fabric-transport[ucx]` builds and
runs against the same UCX on a machine without a system UCX.

Which UCX the ucx backend is built against is setup.py's find_ucx() (README,
"UCX builds"); this only makes the wheel importable there. FABRIC_UCX=system,
FABRIC_UCX=off or FABRIC_UCX_PREFIX skip it; so does a platform the wheel is
not made for.
"""
import os
import platform

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - the hooks this backend does not change

UCX_WHEEL = "libucx-cu12>=1.18"


def _ucx_requires():
    choice = os.environ.get("FABRIC_UCX", "auto").lower()
    if os.environ.get("FABRIC_UCX_PREFIX") or choice in ("off", "system"):
        return []
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return []
    return [UCX_WHEEL]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _ucx_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _ucx_requires()
