#!/usr/bin/env bash
# The whole test suite, set-up included (see README). Extra arguments go to pytest.
# 1. Every suite on this machine (the verbs tests skip here and say why).
# 2. The verbs suites inside the Soft-RoCE guest (tools/softroce.py), where rxe0 exists;
#    where the guest cannot run, one line says why they were skipped.
# 3. The wire's CI subset between two guests (tools/wire.sh --ci).
# Between 1 and 2, the documentation's check (tools/docs.sh --check).
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test || exit 1
export PYTHONFAULTHANDLER=1
# One pytest worker per core, a test file per worker at a time (FABRIC_TEST_JOBS=1:
# one process); tests marked serial (timers, rates) run afterwards, alone.
jobs="${FABRIC_TEST_JOBS:-$(nproc)}"
parallel=()
[ "$jobs" -gt 1 ] && parallel=(-n "$jobs" --dist loadfile)
.venv/bin/python -m pytest -p no:cacheprovider "${parallel[@]}" -m "not serial" "$@" tests
host=$?
[ "$host" = 5 ] && host=0          # a -k filter can leave nothing to run here
.venv/bin/python -m pytest -p no:cacheprovider -m serial "$@" tests
serial=$?
[ "$serial" = 5 ] && serial=0
[ "$serial" = 0 ] || host=$serial
# The documentation builds with warnings as errors, and its doctests run
# (the guides' other snippets are examples/, which tests/test_examples.py runs).
echo "== the documentation: bash tools/docs.sh --check"
bash tools/docs.sh --check || host=1
guest=0
if why=$(.venv/bin/python tools/softroce.py --check 2>&1); then
    echo "== Soft-RoCE: the verbs suites inside a QEMU guest with rxe0"
    # The guest runs Python about 20x slower (TCG): fewer connections in the
    # scale and load tests (bench/reliability.py measures 1000 there).
    .venv/bin/python tools/softroce.py --timeout 2400 -- env FABRIC_TEST_BACKENDS=verbs \
        FABRIC_TEST_CONNECTIONS=100 FABRIC_TEST_LOAD_SECONDS=8 FABRIC_TEST_LOAD_MAX_SIZE=16M \
        .venv/bin/python -m pytest -p no:cacheprovider "$@" \
        tests/test_endpoint.py tests/test_asyncio.py tests/test_stream.py tests/test_grpc.py tests/test_grpc_aio.py tests/test_grpc_scale.py tests/test_grpc_messages.py tests/test_verbs.py \
        tests/test_lifecycle.py tests/test_scale.py tests/test_faults.py tests/test_lifecycle_stateful.py \
        tests/test_load.py tests/test_dask.py tests/test_torch.py tests/test_auth.py tests/test_limits.py tests/test_posted.py tests/test_adapt.py \
        tests/test_packaging.py
    guest=$?
    [ "$guest" = 5 ] && guest=0      # a -k filter can leave nothing to run in the guest
    # 3. Two guests on a virtual wire (tools/wire.sh --ci): on verbs, tcp and ucx,
    #    integrity, a lossy delayed link, a peer killed, gRPC from stock grpcio;
    #    `bash tools/wire.sh` runs the whole wire suite.
    echo "== the wire: two Soft-RoCE guests, the CI subset"
    bash tools/wire.sh --ci "$@"
    wire=$?
    [ "$wire" = 5 ] && wire=0
    [ "$wire" = 0 ] || guest=$wire
else
    echo "== Soft-RoCE: verbs suites SKIPPED: $why"
fi
[ "$host" = 0 ] && [ "$guest" = 0 ]
