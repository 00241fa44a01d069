#!/usr/bin/env bash
# The wire suite: two Soft-RoCE guests joined by a virtual Ethernet link
# (tools/softroce.py --guests 2). Guest 1 runs the tests; guest 2 runs
# tests/wire_agent.py, which starts their peers there and shapes its NIC.
# Runs tests/test_wire.py (integrity, a misbehaving link, 100 asyncio
# connections) and every two-process test of the endpoint, fault, asyncio,
# posted-receive and scale suites, on verbs, tcp and ucx
# (FABRIC_TEST_BACKENDS chooses). Extra arguments go to pytest.
#   --ci   the subset CI runs on every change (tools/test.sh): on every fabric
#          integrity with mixed sizes, a lossy delayed link (1 ms +- 0.2, 1%
#          loss), a peer killed mid-rendezvous, and gRPC from a stock grpcio
#          client to a fabric server on the other host
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
[ -x "$py" ] || bash tools/setup.sh test || exit 1
tests="tests/test_wire.py tests/test_endpoint.py tests/test_faults.py tests/test_asyncio.py tests/test_posted.py tests/test_scale.py"
extra=""
if [ "${1:-}" = --ci ]; then
    shift
    tests="tests/test_wire.py tests/test_endpoint.py"
    extra=" -k $(printf '%q' "mixed_sizes or delay-loss-1 or grpcio or peer_killed_mid_rendezvous")"
fi
for a in "$@"; do extra="$extra $(printf '%q' "$a")"; done
# rxe's counters (retransmissions, sequence errors, retries exhausted) say
# what the link did; each guest prints them when its part ends
counters='echo "rxe0 counters: $(rdma statistic show link rxe0/1 | tr -s " " | cut -d" " -f3-)"'
first="FABRIC_WIRE_AGENT=\$FABRIC_PEER_ADDR $py -m pytest -p no:cacheprovider -rfE$extra $tests; rc=\$?; $py tests/wire_agent.py quit; $counters; exit \$rc"
second="$py tests/wire_agent.py serve; rc=\$?; $counters; exit \$rc"
exec "$py" tools/softroce.py --guests 2 --cpus "${FABRIC_WIRE_CPUS:-1}" --timeout "${FABRIC_WIRE_TIMEOUT:-1800}" -- \
    env FABRIC_TEST_BACKENDS="${FABRIC_TEST_BACKENDS:-verbs,tcp,ucx}" FABRIC_TEST_CONNECTIONS="${FABRIC_TEST_CONNECTIONS:-100}" \
    sh -c "$first" ::: sh -c "$second"
