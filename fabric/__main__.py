"""python -m fabric COMMAND: `info` reports what fabric finds on this host
(see fabric.info); fabric-perf is the perf tool."""
import sys

COMMANDS = {"info": "backends, UCX, RDMA devices and every knob's value with its source (--json)"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        out = sys.stdout if argv else sys.stderr
        print("usage: python -m fabric COMMAND [options]\n\ncommands:", file=out)
        for name, text in COMMANDS.items():
            print(f"  {name:<6} {text}", file=out)
        return 0 if argv else 2
    if argv[0] == "info":
        from fabric.info import main as info_main
        return info_main(argv[1:])
    print(f"python -m fabric: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
