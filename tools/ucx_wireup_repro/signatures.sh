#!/bin/sh
# Classify the crashes kept in logs/*/ by their first UCX frames.
cd "$(dirname "$0")"
L=$(/work/main/.venv/bin/python -c "import libucx, os; print(os.path.dirname(libucx.__file__))")/lib
for f in logs/*/iter-*.stderr; do
    grep -q "Caught signal\|Assertion\|Fatal" "$f" || continue
    what=$(grep -m1 "Caught signal\|Assertion\|Fatal" "$f" | sed 's/^\[[^]]*\] *//; s/ at address.*//; s/(Segmentation fault: address not mapped to object/(SEGV/')
    frames=$(grep -E "^ *[0-9]+ +/" "$f" | grep -v "ucs_handle_error\|ucs_fatal_error\|libc.so\|repro(\|libucs.so.0(+0x3[0-9a-f]\{4\})" | head -4 |
        while read -r n obj; do
            lib=$(echo "$obj" | sed 's/(.*//; s/.*\///'); off=$(echo "$obj" | sed -n 's/.*(+\(0x[0-9a-f]*\)).*/\1/p')
            sym=$(echo "$obj" | sed -n 's/.*(\([a-z_A-Z0-9]*\)+.*/\1/p')
            if [ -z "$sym" ] && [ -n "$off" ]; then sym=$(addr2line -f -e "$L/$lib" "$off" 2>/dev/null | head -1); fi
            printf "%s < " "${sym:-?}"
        done)
    echo "$what | $frames"
done | sort | uniq -c | sort -rn
