"""One rank of a torch.distributed job for tests/test_torch.py.

    python tests/torch_ranks.py SCENARIO[+SCENARIO...]

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (env:// init) and runs the
scenario; exits 0 on success, prints what went wrong to stderr otherwise.
Each scenario creates a gloo group and a fabric group over the same ranks
where it compares them: same inputs, results equal (bit-exact for integers,
within rounding for floating point), and both against a reference computed
here from every rank's (deterministic) inputs.
"""
from __future__ import annotations

import datetime
import gc
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import fabric.torch  # noqa: F401 - registers the backend

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
FAILURES: list[str] = []

# every dtype torch's CPU kernels can reduce, and the ones they can only move
REDUCIBLE = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
             torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
MOVABLE = REDUCIBLE + [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
                       torch.complex32]
LIGHT = bool(os.environ.get("FABRIC_TEST_TORCH_LIGHT"))
if LIGHT:
    # the Soft-RoCE guest (TCG, ~20x slower): a float, an integer and bool,
    # every op and size, against the reference only (gloo's side does not
    # depend on the fabric and runs on the host)
    REDUCIBLE = [torch.float32, torch.int64, torch.bool]
    MOVABLE = REDUCIBLE + [torch.bfloat16]
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
       ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
SIZES = [0, 1, 7, 1_000_003]


def check(cond, what):
    if not cond:
        FAILURES.append(what)


def applies(op, dtype) -> bool:
    floating = dtype.is_floating_point or dtype.is_complex
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return not floating
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return not dtype.is_complex
    if op == ReduceOp.AVG:
        return floating
    if dtype.is_complex:
        return op == ReduceOp.SUM           # torch.distributed refuses the others for complex
    return True


