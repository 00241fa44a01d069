#!/bin/sh
# One side of the two-host run, inside a guest of `tools/softroce.py --guests 2`:
#   python tools/softroce.py --guests 2 -- \
#     sh tools/ucx_wireup_repro/wire.sh survivor 1000 -k self_after_ep -d 300 -c on_eof -p 50 ::: \
#     sh tools/ucx_wireup_repro/wire.sh peer 0 -k self_after_ep -d 300 -c on_eof -p 50
# Guest 1 runs the survivors (listening on its wire address), guest 2 the peers; UCX's tcp
# lanes use the wire NIC. Set UCX_TCP_CONN_NB=y on the host to run the workaround.
# The binary is the host's ./build.sh output (the guest sees the host's / read-only).
side=$1; n=$2; shift 2
cd "$(dirname "$0")" || exit 1
[ -x repro ] || { echo "build repro on the host first (./build.sh)"; exit 1; }
export UCX_TLS=tcp UCX_NET_DEVICES=$FABRIC_WIRE_DEV UCX_HANDLE_ERRORS=bt
if [ "$side" = survivor ]; then
    ./repro -n "$n" -L /tmp/wlogs -T 60 "$@" -l "$FABRIC_GUEST_ADDR:13337" 2>&1 | grep -v "UCX  ERROR\|UCX  WARN"
    # the guest's /tmp goes with it: print each crash's first UCX frames
    for f in /tmp/wlogs/iter-*.stderr; do
        [ -f "$f" ] || continue
        echo "--- $f"; grep -m4 "Caught signal\|Assertion\|ucp_\|uct_" "$f"
    done
else
    ./repro -T 60 "$@" -t "$FABRIC_PEER_ADDR:13337" 2>&1 | grep -v "UCX  ERROR\|UCX  WARN"
fi
