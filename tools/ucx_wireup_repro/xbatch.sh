#!/bin/sh
# Fifth batch: UCX_TCP_CONN_NB=y (non-blocking connect) against every kill
# point that crashed, and error mode NONE, with more iterations.
cd "$(dirname "$0")"
./build.sh >/dev/null 2>&1
export UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_HANDLE_ERRORS=bt
N=${N:-600}
run() {
    name=$1; envs=$2; shift 2
    [ "$envs" = "-" ] && envs=""
    echo "== $name: $envs ./repro -n $N $*" >> results.txt
    env $envs ./repro -n "$N" -L "logs/$name" "$@" 2>&1 | grep -v "UCX  ERROR\|UCX  WARN" | grep "RESULT\|CRASH\|HANG\|exit\|signal\|clean iterations" >> results.txt
}
B="-k self_before_ep -d 300 -c on_eof -p 50"
A="-k self_after_ep -d 300 -c on_eof -p 50"
run X1_after_connnb        UCX_TCP_CONN_NB=y $A
run X2_after_base          -                 $A
run X3_before_connnb       UCX_TCP_CONN_NB=y $B
run X4_after_noam_connnb   UCX_TCP_CONN_NB=y $A -s 0
run X5_after_d0_connnb     UCX_TCP_CONN_NB=y -k self_after_ep -d 0 -c on_eof -p 50
run X6_survivor_connnb     UCX_TCP_CONN_NB=y -c after_cb -p 50
run X7_before_errnone      -                 $B -N