def make(rank, n, dtype, salt=0):
    """Rank `rank`'s input: small values, so products and sums stay exact
    where the dtype allows."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        re = torch.randint(-3, 4, (n,), generator=g).double()
        im = torch.randint(-3, 4, (n,), generator=g).double()
        return torch.complex(re, im).to(dtype)
    if dtype.is_floating_point:
        return (torch.randint(-4, 5, (n,), generator=g).float() / 4).to(dtype)
    if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return torch.randint(0, 3, (n,), generator=g).to(dtype)
    return torch.randint(-3, 4, (n,), generator=g).to(dtype)


def reference(op, tensors):
    acc = tensors[0].clone()
    for t in tensors[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = acc | t if acc.dtype == torch.bool else acc + t
        elif op == ReduceOp.PRODUCT:
            acc = acc & t if acc.dtype == torch.bool else acc * t
        elif op == ReduceOp.MIN:
            acc = torch.minimum(acc, t)
        elif op == ReduceOp.MAX:
            acc = torch.maximum(acc, t)
        elif op == ReduceOp.BAND:
            acc = acc & t
        elif op == ReduceOp.BOR:
            acc = acc | t
        elif op == ReduceOp.BXOR:
            acc = acc ^ t
    if op == ReduceOp.AVG:
        acc = acc / len(tensors)
    return acc


def same(a, b, exact):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if exact or a.numel() == 0:
        return torch.equal(a, b)
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(a.dtype, 1e-5)
    return torch.allclose(a.to(torch.complex128 if a.is_complex() else torch.float64),
                          b.to(torch.complex128 if b.is_complex() else torch.float64), rtol=tol, atol=tol)


def exact_for(dtype):
    return not (dtype.is_floating_point or dtype.is_complex)


def run_both(fn, fab, gloo):
    """fn(group) -> tensor(s); the fabric result, and gloo's or None where
    gloo refuses the case."""
    out = fn(fab)
    if LIGHT:
        return out, None
    try:
        ref = fn(gloo)
    except (RuntimeError, ValueError, TypeError):
        ref = None
    return out, ref


# ------------------------------------------------------------ scenarios

def collectives():
    gloo = dist.new_group(backend="gloo")
    fab = dist.new_group(backend="fabric")
    n_cases = 0
    # all_reduce: every dtype and op; sizes 0, 1, 7 for all, 1,000,003 for
    # each dtype (SUM) and each op (on float32 and int64)
    for dtype in REDUCIBLE:
        for op in OPS:
            if not applies(op, dtype):
                continue
            sizes = [0, 1, 7] + ([1_000_003] if op == ReduceOp.SUM or dtype in (torch.float32, torch.int64)
                                 else [])
            for n in sizes:
                inputs = [make(r, n, dtype) for r in range(WORLD)]
                expected = reference(op, inputs)

                def allreduce(group):
                    t = inputs[RANK].clone()
                    dist.all_reduce(t, op=op, group=group)
                    return t
                out, ref = run_both(allreduce, fab, gloo)
                exact = exact_for(dtype) and op != ReduceOp.AVG
                check(same(out, expected, exact), f"all_reduce {dtype} {op} n={n}: differs from the reference")
                if ref is not None:
                    check(same(out, ref, exact), f"all_reduce {dtype} {op} n={n}: differs from gloo")
                n_cases += 1
    # an op torch cannot apply to a dtype is refused at the call, the group goes on
    try:
        dist.all_reduce(torch.ones(3), op=ReduceOp.BXOR, group=fab)
        FAILURES.append("BXOR on float32 was accepted")
    except (ValueError, RuntimeError):
        pass
    # the other collectives: every dtype they move (and reduce, where they reduce)
    for dtype in MOVABLE:
        for n in SIZES:
            if n == 1_000_003 and dtype not in (torch.float32, torch.bfloat16, torch.int8, torch.bool):
                continue
            data = [make(r, n, dtype, salt=5) for r in range(WORLD)]
            exact = exact_for(dtype)
            # broadcast from every root
            for root in range(WORLD):
                def bcast(group, root=root):
                    t = data[RANK].clone()
                    dist.broadcast(t, src=root, group=group)
                    return t
                out, ref = run_both(bcast, fab, gloo)
                check(torch.equal(out.view(torch.uint8), data[root].view(torch.uint8)),
                      f"broadcast {dtype} n={n} root={root}")
            # all_gather (list) and all_gather_into_tensor

            def gather_list(group):
                outs = [torch.empty(n, dtype=dtype) for _ in range(WORLD)]
                dist.all_gather(outs, data[RANK], group=group)
                return torch.stack(outs)
            out, _ = run_both(gather_list, fab, gloo)
            check(torch.equal(out.view(torch.uint8), torch.stack(data).view(torch.uint8)),
                  f"all_gather {dtype} n={n}")

            def gather_tensor(group):
                out = torch.empty(WORLD * n, dtype=dtype)
                dist.all_gather_into_tensor(out, data[RANK], group=group)
                return out
            out, _ = run_both(gather_tensor, fab, gloo)
            check(torch.equal(out.view(torch.uint8), torch.cat(data).view(torch.uint8)),
                  f"all_gather_into_tensor {dtype} n={n}")
            # gather and scatter to and from every root
            for root in range(WORLD):
                lst = [torch.empty(n, dtype=dtype) for _ in range(WORLD)] if RANK == root else None
                dist.gather(data[RANK], lst, dst=root, group=fab)
                if RANK == root:
                    check(all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(lst, data)),
                          f"gather {dtype} n={n} root={root}")
                got = torch.empty(n, dtype=dtype)
                pieces = [make(r, n, dtype, salt=9 + root) for r in range(WORLD)]
                dist.scatter(got, pieces if RANK == root else None, src=root, group=fab)
                check(torch.equal(got.view(torch.uint8), pieces[RANK].view(torch.uint8)),
                      f"scatter {dtype} n={n} root={root}")
            # all_to_all (lists) and all_to_all_single with uneven splits
            ins = [make(RANK * WORLD + d, n, dtype, salt=3) for d in range(WORLD)]
            outs = [torch.empty(n, dtype=dtype) for _ in range(WORLD)]
            dist.all_to_all(outs, ins, group=fab)
            check(all(torch.equal(outs[s].view(torch.uint8), make(s * WORLD + RANK, n, dtype, salt=3)
                                  .view(torch.uint8)) for s in range(WORLD)), f"all_to_all {dtype} n={n}")
            splits_of = [[(s + d + n) % 3 for d in range(WORLD)] for s in range(WORLD)]   # rank s sends splits_of[s][d] rows to d
            src = make(RANK, sum(splits_of[RANK]), dtype, salt=11)
            recv_splits = [splits_of[s][RANK] for s in range(WORLD)]
            dst = torch.empty(sum(recv_splits), dtype=dtype)
            dist.all_to_all_single(dst, src, recv_splits, splits_of[RANK], group=fab)
            expect = []
            for s in range(WORLD):
                theirs = make(s, sum(splits_of[s]), dtype, salt=11)
                at = sum(splits_of[s][:RANK])
                expect.append(theirs[at:at + splits_of[s][RANK]])
            check(torch.equal(dst.view(torch.uint8), torch.cat(expect).view(torch.uint8)),
                  f"all_to_all_single {dtype} n={n}")
            if dtype not in REDUCIBLE:
                continue
            for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.BXOR):
                if not applies(op, dtype):
                    continue
                exact_op = exact and op != ReduceOp.AVG
                # reduce to every root
                for root in range(WORLD):
                    def red(group, root=root, op=op):
                        t = data[RANK].clone()
                        dist.reduce(t, dst=root, op=op, group=group)
                        return t
                    out, ref = run_both(red, fab, gloo)
                    if RANK == root:
                        check(same(out, reference(op, data), exact_op), f"reduce {dtype} {op} n={n} root={root}")
                    else:
                        check(torch.equal(out.view(torch.uint8), data[RANK].view(torch.uint8)),
                              f"reduce {dtype} {op} n={n}: a non-root's input changed")
                # reduce_scatter (list) and reduce_scatter_tensor
                blocks = [[make(r, n, dtype, salt=20 + d) for d in range(WORLD)] for r in range(WORLD)]
                expect = reference(op, [blocks[r][RANK] for r in range(WORLD)])

                def rs_list(group, op=op):
                    out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(out, [b.clone() for b in blocks[RANK]], op=op, group=group)
                    return out
                out, ref = run_both(rs_list, fab, gloo)
                check(same(out, expect, exact_op), f"reduce_scatter {dtype} {op} n={n}")
                if ref is not None:
                    check(same(out, ref, exact_op), f"reduce_scatter {dtype} {op} n={n}: differs from gloo")

                def rs_tensor(group, op=op):
                    out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(out, torch.cat(blocks[RANK]), op=op, group=group)
                    return out
                out, _ = run_both(rs_tensor, fab, gloo)
                check(same(out, expect, exact_op), f"reduce_scatter_tensor {dtype} {op} n={n}")
    # the ring in many small pieces (64 KiB), each of which must land whole
    os.environ["FABRIC_TORCH_CHUNK"] = "65536"
    small_pieces = dist.new_group(backend="fabric")
    del os.environ["FABRIC_TORCH_CHUNK"]
    for dtype, op in ((torch.float32, ReduceOp.SUM), (torch.int64, ReduceOp.MAX), (torch.bfloat16, ReduceOp.AVG)):
        inputs = [make(r, 1_000_003, dtype, salt=31) for r in range(WORLD)]
        t = inputs[RANK].clone()
        dist.all_reduce(t, op=op, group=small_pieces)
        check(same(t, reference(op, inputs), exact_for(dtype) and op != ReduceOp.AVG),
              f"all_reduce {dtype} {op} in 64 KiB pieces")
    # non-contiguous tensors in and out
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8) + RANK
    t = base.t()                                    # not contiguous
    dist.all_reduce(t, group=fab)
    check(torch.equal(t, sum(torch.arange(40, dtype=torch.float32).reshape(5, 8) + r for r in range(WORLD)).t()),
          "all_reduce of a transposed tensor")
    col = torch.zeros(6, 4)[:, 1]                   # a strided column
    if RANK == 0:
        col.copy_(torch.arange(6.0))
    dist.broadcast(col, src=0, group=fab)
    check(torch.equal(col, torch.arange(6.0)), "broadcast into a strided column")
    # async_op: every call returns at once; the works complete on their own
    works = [dist.all_reduce(torch.full((1 << 16,), float(RANK)), group=fab, async_op=True) for _ in range(8)]
    works.append(dist.barrier(group=fab, async_op=True))
    for w in works:
        w.wait()
    check(all(w.is_completed() for w in works), "async works completed")
    fut = dist.all_reduce(torch.ones(4), group=fab, async_op=True).get_future()
    check(torch.equal(fut.wait()[0], torch.full((4,), float(WORLD))), "a work's future carries the result")
    # all_reduce_coalesced (the coalescing manager of torch's own API)
    ts = [torch.full((5,), float(RANK)), torch.full((3,), 2 * RANK, dtype=torch.int32)]
    with dist._coalescing_manager(group=fab):
        for x in ts:
            dist.all_reduce(x, group=fab)
    total = sum(range(WORLD))
    check(torch.equal(ts[0], torch.full((5,), float(total))) and torch.equal(ts[1], torch.full((3,), 2 * total,
          dtype=torch.int32)), "coalesced all_reduce")
    dist.barrier(group=fab)
    print(f"rank {RANK}: {n_cases} all_reduce cases and the other collectives", file=sys.stderr)


def p2p():
    fab = dist.new_group(backend="fabric")
    peer = (RANK + 1) % WORLD
    prev = (RANK - 1) % WORLD
    # tags out of order: the receiver asks for tag 2 before tag 1
    a, b = torch.full((10,), float(RANK)), torch.arange(70000, dtype=torch.float64) + RANK
    reqs = [dist.isend(a, peer, group=fab, tag=1), dist.isend(b, peer, group=fab, tag=2)]
    got_b, got_a = torch.empty(70000, dtype=torch.float64), torch.empty(10)
    dist.recv(got_b, prev, group=fab, tag=2)
    dist.recv(got_a, prev, group=fab, tag=1)
    for r in reqs:
        r.wait()
    check(torch.equal(got_a, torch.full((10,), float(prev))), "tag 1 after tag 2")
    check(torch.equal(got_b, torch.arange(70000, dtype=torch.float64) + prev), "tag 2 first")
    # irecv and batch_isend_irecv
    sends = [dist.P2POp(dist.isend, torch.full((3,), float(RANK * 10 + k)), peer, group=fab, tag=k)
             for k in range(3)]
    bufs = [torch.empty(3) for _ in range(3)]
    recvs = [dist.P2POp(dist.irecv, bufs[k], prev, group=fab, tag=k) for k in range(3)]
    for w in dist.batch_isend_irecv(sends + recvs):
        w.wait()
    check(all(torch.equal(bufs[k], torch.full((3,), float(prev * 10 + k))) for k in range(3)), "batch_isend_irecv")
    # a receive posted first holds up nothing issued after it: every rank
    # waits for its receive from the previous rank before sending to the next
    # (gloo runs this; a backend that queued p2p in issue order would hang)
    first = dist.irecv(buf := torch.empty(5), prev, group=fab, tag=7)
    late = torch.empty(5)
    second = dist.irecv(late, peer, group=fab, tag=8)
    dist.isend(torch.full((5,), float(RANK)), prev, group=fab, tag=8).wait()
    second.wait()
    dist.isend(torch.full((5,), float(RANK)), peer, group=fab, tag=7).wait()
    first.wait()
    check(torch.equal(buf, torch.full((5,), float(prev))) and torch.equal(late, torch.full((5,), float(peer))),
          "receives posted before the sends they wait for")
    # receives from any rank (src=None): each sender once, the source reported
    if RANK == 0:
        seen = {}
        for _ in range(WORLD - 1):
            got = torch.empty(4)
            src = dist.recv(got, group=fab, tag=50)
            seen[src] = got
        check(sorted(seen) == list(range(1, WORLD)), f"sources of receives from any rank: {sorted(seen)}")
        check(all(torch.equal(v, torch.full((4,), float(k))) for k, v in seen.items()),
              "receives from any rank: data of the wrong rank")
    else:
        dist.send(torch.full((4,), float(RANK)), 0, group=fab, tag=50)
    # rank 1 sends more than FABRIC_TORCH_EARLY_MAX bytes that rank 0 posts no
    # receive for: rank 0 gives up on rank 1 with an error naming the limit
    # (it does not hold them all), and rank 1's sends fail
    os.environ["FABRIC_TORCH_EARLY_MAX"] = str(1 << 20)
    flooded = dist.new_group(backend="fabric", timeout=datetime.timedelta(seconds=30))
    del os.environ["FABRIC_TORCH_EARLY_MAX"]
    if RANK == 1:
        floods = [dist.isend(torch.zeros(1 << 16), 0, group=flooded, tag=91 + k) for k in range(8)]  # 8 x 256 KiB
        try:
            for w in floods:
                w.wait()
        except RuntimeError:
            pass                        # rank 0 closed the connection: expected, not required
    elif RANK == 0:
        try:
            dist.recv(torch.empty(4), 1, group=flooded, tag=90)
            FAILURES.append("a receive completed that nothing was sent for")
        except RuntimeError as e:
            check("FABRIC_TORCH_EARLY_MAX" in str(e), f"an early-transfer flood reported as: {e}")
    dist.barrier()                      # (gloo, the default group)
    # tensors fabric cannot move are refused at the call; the group goes on
    try:
        dist.all_reduce(torch.ones(4).to_sparse(), group=fab)
        FAILURES.append("a sparse tensor was accepted")
    except (ValueError, RuntimeError):
        pass
    # tensors of different sizes on the ranks: a clear error on every rank, no hang
    mismatched = dist.new_group(backend="fabric", timeout=datetime.timedelta(seconds=30))
    for n in (10, 100000):
        try:
            dist.all_reduce(torch.ones(n + RANK), group=mismatched)
            FAILURES.append(f"all_reduce of {n} and {n + 1} elements on different ranks succeeded")
        except RuntimeError as e:
            check("expected" in str(e) or "gave up" in str(e), f"a size mismatch reported as: {e}")
        mismatched = dist.new_group(backend="fabric", timeout=datetime.timedelta(seconds=30))
    # a non-contiguous destination, large enough for the engine's rendezvous
    col = torch.zeros(300000, 2)[:, 1]
    if RANK == 0:
        dist.send(torch.arange(300000.0), 1, group=fab)
    elif RANK == 1:
        dist.recv(col, 0, group=fab)
        check(torch.equal(col, torch.arange(300000.0)), "recv into a strided column")
    # a receive nobody sends to fails at the group's timeout, and the group goes on
    short = dist.new_group(backend="fabric", timeout=datetime.timedelta(seconds=1))
    if RANK == 0:
        started = time.monotonic()
        try:
            dist.recv(torch.empty(1), 1, group=short, tag=99)
            FAILURES.append("a receive with no sender completed")
        except RuntimeError as e:
            check("timed out" in str(e), f"an unmatched receive: {e}")
            check(time.monotonic() - started < 10, "an unmatched receive took too long to time out")
    dist.barrier(group=fab)


def kill():
    """The last rank dies in the middle of a collective; the others must
    fail with an error naming it, within the group's timeout."""
    fab = dist.new_group(backend="fabric", timeout=datetime.timedelta(seconds=20))
    x = torch.ones(1 << 20)
    dist.all_reduce(x, group=fab)
    if RANK == WORLD - 1:
        os._exit(0)                            # gone, without a word
    started = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(x, group=fab)
        FAILURES.append("collectives went on without the dead rank")
    except RuntimeError as e:
        took = time.monotonic() - started
        check(f"rank {WORLD - 1} is gone" in str(e), f"the error does not name the dead rank: {e}")
        check(took < 20, f"the error came after {took:.1f} s")
        print(f"rank {RANK}: failed after {took:.3f} s: {e}", file=sys.stderr)
    # later operations fail at once, naming why
    try:
        dist.all_reduce(x, group=fab)
        FAILURES.append("a collective after the failure succeeded")
    except RuntimeError as e:
        check("not run" in str(e), f"a later collective: {e}")


