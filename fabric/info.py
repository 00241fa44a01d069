"""`python -m fabric info`: what fabric finds on this host, as a dict.

gather() returns everything (backends and auto's choice, the UCX library
and the transports it sees, RDMA devices, ports and GIDs with the one the
verbs backend would use, the tuning profile and every knob's value with
where it came from); format_text() renders it for a person, json.dumps() for
a program. Nothing here writes to stdout: helper programs (ucx_info,
ibv_devinfo) run with their output captured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import warnings

SYSFS_IB = "/sys/class/infiniband"
VERBS_ENV = ("FABRIC_VERBS_DEVICE", "FABRIC_VERBS_PORT", "FABRIC_VERBS_GID_INDEX")
VERBS_RULE = ("the first device (by name) with an ACTIVE port, narrowed by FABRIC_VERBS_DEVICE and "
              "FABRIC_VERBS_PORT; on Ethernet (RoCE) the first RoCE v2 GID holding an IPv4-mapped "
              "address, on InfiniBand GID index 0 (addressed by LID); FABRIC_VERBS_GID_INDEX forces the GID")
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IB_MTUS = (4096, 2048, 1024, 512, 256)
ROCE_HEADERS = 96      # GRH, UDP, BTH, XRC, AtomicETH and ICRC bytes the kernel subtracts from a netdev MTU


# ------------------------------------------------------------------ helpers

def human_size(n) -> str:
    """8 -> '8', 65536 -> '64K', 16 MiB -> '16M' (exact multiples of powers of 1024 only)."""
    n = int(n)
    for shift, suffix in ((40, "T"), (30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _run(cmd, env=None, timeout=20.0):
    """(returncode, stdout, stderr) of a helper program, its output captured
    (it never reaches our stdout), or (None, '', why) if it cannot run."""
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", str(e)
    return p.returncode, p.stdout, p.stderr


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# ----------------------------------------------------------------- backends

def gather_backends() -> dict:
    """Every known backend (usable, reason, and what auto made of it, in the
    order auto considers them), auto's order and choice, and which backend
    Fabric() with no argument would use."""
    from fabric import backends
    usable = backends.available()
    picked, steps = backends.explain_auto()
    table = {}
    for name, status, why in steps:
        table[name] = {"usable": usable[name][0], "reason": usable[name][1], "auto": status}
        if status == "skipped":
            table[name]["auto_reason"] = why
    for name, (ok, why) in usable.items():
        table.setdefault(name, {"usable": ok, "reason": why, "auto": None})
    env_choice = os.environ.get("FABRIC_BACKEND")
    return {"backends": table,
            "auto": {"picks": picked, "order": list(backends.auto_order()),
                     "summary": backends.auto_summary()},
            "default": {"backend": env_choice or "auto", "source": "FABRIC_BACKEND" if env_choice else "auto"}}


def backend_table(data: dict) -> str:
    """The backend table of `python -m fabric info` and `fabric-perf --list-backends`."""
    rows = data["backends"]
    width = max([len("backend")] + [len(n) for n in rows])
    lines = [f"  {'backend':<{width}}  usable  auto      why"]
    for name, row in rows.items():
        why = row["reason"]
        if row.get("auto") == "skipped":
            why += f"; {row['auto_reason']}"
        lines.append(f"  {name:<{width}}  {'yes' if row['usable'] else 'no':<6}  {row.get('auto') or '-':<8}  {why}")
    auto, default = data["auto"], data["default"]
    picks = auto["picks"] or "nothing usable"
    if default["source"] == "FABRIC_BACKEND":
        lines.append(f"  Fabric() uses FABRIC_BACKEND={default['backend']} (auto would pick {picks}, "
                     f"trying {', '.join(auto['order'])})")
    else:
        lines.append(f"  Fabric() uses auto: {picks} (auto tries {', '.join(auto['order'])}; FABRIC_BACKEND unset)")
    return "\n".join(lines)


# ---------------------------------------------------------------------- UCX

def _loaded_library(fragment: str) -> str | None:
    """Path of a shared library this process has mapped (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith(fragment):
                    return path
    except OSError:
        pass
    return None


def _ucx_info_candidates(libdir: str | None) -> list[tuple[str, str | None]]:
    """(ucx_info path, library dir to run it with): the one beside the
    library fabric loaded first, then the libucx wheel's, then $PATH's."""
    out = []
    if libdir:
        out.append((os.path.join(os.path.dirname(libdir), "bin", "ucx_info"), libdir))
    import importlib.util
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        spec = None
    if spec and spec.origin:
        base = os.path.dirname(spec.origin)
        out.append((os.path.join(base, "bin", "ucx_info"), os.path.join(base, "lib")))
    found = shutil.which("ucx_info")
    if found:
        out.append((found, None))
    seen, unique = set(), []
    for path, lib in out:
        if os.path.isfile(path) and os.access(path, os.X_OK) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            unique.append((path, lib))
    return unique


def parse_ucx_info(text: str) -> list[dict]:
    """[{'transport': 'tcp', 'device': 'lo'}, ...] from `ucx_info -d`."""
    out, transport = [], None
    for line in text.splitlines():
        body = line.lstrip("#").strip()
        if body.startswith("Transport:"):
            transport = body.split(":", 1)[1].strip()
        elif body.startswith("Device:") and transport:
            out.append({"transport": transport, "device": body.split(":", 1)[1].strip()})
    return out


def run_ucx_info(libdir: str | None) -> dict:
    cands = _ucx_info_candidates(libdir)
    if not cands:
        return {"path": None, "transports": [],
                "error": "ucx_info not found (not beside the UCX library, in the libucx wheel, or on PATH)"}
    path, lib = cands[0]
    env = dict(os.environ)
    env.setdefault("UCX_LOG_FILE", "stderr")
    if lib:
        env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    rc, out, err = _run([path, "-d"], env=env)
    if rc != 0:
        return {"path": path, "transports": [],
                "error": f"ucx_info -d failed ({'exit ' + str(rc) if rc is not None else 'not run'}): "
                         f"{_last_line(err) or 'no message'}"}
    return {"path": path, "transports": parse_ucx_info(out), "error": None}


def gather_ucx(user_env: dict) -> dict:
    """The UCX fabric was built against and the one it loaded, UCX_*
    settings, and what `ucx_info -d` lists."""
    from fabric import backends
    ok, reason = backends.available()["ucx"]
    info = {"usable": ok, "reason": reason, "compiled": None, "loaded": None, "library": None,
            "env": {k: v for k, v in sorted(user_env.items()) if k.startswith("UCX_")}}
    try:
        ucx_module = backends.load_module("ucx")
    except ImportError as e:
        info["error"] = f"the ucx backend does not load: {e}"
    else:
        built, loaded = ucx_module.runtime_version()
        info["compiled"], info["loaded"] = "%d.%d" % built, "%d.%d" % loaded
        info["library"] = _loaded_library("libucp.so")
    libdir = os.path.dirname(info["library"]) if info["library"] else None
    info["ucx_info"] = run_ucx_info(libdir)
    return info


# --------------------------------------------------------------------- RDMA

def _active_mtu(root: str, dev: str, port: str, link: str, ndev: str | None) -> tuple:
    """(MTU in bytes or None, how it was found). sysfs has no MTU file;
    ibv_devinfo asks the device; else on Ethernet the kernel's rule applied
    to the netdev's MTU is an estimate."""
    tool = shutil.which("ibv_devinfo")
    if tool and root == SYSFS_IB:
        rc, out, _ = _run([tool, "-d", dev, "-i", port], timeout=10)
        if rc == 0:
            for line in out.splitlines():
                if line.strip().startswith("active_mtu:"):
                    try:
                        return int(line.split(":", 1)[1].split()[0]), "ibv_devinfo"
                    except (ValueError, IndexError):
                        break
    if link == "Ethernet" and ndev:
        mtu = _read(f"/sys/class/net/{ndev}/mtu")
        if mtu and mtu.isdigit():
            usable = int(mtu) - ROCE_HEADERS
            for m in IB_MTUS:
                if usable >= m:
                    return m, f"estimated from {ndev} mtu {mtu}"
    return None, "unknown: ibv_devinfo (ibverbs-utils) reads it"


def _strip_code(text):
    """'4: ACTIVE' -> 'ACTIVE' (sysfs prefixes some values with their code)."""
    return text.split(":", 1)[1].strip() if text and ":" in text and text.split(":", 1)[0].isdigit() else text


def _ipv4_of(gid):
    """'192.0.2.1' for an IPv4-mapped GID (::ffff:c000:0201), else None."""
    prefix = "0000:0000:0000:0000:0000:ffff:"
    if not gid or not gid.startswith(prefix):
        return None
    try:
        hi, lo = (int(x, 16) for x in gid[len(prefix):].split(":"))
    except ValueError:
        return None
    return f"{hi >> 8}.{hi & 255}.{lo >> 8}.{lo & 255}"


def _verbs_choice(root: str, env) -> dict:
    """Which device, port and GID the verbs backend would use, by calling its
    own select_device(); the rule in words when the backend is not built."""
    settings = {k: env[k] for k in VERBS_ENV if env.get(k) not in (None, "")}
    out = {"rule": VERBS_RULE, "settings": settings}
    try:
        from fabric.backends import verbs
    except ImportError as e:
        out["error"] = f"the verbs backend is not built here ({e}); it would choose by this rule: {VERBS_RULE}"
        return out
    try:
        dev, port, gid, link = verbs.select_device(env=env, root=root)
    except LookupError as e:
        out["error"] = str(e)
        return out
    if "FABRIC_VERBS_GID_INDEX" in settings:
        why = f"FABRIC_VERBS_GID_INDEX={settings['FABRIC_VERBS_GID_INDEX']}"
    elif link != "Ethernet":
        why = f"{link}: addressed by LID, GID index 0"
    else:
        why = "the first RoCE v2 GID holding an IPv4-mapped address"
    where = (f"FABRIC_VERBS_DEVICE={settings['FABRIC_VERBS_DEVICE']}" if "FABRIC_VERBS_DEVICE" in settings
             else "the first device with an ACTIVE port")
    out.update({"device": dev, "port": port, "gid_index": gid, "link_layer": link,
                "why": f"{where}; {why}", "error": None})
    return out


def gather_rdma(root: str = SYSFS_IB, env=None) -> dict:
    """RDMA devices under `root` (/sys/class/infiniband): ports with state,
    link layer, active MTU and the non-empty GID table entries with their
    type, and the verbs backend's choice."""
    env = os.environ if env is None else env
    out = {"sysfs": root, "devices": [], "message": None}
    if not os.path.isdir(root):
        out["message"] = f"no RDMA devices (no {root})"
    elif not os.listdir(root):
        out["message"] = f"no RDMA devices ({root} is empty)"
    if out["message"]:
        out["choice"] = _verbs_choice(root, env)
        return out
    choice = _verbs_choice(root, env)
    for dev in sorted(os.listdir(root)):
        d = {"name": dev, "node_type": _strip_code(_read(f"{root}/{dev}/node_type")),
             "rxe": dev.startswith("rxe") or not os.path.exists(f"{root}/{dev}/device"), "ports": []}
        try:
            ports = sorted(os.listdir(f"{root}/{dev}/ports"), key=int)
        except (OSError, ValueError):
            ports = []
        for port in ports:
            pdir = f"{root}/{dev}/ports/{port}"
            link = _read(f"{pdir}/link_layer") or "InfiniBand"
            gids = []
            try:
                indices = sorted(os.listdir(f"{pdir}/gids"), key=int)
            except (OSError, ValueError):
                indices = []
            for idx in indices:
                gid = _read(f"{pdir}/gids/{idx}")
                chosen = (choice.get("device") == dev and choice.get("port") == int(port)
                          and choice.get("gid_index") == int(idx))
                if (not gid or gid == ZERO_GID) and not chosen:
                    continue
                gids.append({"index": int(idx), "gid": gid, "type": _read(f"{pdir}/gid_attrs/types/{idx}"),
                             "ndev": _read(f"{pdir}/gid_attrs/ndevs/{idx}"), "ipv4": _ipv4_of(gid),
                             "chosen": chosen})
            ndev = next((g["ndev"] for g in gids if g["ndev"]), None)
            mtu, mtu_how = _active_mtu(root, dev, port, link, ndev)
            d["ports"].append({"port": int(port), "state": _strip_code(_read(f"{pdir}/state")), "link_layer": link,
                               "lid": _read(f"{pdir}/lid"), "active_mtu": mtu, "active_mtu_from": mtu_how,
                               "gid_table_size": len(indices), "gids": gids})
        out["devices"].append(d)
    out["choice"] = choice
    return out


# -------------------------------------------------------------------- knobs

def gather_knobs(backend: str | None = None, overrides: dict | None = None) -> dict:
    """Every knob's effective value for the backend a Fabric(backend,
    **overrides) would use, and where each value came from."""
    from fabric import backends, options
    overrides = dict(overrides or {})
    name = backend or os.environ.get("FABRIC_BACKEND") or "auto"
    how = "argument" if backend else ("FABRIC_BACKEND" if os.environ.get("FABRIC_BACKEND") else "auto")
    path = options.profile_path()
    profile = {"path": path, "disabled": path is None, "exists": bool(path and os.path.exists(path)),
               "in_use": False, "warning": None}
    out = {"requested": name, "requested_by": how, "backend": None, "profile": profile, "values": {}, "error": None}
    try:
        b = backends.get(name)
    except Exception as e:        # BackendUnavailable, named in the report
        out["error"] = str(e).splitlines()[0]
        return out
    out["backend"] = b.name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resolved = options.resolve_sources(b.name, b.default_options(), overrides)
        except ValueError as e:
            out["error"] = str(e)
            resolved = {}
        tuned = options.read_profile(b.name) if not out["error"] else {}
    if caught:
        profile["warning"] = str(caught[0].message)
    profile["in_use"] = bool(tuned)
    profile["options"] = dict(tuned)
    for knob, (value, source) in resolved.items():
        row = {"value": value, "source": source, "env": options.env_name(knob), "kind": options.KNOBS[knob][0],
               "help": options.HELP.get(knob, "")}
        if source == "env":
            row["env_value"] = os.environ.get(options.env_name(knob))
        out["values"][knob] = row
    # thresholds the engine raises per connection to the link it measures
    adapting = options.adapting(resolved) if resolved else []
    for knob in adapting:
        bound = {"eager_limit": "the slab the peer accepts", "chunk_size": "adapt_max_chunk",
                 "chunks_in_flight": "adapt_max_window"}[knob]
        out["values"][knob]["adapts"] = f"the least; each connection raises it to its link's bandwidth-delay product, up to {bound}"
    out["adapting"] = adapting
    return out


def gather_grpc() -> dict:
    """fabric.grpc: which HTTP/2 core it runs on, and the grpcio it needs."""
    import glob
    import importlib.machinery
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpc")
    built = {name: any(glob.glob(os.path.join(here, name + s)) for s in importlib.machinery.EXTENSION_SUFFIXES)
             for name in ("_h2", "_hpack")}
    out = {"core_built": all(built.values()), "grpcio": None, "error": None}
    if out["core_built"]:
        out["core"] = "fabric's own, in C (fabric.grpc._h2: frames, streams, flow control; fabric.grpc._hpack: HPACK)"
    else:
        missing = ", ".join(f"fabric.grpc.{n}" for n, ok in built.items() if not ok)
        out["core"] = f"not built ({missing} missing): reinstall fabric-transport"
    try:
        import grpc
        out["grpcio"] = grpc.__version__
    except ImportError as e:
        out["error"] = f"fabric.grpc needs grpcio ({e}): pip install 'fabric-transport[grpc]'"
    return out


def gather_memory() -> dict:
    """Received-message memory: its bound, what is kept, the kernel's huge pages."""
    from fabric.protocol import engine
    stats = engine.recv_pool_stats()
    stats["limit_from"] = "env FABRIC_RECV_CACHE" if os.environ.get("FABRIC_RECV_CACHE") else \
        "default (an eighth of physical memory, 128 MiB to 1 GiB)"
    return stats


def format_memory(m: dict) -> list[str]:
    thp = m["transparent_huge_pages"]
    huge = {"always": "used", "madvise": "used (fabric asks with MADV_HUGEPAGE)",
            "never": "off in this kernel: 4 KiB pages"}.get(thp, "unavailable: 4 KiB pages")
    return ["", "receive memory (messages of 1 MiB or more: huge-page blocks, faulted in once, reused)",
            f"  keeps at most {human_size(m['limit'])} of free blocks ({m['limit_from']})",
            f"  transparent huge pages: {thp}: {huge}",
            f"  now: {m['blocks']} free blocks ({human_size(m['bytes'])}), "
            f"{m['in_use_blocks']} in use ({human_size(m['in_use_bytes'])})"]


# ------------------------------------------------------------------- report

def gather(backend: str | None = None, overrides: dict | None = None, sysfs: str = SYSFS_IB) -> dict:
    import fabric
    user_env = dict(os.environ)          # before probing ucx sets UCX_LOG_FILE
    data = {"fabric": {"version": fabric.__version__, "python": platform.python_version(),
                       "path": os.path.dirname(os.path.abspath(fabric.__file__)),
                       "platform": platform.platform()}}
    data.update(gather_backends())
    data["ucx"] = gather_ucx(user_env)
    data["rdma"] = gather_rdma(sysfs)
    data["knobs"] = gather_knobs(backend, overrides)
    data["grpc"] = gather_grpc()
    data["memory"] = gather_memory()
    return data


def _value_text(row: dict) -> str:
    v = row["value"]
    if row["kind"] == "size":
        return human_size(v)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _source_text(row: dict, knobs: dict) -> str:
    s = row["source"]
    if s == "env":
        return f"env {row['env']}={row.get('env_value')}"
    if s == "profile":
        s = "profile"
    elif s == "backend":
        s = f"{knobs['backend']} default"
    if row.get("adapts"):
        s += f" ({row['adapts']})"
    return s


def format_text(data: dict) -> str:
    f = data["fabric"]
    lines = [f"fabric {f['version']}  (Python {f['python']}, {f['path']})", "",
             f"backends (auto picks {data['auto']['picks'] or 'nothing usable'})", backend_table(data)]

    u = data["ucx"]
    lines += ["", "ucx"]
    if u["compiled"]:
        lines.append(f"  compiled against UCX {u['compiled']}, loaded {u['loaded']}"
                     + (f" ({u['library']})" if u["library"] else ""))
    else:
        lines.append(f"  {u.get('error') or u['reason']}")
    lines.append("  " + ("; ".join(f"{k}={v}" for k, v in u["env"].items()) if u["env"]
                         else "no UCX_* variables set"))
    ui = u["ucx_info"]
    if ui["error"]:
        lines.append(f"  transports: unknown: {ui['error']}")
    else:
        devices = {}
        for t in ui["transports"]:
            devices.setdefault(t["transport"], []).append(t["device"])
        listed = ", ".join(f"{t} ({', '.join(d)})" for t, d in devices.items()) or "none"
        lines.append(f"  transports (ucx_info -d): {listed}")
        lines.append(f"  ucx_info: {ui['path']}")

    r = data["rdma"]
    lines += ["", "rdma"]
    choice = r["choice"]
    if r["message"]:
        lines.append(f"  {r['message']}")
    for d in r["devices"]:
        kind = "rxe (Soft-RoCE)" if d["rxe"] else (d["node_type"] or "")
        lines.append(f"  {d['name']}  {kind}".rstrip())
        for p in d["ports"]:
            mtu = f"{p['active_mtu']} ({p['active_mtu_from']})" if p["active_mtu"] else p["active_mtu_from"]
            lines.append(f"    port {p['port']}: {p['state'] or '?'}, {p['link_layer']}, active MTU {mtu}; "
                         f"{len(p['gids'])} of {p['gid_table_size']} GIDs set")
            for g in p["gids"]:
                mark = "  <- verbs uses this" if g["chosen"] else ""
                lines.append(f"      gid {g['index']:>3}  {g['gid'] or '-':<39}  {g['type'] or '?':<10}  "
                             f"{g['ndev'] or '-':<8}  {g['ipv4'] or '':<15}{mark}".rstrip())
    if choice.get("error"):
        if not r["message"] or "not built" in choice["error"]:
            lines.append(f"  verbs: {choice['error']}")
    else:
        lines.append(f"  verbs uses {choice['device']} port {choice['port']} GID {choice['gid_index']} "
                     f"({choice['link_layer']}): {choice['why']}")
    lines.append(f"  rule: {choice['rule']}")
    if choice["settings"]:
        lines.append("  set: " + ", ".join(f"{k}={v}" for k, v in choice["settings"].items()))

    g = data.get("grpc")
    if g is not None:
        lines += ["", "grpc", f"  HTTP/2 core: {g['core']}",
                  f"  grpcio {g['grpcio']} (status codes, handler and call types)" if g["grpcio"] else f"  {g['error']}"]

    if data.get("memory") is not None:
        lines += format_memory(data["memory"])

    k = data["knobs"]
    p = k["profile"]
    if p["disabled"]:
        ptext = "none (FABRIC_PROFILE=none)"
    elif p["in_use"]:
        ptext = f"{p['path']} (in use for {k['backend']})"
    elif p["warning"]:
        ptext = f"{p['path']} ignored: {p['warning']}"
    elif p["exists"]:
        ptext = f"{p['path']} (no entry for {k['backend']})"
    else:
        ptext = f"{p['path']} (absent)"
    lines += ["", f"knobs for {k['backend'] or k['requested']} ({k['requested_by']})", f"  profile: {ptext}"]
    if k["error"]:
        lines.append(f"  {k['error']}")
    width = max((len(n) for n in k["values"]), default=0)
    vwidth = max((len(_value_text(row)) for row in k["values"].values()), default=0)
    for knob, row in k["values"].items():
        lines.append(f"  {knob:<{width}}  {_value_text(row):>{vwidth}}  {_source_text(row, k)}")
    return "\n".join(lines)


def gather_protocols(backend: str | None, overrides: dict) -> list[dict]:
    """For the named backend (default: every usable one), the engine's
    protocol for each range of message sizes with the options a Fabric would
    resolve here (profile, environment, `overrides`)."""
    from fabric import backends
    from fabric import options as _options
    from fabric.protocol import engine
    usable = backends.available()
    names = [backend] if backend else [n for n in backends.auto_order() if usable.get(n, (False,))[0]]
    tables = []
    for name in names:
        b = backends.get(name)
        sources = _options.resolve_sources(b.name, b.default_options(), overrides)
        opts = {k: v for k, (v, _) in sources.items()}
        profiled = sorted(k for k, (_, src) in sources.items() if src == "profile")
        variants = [(None, "")]
        if b.name == "ucx":
            # the error mode decides per connection (see fabric/backends/ucx.pyx)
            variants = [(True, "error mode PEER: network transports (tcp, rdma)"),
                        (False, "error mode NONE: shared memory, two processes of one host")]
        for native_only, note in variants:
            rows = engine.protocol_table(b, opts, native_only)
            tables.append({"backend": b.name, "variant": note, "profile_knobs": profiled,
                           "rows": [{"from": lo, "to": hi, "protocol": p, "how": how}
                                    for lo, hi, p, how in rows]})
    return tables


def format_protocols(tables: list[dict]) -> str:
    lines = []
    for t in tables:
        title = t["backend"] + (f" ({t['variant']})" if t["variant"] else "")
        if t["profile_knobs"]:
            title += "; tuned by the profile: " + ", ".join(t["profile_knobs"])
        lines.append(title)
        for r in t["rows"]:
            rng = f"{human_size(r['from'])} .. " + (human_size(r["to"]) if r["to"] is not None else "")
            lines.append(f"  {rng:<22} {r['protocol']:<11} {r['how']}")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fabric info",
                                 description="What fabric finds here: backends, UCX, RDMA devices, knobs.")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("-b", "--backend", default=None,
                    help="show the knobs of this backend (default: $FABRIC_BACKEND or auto, as Fabric())")
    ap.add_argument("-o", "--option", action="append", default=[], metavar="KNOB=VALUE",
                    help="a keyword argument as given to Fabric(), to see its effect (repeatable)")
    ap.add_argument("--protocols", action="store_true",
                    help="only which protocol each message size takes, per backend (as UCX_PROTO_INFO)")
    ap.add_argument("--sysfs", default=SYSFS_IB, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.option:
        if "=" not in item:
            ap.error(f"--option {item!r} is not KNOB=VALUE")
        key, value = item.split("=", 1)
        overrides[key.strip()] = value.strip()
    if args.protocols:
        tables = gather_protocols(args.backend, overrides)
        print(json.dumps(tables, indent=2) if args.json else format_protocols(tables))
        return 0
    data = gather(args.backend, overrides, sysfs=args.sysfs)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_text(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
