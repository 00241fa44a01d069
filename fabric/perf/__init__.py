"""fabric-perf: the perf tool (latency, bandwidth, message rate, RPC) and the
tuner that writes the engine's tuning profile. See fabric.perf.cli."""


def main(argv=None):
    from fabric.perf.cli import main as _main
    return _main(argv)