def timeout():
    """A rank that never joins: the collective fails after the call's timeout."""
    fab = dist.new_group(backend="fabric", timeout=datetime.timedelta(seconds=2))
    if RANK == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(10), group=fab)
            FAILURES.append("an all_reduce without its peers completed")
        except RuntimeError as e:
            took = time.monotonic() - started
            check("timed out" in str(e) and "rank" in str(e), f"{e}")
            check(took < 15, f"the timeout took {took:.1f} s")
    dist.barrier()          # (gloo, the default group) everyone leaves together


def destroy():
    """destroy_process_group() leaves no fabric thread or descriptor behind."""
    import threading
    fds = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))
    for _ in range(2):
        fab = dist.new_group(backend="fabric")
        dist.all_reduce(torch.ones(100), group=fab)
        dist.destroy_process_group(fab)
    dist.barrier()
    time.sleep(0.2)
    check(len(os.listdir("/proc/self/fd")) <= fds, f"descriptors {fds} -> {len(os.listdir('/proc/self/fd'))}")
    check(len(os.listdir("/proc/self/task")) <= threads,
          f"threads {threads} -> {len(os.listdir('/proc/self/task'))}: {threading.enumerate()}")
    try:
        dist.all_reduce(torch.ones(1), group=fab)
        FAILURES.append("a destroyed group still ran a collective")
    except (RuntimeError, ValueError):
        pass


