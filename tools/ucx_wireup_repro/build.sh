#!/bin/sh
# Build repro against the libucx wheel (UCX 1.22) in /work/main/.venv, not Debian's 1.13.
set -e
cd "$(dirname "$0")"
PY=${PY:-/work/main/.venv/bin/python}
UCX_DIR=${UCX_DIR:-$($PY -c "import libucx, os; print(os.path.dirname(libucx.__file__))")}
cc -O1 -g -Wall -o repro repro.c -I"$UCX_DIR/include" -L"$UCX_DIR/lib" -Wl,-rpath,"$UCX_DIR/lib" -lucp -lucs
echo "built $(pwd)/repro against $UCX_DIR"
