#!/usr/bin/env bash
# The whole test suite, set-up included (see README). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
export PYTHONFAULTHANDLER=1
exec .venv/bin/python -m pytest -p no:cacheprovider "$@" tests
