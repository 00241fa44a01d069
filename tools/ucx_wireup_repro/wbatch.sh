#!/bin/sh
# Fourth batch: workaround candidates against the two crashing kill points.
# Each line: name, then env assignments (or -), then repro options.
cd "$(dirname "$0")"
./build.sh >/dev/null 2>&1
export UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_HANDLE_ERRORS=bt
N=${N:-300}
run() {
    name=$1; envs=$2; shift 2
    [ "$envs" = "-" ] && envs=""
    echo "== $name: $envs ./repro -n $N $*" >> results.txt
    env $envs ./repro -n "$N" -L "logs/$name" "$@" 2>&1 | grep -v "UCX  ERROR\|UCX  WARN" | grep "RESULT\|CRASH\|HANG\|exit\|signal\|clean iterations" >> results.txt
}
B="-k self_before_ep -d 300 -c on_eof -p 50"
A="-k self_after_ep -d 300 -c on_eof -p 50"
run W0_before_base     -                          $B
run W1_before_check    -                          $B -C
run W2_before_no_rma   -                          $B -R
run W3_before_put_off  UCX_TCP_PUT_ENABLE=n       $B
run W4_before_conn_nb  UCX_TCP_CONN_NB=y          $B
run W5_before_retry25  UCX_TCP_MAX_CONN_RETRIES=25 $B
run W6_after_check     -                          $A -C
run W7_after_no_rma    -                          $A -R
run W8_after_put_off   UCX_TCP_PUT_ENABLE=n       $A
