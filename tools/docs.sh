#!/usr/bin/env bash
# Build the documentation site (docs/) into docs/_build/html.
#
#   bash tools/docs.sh           build (incremental) and say where index.html is
#   bash tools/docs.sh --check   fresh build with warnings as errors and broken
#                                cross-references failing (-W --keep-going -n),
#                                then the doctest builder; non-zero on any failure
#
# Uses .venv/bin/python (the interpreter the extensions are built for) and
# installs docs/requirements.txt into it when Sphinx, the PyData theme, MyST or
# matplotlib is missing. Runs from any directory; reads no stdin. Sphinx's own
# messages (warnings, errors) go to stderr; stdout has only this script's lines.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
DOCS="$ROOT/docs"
OUT="$DOCS/_build"

check=0
for arg in "$@"; do
    case "$arg" in
        --check) check=1 ;;
        -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "docs.sh: unknown argument $arg (use --check)" >&2; exit 2 ;;
    esac
done

if [ ! -x "$PY" ]; then
    echo "docs.sh: $PY is missing; run bash tools/test.sh or bash tools/setup.sh first" >&2
    exit 2
fi
if ! "$PY" -c 'import sphinx, pydata_sphinx_theme, myst_parser, matplotlib' </dev/null >/dev/null 2>&1; then
    echo "docs.sh: installing docs/requirements.txt into .venv"
    "$PY" -m pip install --quiet --disable-pip-version-check -r "$DOCS/requirements.txt" </dev/null >&2
fi

# the build sees no knob or profile of the developer's (conf.py clears them too)
unset FABRIC_PROFILE
export FABRIC_PROFILE=none MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1

cd "$ROOT"
status=0
if [ "$check" = 1 ]; then
    echo "docs.sh: html (-W --keep-going -n, fresh)"
    "$PY" -m sphinx -b html -E -q -W --keep-going -n -d "$OUT/doctrees" "$DOCS" "$OUT/html" </dev/null || status=1
    echo "docs.sh: doctest"
    "$PY" -m sphinx -b doctest -q -W --keep-going -n -d "$OUT/doctrees" "$DOCS" "$OUT/doctest" </dev/null \
        >"$OUT/doctest.log" 2>&1 || { status=1; cat "$OUT/doctest.log" >&2; }
else
    echo "docs.sh: html"
    "$PY" -m sphinx -b html -q -d "$OUT/doctrees" "$DOCS" "$OUT/html" </dev/null || status=1
fi

if [ "$status" != 0 ]; then
    echo "docs.sh: FAILED (see the messages above)"
    exit 1
fi
echo "docs.sh: $OUT/html/index.html"
