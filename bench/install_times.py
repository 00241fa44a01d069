"""What installing fabric costs a user (issue 27): the wheel's size, the time
to install it into a fresh venv against the time to build and install the
sdist there, and the time `import fabric` takes, side by side in one run.

    .venv/bin/python bench/install_times.py --wheel dist/X.whl --sdist dist/X.tar.gz \
        --rounds 3 --json bench/results/install_times.json

Each round makes two fresh venvs and installs the wheel into one and the
sdist into the other (alternating which goes first), both with the [ucx]
extra and pip's cache on (the libucx wheel and the build requirements come
from the cache: the difference is the build, not the download). The import
time is the median of 20 fresh interpreters running `import fabric` minus 20
running `pass`, in the wheel's venv.
"""
from __future__ import annotations

# (Not bench/packaging.py: tests put bench/ on sys.path, where that name hid
# the `packaging` distribution from the processes they spawn.)

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _timed(cmd, **kw):
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    took = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(f"{cmd} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return took


def _venv(where):
    subprocess.run([sys.executable, "-m", "venv", where], check=True)
    python = os.path.join(where, "bin", "python")
    return python


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "VIRTUAL_ENV", "PYTHON"))}


def install_time(target, work, name):
    python = _venv(os.path.join(work, name))
    took = _timed([python, "-m", "pip", "install", "-q", f"{target}[ucx]"], env=_env(), cwd=work)
    return python, took


def import_time(python, cwd, runs=20):
    def median(code):
        times = []
        for _ in range(runs):
            times.append(_timed([python, "-c", code], env=_env(), cwd=cwd))
        return statistics.median(times)
    return median("import fabric") - median("pass")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--sdist", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    wheel, sdist = os.path.abspath(args.wheel), os.path.abspath(args.sdist)
    rows = {"wheel_install_s": [], "sdist_install_s": [], "import_s": []}
    for r in range(args.rounds):
        work = tempfile.mkdtemp(prefix="fabric-pkg-bench-")
        try:
            order = [("wheel", wheel), ("sdist", sdist)]
            if r % 2:
                order.reverse()
            for name, target in order:
                python, took = install_time(target, work, name)
                rows[f"{name}_install_s"].append(round(took, 2))
                if name == "wheel":
                    rows["import_s"].append(round(import_time(python, work), 4))
                print(f"round {r + 1}: {name} installed in {took:.1f} s", file=sys.stderr)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": "python bench/install_times.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wheel": os.path.basename(wheel), "wheel_bytes": os.path.getsize(wheel),
        "sdist_bytes": os.path.getsize(sdist), "cores": os.cpu_count(),
        **rows,
        "median": {k: statistics.median(v) for k, v in rows.items()},
        "sdist_over_wheel": round(statistics.median(rows["sdist_install_s"])
                                  / statistics.median(rows["wheel_install_s"]), 1),
    }
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
