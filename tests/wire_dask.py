"""The far half of the wire suite's Dask cluster: a scheduler and one
worker in this process, on this host's address on the wire.

    python tests/wire_dask.py SCHEME      # prints the scheduler's address, serves until killed
"""
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distributed import Scheduler, Worker  # noqa: E402

import fabric.dask  # noqa: E402,F401 - the fabric+ schemes


async def main(scheme):
    host = os.environ.get("FABRIC_GUEST_ADDR", "127.0.0.1")
    async with Scheduler(protocol=scheme, host=host, port=0, dashboard_address=None) as scheduler:
        async with Worker(scheduler.address, host=host, protocol=scheme, nthreads=1):
            print(scheduler.address, flush=True)
            await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
