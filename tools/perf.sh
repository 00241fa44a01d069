#!/usr/bin/env bash
# The main job: fabric-perf on the default backend over loopback (own peer process).
# Extra arguments go to fabric-perf (see fabric-perf --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test >/dev/null
exec .venv/bin/fabric-perf "$@"
