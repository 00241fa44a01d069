#!/usr/bin/env bash
# The main job: fabric-perf on the default backend over loopback (own peer process).
# Extra arguments go to fabric-perf (see fabric-perf --help).
# Set-up (tools/setup.sh perf: the build and matplotlib, not the test command's QEMU
# and kernel) runs only when the build is not current: no .venv/bin/fabric-perf, no
# stamp from a finished tools/setup.sh, fabric does not import (from this checkout)
# in .venv, or a build input (*.pyx, *.pxd, *.h, setup.py, pyproject.toml, _build/*.py)
# is newer than the stamp. `bash tools/setup.sh perf` forces it.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.fabric-setup-stamp

current() {
    [ -x .venv/bin/fabric-perf ] && [ -f "$stamp" ] || return 1
    # -I: the venv's own install decides (not the working directory or PYTHONPATH)
    .venv/bin/python -I -c 'import os, sys, fabric
sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(fabric.__file__))) != os.path.realpath(sys.argv[1]))' \
        "$PWD" >/dev/null 2>&1 || return 1
    newer=$(find . \( -path ./.venv -o -path ./build -o -path ./.git \) -prune -o \
        \( -name '*.pyx' -o -name '*.pxd' -o -name '*.h' -o -name setup.py -o -name pyproject.toml \
           -o -path './_build/*.py' \) -newer "$stamp" -print -quit)
    [ -z "$newer" ]
}

current || bash tools/setup.sh perf >/dev/null
exec .venv/bin/fabric-perf "$@"
