"""PNG plots of fabric-perf results, in the style of the paper's figures:
latency and bandwidth against message size on log axes, one line per
backend/protocol (plus message rate and RPC panels when measured)."""
from __future__ import annotations


def require():
    """Raise SystemExit with what to install if matplotlib cannot be imported."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"fabric-perf --plot needs matplotlib, which does not import here ({e}): "
                         "pip install matplotlib (or pip install 'fabric-transport[perf]'); "
                         "nothing was measured") from None
    return matplotlib


def _pyplot():
    matplotlib = require()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def panels_for(results: dict) -> list[str]:
    present = [t for t in ("lat", "bw", "rate", "rpc") if any(run.get(t) for run in results["runs"])]
    return present or ["lat", "bw"]


def write(results: dict, path: str, title: str | None = None) -> str:
    plt = _pyplot()
    panels = panels_for(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for run in results["runs"]:
            rows = run.get(panel) or []
            if not rows:
                continue
            if panel == "lat":
                ax.plot([r["size"] for r in rows], [r["p50_us"] for r in rows], marker="o", ms=3, label=run["label"])
            elif panel == "bw":
                ax.plot([r["size"] for r in rows], [r["MBps"] for r in rows], marker="o", ms=3, label=run["label"])
            elif panel == "rate":
                ax.plot([r["size"] for r in rows], [r["msgs_per_s"] for r in rows], marker="o", ms=3,
                        label=run["label"])
                if any("msgs_per_s_no_coalescing" in r for r in rows):
                    ax.plot([r["size"] for r in rows], [r.get("msgs_per_s_no_coalescing", float("nan")) for r in rows],
                            marker="x", ms=3, ls="--", label=run["label"] + " no coalescing")
            else:
                pulls = [r for r in rows if r["request"] <= r["response"]]
                pushes = [r for r in rows if r["request"] > r["response"]]
                for part, key, name in ((pulls, "response", "small request, large response"),
                                        (pushes, "request", "large request, small response")):
                    if part:
                        ax.plot([r[key] for r in part], [r["p50_us"] for r in part], marker="o", ms=3,
                                label=f"{run['label']} {name}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)" if panel != "rpc" else "larger of request/response (bytes)")
        ax.set_ylabel({"lat": "round trip p50 (us)", "bw": "bandwidth (MB/s)",
                       "rate": "messages per second", "rpc": "call p50 (us)"}[panel])
        ax.set_title({"lat": "Latency", "bw": "Bandwidth", "rate": "Message rate", "rpc": "RPC"}[panel])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    host = results.get("machine", {}).get("host", "")
    fig.suptitle(title or f"fabric-perf on {host} ({results.get('created', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
