"""fabric as a torch.distributed backend: ``init_process_group("fabric")``.

``import fabric.torch`` registers the backend "fabric" for CPU tensors. Each
process group opens a Fabric (backend from ``FABRIC_BACKEND``, else fabric's
automatic choice), listens, publishes its address in the c10d store and
connects to every other rank of the group at creation (a full mesh: rank j
dials every lower rank, which accepts), then stops listening.

Every call returns a Work at once, also for ``async_op=False`` (torch then
waits on it); the group's own threads make the progress, never the caller's:
- collectives run in the order they are issued (c10d's contract: every rank
  issues the group's collectives in the same order) on the group's
  collectives thread;
- one reader thread per peer receives everything that peer sends, in order,
  and puts each transfer straight into the buffer a receive was posted for
  (a tensor's own storage), or keeps it until one is posted;
- point-to-point operations start on the caller's thread: a send at once, a
  receive by posting it; neither waits behind a collective or another
  receive. A send thread completes their Works and times out receives.

Wire format between two ranks: each transfer is a 32-byte header (kind,
tag, collective sequence number, byte count), followed in the same fabric
message by the bytes when they are few (``INLINE``), otherwise by one fabric
message of its own, sent from the tensor's storage and received into the
destination's storage (zero-copy; large messages are pulled in chunks by the
engine).

Algorithms, by size: all_reduce below ``FABRIC_TORCH_RING_MIN`` bytes by
recursive doubling (log2 steps of whole tensors; folded for sizes that are
not powers of two), above it by a ring reduce-scatter then ring all-gather
pipelined in pieces; every rank ends with bit-identical results. broadcast
and reduce by binomial trees, all_gather and reduce_scatter by rings,
all_to_all pairwise, barrier by dissemination. Reductions run in place with
torch's own kernels (the GIL released while they run).

Failures: a rank that dies fails every operation waiting on it at once, with
an error naming the rank; the rank that saw it tells the others (ABORT), so
their pending collectives fail too; every wait ends at the operation's
timeout (the group's, or the call's own). ``destroy_process_group()`` closes
the group's Fabric and joins its threads.
"""
from __future__ import annotations

import torch.distributed as dist

from fabric.torch._collectives import RING_MIN, RING_MIN_SERVED_PAIR, _ring_min_for  # noqa: F401 (tests, tools)
from fabric.torch._common import BACKEND_NAME, FabricPGError
from fabric.torch._group import FabricProcessGroup

__all__ = ["BACKEND_NAME", "FabricPGError", "FabricProcessGroup"]
FabricPGError.__module__ = FabricProcessGroup.__module__ = __name__     # their public home


def _create_process_group(store, rank, size, timeout):
    return FabricProcessGroup(store, rank, size, timeout)


def _register() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])


_register()