def ddp():
    """DDP trains a small CNN and an MLP with the same losses on fabric as on gloo."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def cnn():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                             nn.Flatten(), nn.Linear(64, 10))

    def mlp():
        return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def train(make_model, shape, group):
        torch.manual_seed(0)
        model = DDP(make_model(), process_group=group, bucket_cap_mb=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + RANK)
        losses = []
        for _ in range(6):
            x = torch.randn(8, *shape, generator=g)
            y = torch.randint(0, 10, (8,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    gloo = dist.new_group(backend="gloo")
    fab = dist.new_group(backend="fabric")
    for make_model, shape in [(cnn, (3, 16, 16)), (mlp, (32,))]:
        lf, pf = train(make_model, shape, fab)
        lg, pg = train(make_model, shape, gloo)
        check(all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(lf, lg)),
              f"{make_model.__name__} losses differ: fabric {lf} gloo {lg}")
        check(all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(pf, pg)),
              f"{make_model.__name__} parameters differ after training")


def _fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def default():
    """fabric as the default (world) group: init_process_group("fabric")."""
    fds = _fds()
    dist.init_process_group("fabric", init_method=os.environ.get("FABRIC_TEST_INIT", "env://"), rank=RANK,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    check(dist.get_backend() == "fabric", f"the default group runs {dist.get_backend()}")
    if os.environ.get("FABRIC_AUTH_KEY"):
        groups = [o for o in gc.get_objects() if type(o).__name__ == "FabricProcessGroup"]
        check(len(groups) == 1 and groups[0]._fabric.authenticated,
              f"FABRIC_AUTH_KEY is set, but the group's Fabric does not authenticate ({groups})")
    threads = len(os.listdir("/proc/self/task"))
    t = torch.full((1000,), float(RANK + 1))
    dist.all_reduce(t)
    check(torch.equal(t, torch.full((1000,), float(sum(range(1, WORLD + 1))))), "all_reduce on the world group")
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK})
    check(objs == [{"rank": r} for r in range(WORLD)], f"all_gather_object: {objs}")
    dist.barrier()
    dist.destroy_process_group()
    check(len(os.listdir("/proc/self/task")) < threads, "the group's threads outlived it")
    gc.collect()
    left = set(_fds().items()) - set(fds.items())
    # rank 0 serves the c10d store (env://): its sockets and its event loop's
    # pipe live as long as the store (rank 1 checks everything)
    left = {fd for fd, target in left if not (RANK == 0 and target.startswith(("socket:", "pipe:")))}
    check(not left, f"descriptors left behind: {[(fd, _fds().get(fd)) for fd in sorted(left)]}")


def leave():
    """The last rank sends 400 small tensors, destroys its group as soon as
    its sends are complete and exits; rank 0 takes them a second later:
    every one arrives (a complete send is held by the engine, not yet sent)."""
    fab = dist.new_group(backend="fabric")
    count = 400
    if RANK == WORLD - 1:
        works = [dist.isend(torch.full((4,), float(k)), 0, group=fab, tag=k) for k in range(count)]
        for w in works:
            w.wait()
        dist.destroy_process_group(fab)
        os._exit(0)                          # no barrier, no world teardown: gone
    if RANK == 0:
        time.sleep(1.0)
        got = torch.empty(4)
        for k in range(count):
            dist.recv(got, WORLD - 1, group=fab, tag=k)
            check(torch.equal(got, torch.full((4,), float(k))), f"tensor {k} from the rank that left")
            if FAILURES:
                break


SCENARIOS = {f.__name__: f for f in (collectives, p2p, kill, timeout, destroy, ddp, leave, default)}


def survivors_leave_together():
    """A survivor that left at once would be one more dead rank to the others,
    who might then name it instead of the rank that was killed: each survivor
    counts itself in the default group's store and waits for the rest. Rank 0
    serves that store, so it leaves last: once every other survivor has said
    it saw the count (a survivor still asking a store that has gone fails)."""
    store = dist.distributed_c10d._get_default_store()
    store.add("kill_survivors", 1)
    deadline = time.monotonic() + 30
    while store.add("kill_survivors", 0) < WORLD - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if RANK != 0:
        store.add("kill_survivors_left", 1)
        return
    while store.add("kill_survivors_left", 0) < WORLD - 2 and time.monotonic() < deadline:
        time.sleep(0.05)


def main():
    scenario = sys.argv[1]
    init = os.environ.get("FABRIC_TEST_INIT", "env://")
    if scenario == "default":
        try:
            default()
        except Exception:                   # noqa: BLE001 - reported as a failure
            FAILURES.append(traceback.format_exc())
        if FAILURES:
            print(f"rank {RANK} FAILED:\n" + "\n".join(FAILURES[:30]), file=sys.stderr)
        sys.exit(1 if FAILURES else 0)
    dist.init_process_group("gloo", init_method=init, rank=RANK, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for name in scenario.split("+"):    # several scenarios, one start-up
            SCENARIOS[name]()
    except Exception:                       # noqa: BLE001 - reported as a failure
        FAILURES.append(traceback.format_exc())
    if scenario == "kill":
        survivors_leave_together()
        os._exit(1 if FAILURES else 0)      # the default group cannot sync without the dead rank
    if FAILURES:
        print(f"rank {RANK} FAILED:\n" + "\n".join(FAILURES[:30]), file=sys.stderr)
    try:
        dist.destroy_process_group()
    except Exception:                        # noqa: BLE001
        pass
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
