#!/usr/bin/env bash
# The whole test suite, set-up included (see README). Extra arguments go to pytest.
# 1. Every suite on this machine (the verbs tests skip here and say why).
# 2. The verbs suites inside the Soft-RoCE guest (tools/softroce.py), where rxe0 exists;
#    where the guest cannot run, one line says why they were skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test || exit 1
export PYTHONFAULTHANDLER=1
.venv/bin/python -m pytest -p no:cacheprovider "$@" tests
host=$?
guest=0
if why=$(.venv/bin/python tools/softroce.py --check 2>&1); then
    echo "== Soft-RoCE: the verbs suites inside a QEMU guest with rxe0"
    # The guest runs Python about 20x slower (TCG): fewer connections in the
    # scale and load tests (bench/reliability.py measures 1000 there).
    .venv/bin/python tools/softroce.py --timeout 2400 -- env FABRIC_TEST_BACKENDS=verbs \
        FABRIC_TEST_CONNECTIONS=100 FABRIC_TEST_LOAD_SECONDS=8 FABRIC_TEST_LOAD_MAX_SIZE=16M \
        .venv/bin/python -m pytest -p no:cacheprovider "$@" \
        tests/test_endpoint.py tests/test_asyncio.py tests/test_stream.py tests/test_grpc.py tests/test_grpc_aio.py tests/test_grpc_scale.py tests/test_verbs.py \
        tests/test_lifecycle.py tests/test_scale.py tests/test_faults.py tests/test_lifecycle_stateful.py \
        tests/test_load.py
    guest=$?
    [ "$guest" = 5 ] && guest=0      # a -k filter can leave nothing to run in the guest
else
    echo "== Soft-RoCE: verbs suites SKIPPED: $why"
fi
[ "$host" = 0 ] && [ "$guest" = 0 ]
