"""Markdown tables from a bench/p2p.py JSON file: python bench/report.py FILE"""
import json
import sys


def fmt_size(n):
    n = int(n)
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main(path):
    r = json.load(open(path))
    names = list(next(iter(r["latency_us"].values())).keys())
    fabric_names = [n for n in names if n.startswith("fabric/")]
    base = fabric_names[0]
    peers = [n for n in names if not n.startswith("fabric/")]
    out = ["| size | " + " | ".join(f"{n} RTT us" for n in names) + " | " +
           " | ".join(f"{base} / {p}" for p in peers) + " |",
           "|" + "---:|" * (1 + len(names) + len(peers))]
    for size, row in r["latency_us"].items():
        out.append(f"| {fmt_size(size)} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " | " +
                   " | ".join(f"{row[base] / row[p]:.2f}" for p in peers) + " |")
    out.append("")
    for size, row in r["throughput_MBps"].items():
        out.append(f"| one-way {fmt_size(size)} | " + " | ".join(f"{n} {row[n]:.0f} MB/s" for n in names) + " |")
        out.append("|---|" + "---|" * len(names))
        out.append(f"| ratio {base} / peer | " + " | ".join(f"{row[base] / row[n]:.2f}" for n in names) + " |")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
