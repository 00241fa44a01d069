"""An asyncio echo server and its clients.

One event loop serves every connection (a task per client, no threads); the
clients run concurrently in a second process, each on its own connection.

    python examples/asyncio_echo.py [--backend tcp|ucx|verbs]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys

import fabric

CLIENTS = 3
MESSAGES = 5


async def echo(ep: fabric.Endpoint) -> None:
    """Serve one connection: send every message back until the client closes."""
    async with ep:
        try:
            while True:
                msg = await ep.arecv()           # never blocks the loop
                await ep.asend(msg)              # a received Message is a buffer: send it back as is
        except fabric.ConnectionClosed:
            pass                                 # the client closed its end


async def client(fab: fabric.Fabric, address: str, number: int) -> None:
    async with await fab.aconnect(address, timeout=30) as ep:
        for i in range(MESSAGES):
            text = f"client {number}, message {i}".encode()
            await ep.asend(text)
            reply = await ep.arecv(timeout=30)
            if reply != text:                    # a Message compares equal to bytes of the same content
                raise RuntimeError(f"client {number} got {bytes(reply)!r} back for {text!r}")


async def clients(address: str, backend: str | None) -> None:
    async with fabric.Fabric(backend) as fab:    # one Fabric serves every connection of the loop
        await asyncio.gather(*(client(fab, address, n) for n in range(CLIENTS)))


def run_clients(address: str, backend: str | None) -> None:
    """The peer process."""
    asyncio.run(clients(address, backend))


async def serve(backend: str | None) -> int:
    async with fabric.Fabric(backend) as fab:
        with fab.listen("127.0.0.1:0") as lst:
            # "spawn", not fork: a forked child cannot use its parent's Fabric (nor UCX at all)
            peer = multiprocessing.get_context("spawn").Process(target=run_clients, args=(lst.address, backend))
            peer.start()
            tasks = []
            for _ in range(CLIENTS):
                ep = await lst.aaccept(timeout=30)
                tasks.append(asyncio.create_task(echo(ep)))
            await asyncio.gather(*tasks)
        await asyncio.to_thread(peer.join, 30)   # wait for the process without blocking the loop
        if peer.exitcode != 0:
            print(f"the clients failed (exit code {peer.exitcode})", file=sys.stderr)
            return 1
        print(f"asyncio_echo: {CLIENTS} clients x {MESSAGES} messages echoed over {fab.name}: OK")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="asyncio echo server and clients")
    parser.add_argument("--backend", help="tcp, ucx or verbs (default: $FABRIC_BACKEND, else auto)")
    return asyncio.run(serve(parser.parse_args().backend))


if __name__ == "__main__":
    sys.exit(main())
