"""Fuzz fabric's decoders with atheris, natively instrumented.

    python tools/fuzz.py build                    # instrumented copy of fabric in build/fuzz
    python tools/fuzz.py run TARGET [--time S] [--runs N] [--seed N] [--corpus DIR]
    python tools/fuzz.py all [--time S]           # every target in turn

The copy is built with clang (-fsanitize=address,fuzzer-no-link): libFuzzer
then sees coverage of the Cython decoders themselves, and AddressSanitizer
turns any out-of-bounds access or use-after-free into a crash report. It runs
with atheris' ASan runtime preloaded. Targets are in tests/fuzz/targets.py
(frame, tcp, handshake, auth, hpack, h2). The corpus grows in build/fuzz-corpus/TARGET
unless --corpus names another directory; crashes are written to
build/fuzz-crashes/. tests/test_fuzz.py runs each target for a few seconds
with a fixed seed.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build", "fuzz")
TARGETS = ("frame", "tcp", "handshake", "auth", "hpack", "h2")
SANITIZE = "-fsanitize=address,fuzzer-no-link"


def clang():
    for name in ("clang", "clang-19", "clang-18", "clang-17", "clang-16", "clang-15", "clang-14"):
        path = shutil.which(name)
        if path:
            return path
    return None


def asan_runtime():
    import atheris
    path = os.path.join(atheris.path(), "asan_with_fuzzer.so")
    return path if os.path.exists(path) else None


def why_unavailable():
    """None if native fuzzing can run here, else why not."""
    try:
        import atheris  # noqa: F401
    except ImportError:
        return "atheris is not installed (pip install atheris; Python 3.11-3.13 wheels)"
    if clang() is None:
        return "no clang to build the instrumented copy (apt install clang)"
    if asan_runtime() is None:
        return "this atheris has no asan_with_fuzzer.so (build atheris from source with clang)"
    return None


def built():
    return bool(glob.glob(os.path.join(BUILD, "fabric", "protocol", "engine*.so")))


def build(force=False):
    """Build fabric's extensions with sanitizer coverage into build/fuzz,
    beside a copy of its Python files (a self-contained package)."""
    if built() and not force:
        return BUILD
    cc = clang()
    env = dict(os.environ, CC=cc, LDSHARED=f"{cc} -shared", CFLAGS=f"{SANITIZE} -g -O1",
               LDFLAGS=SANITIZE, FABRIC_UCX="off", FABRIC_VERBS="off")
    shutil.rmtree(BUILD, ignore_errors=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", BUILD,
                    "--build-temp", os.path.join(ROOT, "build", "fuzz-tmp")],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    for path in glob.glob(os.path.join(ROOT, "fabric", "**", "*.py"), recursive=True):
        dest = os.path.join(BUILD, os.path.relpath(path, ROOT))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(path, dest)
    return BUILD


def fuzz_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = BUILD
    env["LD_PRELOAD"] = asan_runtime()
    # Python's own allocations are not instrumented; leaks at exit are not ours
    env["ASAN_OPTIONS"] = "detect_leaks=0:allocator_may_return_null=1:abort_on_error=1"
    return env


def run(target, seconds=None, runs=None, seed=None, corpus=None, quiet=False):
    """Run one target; returns (exit code, libFuzzer's output)."""
    corpus = corpus or os.path.join(ROOT, "build", "fuzz-corpus", target)
    crashes = os.path.join(ROOT, "build", "fuzz-crashes")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(crashes, exist_ok=True)
    committed = os.path.join(ROOT, "tests", "fuzz", "corpus", target)
    cmd = [sys.executable, os.path.join(ROOT, "tests", "fuzz", "targets.py"), target,
           f"-artifact_prefix={crashes}/{target}-", "-max_len=16384", "-timeout=10",
           "-rss_limit_mb=2048", "-print_final_stats=1"]
    if seconds:
        cmd.append(f"-max_total_time={int(seconds)}")
    if runs:
        cmd.append(f"-runs={int(runs)}")
    if seed is not None:
        cmd.append(f"-seed={int(seed)}")
    cmd.append(corpus)
    if os.path.isdir(committed):
        cmd.append(committed)
    p = subprocess.run(cmd, env=fuzz_env(), cwd=ROOT, capture_output=True, text=True)
    if not quiet:
        sys.stderr.write(p.stderr[-4000:])
    return p.returncode, p.stderr


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--force", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("target", choices=TARGETS)
    for p in (r, sub.add_parser("all")):
        p.add_argument("--time", type=float, default=60, help="seconds per target")
        p.add_argument("--runs", type=int)
        p.add_argument("--seed", type=int)
        p.add_argument("--corpus")
    args = ap.parse_args(argv)
    why = why_unavailable()
    if why:
        sys.exit(f"fuzz: {why}")
    build(force=getattr(args, "force", False))
    if args.cmd == "build":
        print(BUILD)
        return 0
    targets = [args.target] if args.cmd == "run" else list(TARGETS)
    worst = 0
    for t in targets:
        rc, _ = run(t, args.time, args.runs, args.seed, args.corpus)
        print(f"fuzz {t}: exit {rc}")
        worst = worst or rc
    return worst


if __name__ == "__main__":
    sys.exit(main())
