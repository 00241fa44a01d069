"""Collectives and their algorithms: all_reduce by recursive doubling or
by a pipelined ring (the choice from the fabric's capabilities), broadcast
and reduce by binomial trees, rings for all_gather and reduce_scatter,
pairwise all_to_all, dissemination barrier. A mixin of
FabricProcessGroup: the transfers (_exchange, _send, _recv, _post, _wait)
and the collectives thread (_submit) are the group's."""
from __future__ import annotations

import torch

from fabric.torch._common import COLL
from fabric.torch._p2p import _Deadline
from fabric.torch._tensors import (_byte_view, _check_op, _contiguous, _finish_avg, _op_of, _reduce_into,
                                   _split_points)

# all_reduce takes the ring from RING_MIN bytes (FABRIC_TORCH_RING_MIN),
# measured (bench/torch_compare.py @ring against @doubling; RESULTS.md):
# recursive doubling wins below 2-4 MiB on ucx at 2 ranks and on tcp and ucx
# at 4, below 0.5-1 MiB on tcp at 2 ranks. The
# ring moves pieces of a quarter of a segment, within CHUNK_MIN..CHUNK_MAX
# bytes (FABRIC_TORCH_CHUNK fixes the size). Read per group. Measured in
# bench/torch_compare.py: fixed 1 MiB pieces lose up to 25% at 256 MiB to
# per-message costs, 16 MiB pieces lose the pipelining at 16 MiB.
RING_MIN = 2 << 20
RING_MIN_SERVED_PAIR = 512 << 10  # two ranks on a fabric whose pulls the peer's CPU serves (tcp)
CHUNK_MIN = 1 << 20
CHUNK_MAX = 16 << 20


def _ring_min_for(capabilities: tuple[str, ...], size: int) -> int:
    """Where all_reduce switches to the ring, from what the fabric can do.
    Recursive doubling moves the whole tensor each step, the ring about
    twice the tensor in all; where every byte costs the CPU at both ends
    (the peer's side serves our pulls: "reads_served", tcp) the ring's
    smaller volume pays off from 512 KiB at two ranks; with one-sided or
    native transfers (verbs, ucx) doubling's fewer steps win up to 2 MiB."""
    if size == 2 and "reads_served" in capabilities and "native_read" not in capabilities:
        return RING_MIN_SERVED_PAIR
    return RING_MIN


UNFOLD = 1 << 30            # step number of recursive doubling's last transfer


class Collectives:
    """The collectives of FabricProcessGroup."""

    def _scratch_space(self, nbytes: int) -> torch.Tensor:
        """Scratch memory for incoming pieces, kept between collectives (only
        the collectives' thread uses it): a fresh allocation of tens of MiB
        costs a page fault per page on every call."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ---- all_reduce
    def _allreduce_flat(self, t: torch.Tensor, op, deadline: _Deadline, seq: int) -> None:
        """All-reduce a contiguous 1-D tensor in place."""
        n = self._size
        if n == 1 or t.numel() == 0:
            _finish_avg(t, op, n)
            return
        if t.numel() * t.element_size() < self._ring_min or t.numel() < n:
            self._allreduce_doubling(t, op, deadline, seq)
            _finish_avg(t, op, n)
        else:
            self._allreduce_ring(t, op, deadline, seq)        # averages each segment itself

    def _allreduce_doubling(self, t, op, deadline, seq) -> None:
        n, r = self._size, self._rank
        p2 = 1 << (n.bit_length() - 1)
        rem = n - p2
        buf = _byte_view(t)
        # the group's scratch space, not fresh pages per call (collectives run
        # one at a time on this group's thread, so nothing else holds it)
        tmp = self._scratch_space(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        tmp_buf = _byte_view(tmp)
        step = 0
        # fold: the first 2*rem ranks pair up, the even one hands over its data
        if r < 2 * rem:
            if r % 2 == 0:
                self._wait_sent(self._send(r + 1, (COLL, step, seq), buf), deadline)
                newrank = -1
            else:
                self._recv(r - 1, (COLL, step, seq), tmp_buf, deadline)
                _reduce_into(t, tmp, op)
                newrank = r // 2
        else:
            newrank = r - rem
        step += 1
        if newrank >= 0:
            mask = 1
            while mask < p2:
                partner_new = newrank ^ mask
                partner = partner_new * 2 + 1 if partner_new < rem else partner_new + rem
                self._exchange(partner, buf, partner, tmp_buf, (COLL, step, seq), deadline)
                # every rank reduces the same two halves in the same order: identical results
                lo, hi = (t, tmp) if newrank < partner_new else (tmp, t)
                if lo is t:
                    _reduce_into(t, tmp, op)
                else:
                    _reduce_into(tmp, t, op)
                    t.copy_(tmp)
                mask <<= 1
                step += 1
        # unfold: the ranks that handed over get the result back (a step
        # number of its own: the two sides went through different loops)
        if r < 2 * rem:
            if r % 2 == 0:
                self._recv(r + 1, (COLL, UNFOLD, seq), buf, deadline)
            else:
                self._wait_sent(self._send(r - 1, (COLL, UNFOLD, seq), buf), deadline)

    def _allreduce_ring(self, t, op, deadline, seq) -> None:
        """Ring reduce-scatter then ring all-gather, in chunks (a quarter of a
        segment, 1 to 16 MiB) pipelined along the ring: a chunk goes on to the next rank as soon as
        it is reduced (or, in the all-gather, received), while later chunks
        are still on the wire. Incoming chunks land in two alternating
        scratch buffers (reduce-scatter) or straight in the tensor
        (all-gather)."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        points = _split_points(t.numel(), n)
        seg = [t[points[i]:points[i + 1]] for i in range(n)]
        piece = self._chunk or min(max(points[1] * t.element_size() // 4, CHUNK_MIN), CHUNK_MAX)
        per_chunk = max(1, piece // t.element_size())

        def chunks(i):
            size = seg[i].numel()
            return [(a, min(a + per_chunk, size)) for a in range(0, size, per_chunk)]

        def key(step, c):
            return (COLL, (step << 32) | c, seq)

        biggest = max(s.numel() for s in seg)
        space = self._scratch_space(2 * biggest * t.element_size()).view(t.dtype)
        scratch = [space[:biggest], space[biggest:2 * biggest]]
        sends: list = []

        def post_rs(s):
            i = (r - s - 1) % n
            return [self._post(left, key(s, c), _byte_view(scratch[s % 2][a:b])) for c, (a, b) in enumerate(chunks(i))]

        def post_ag(s):
            i = (r - s) % n
            return [self._post(left, key(n - 1 + s, c), _byte_view(seg[i][a:b])) for c, (a, b) in enumerate(chunks(i))]

        # reduce-scatter: at step s this rank sends segment r-s (its own
        # data at step 0, then what it reduced at step s-1) and reduces
        # segment r-s-1 with what arrives from the left
        waiting = post_rs(0)
        for c, (a, b) in enumerate(chunks(r)):
            sends += self._send(right, key(0, c), _byte_view(seg[r][a:b]))
        gathered = None
        for s in range(n - 1):
            i = (r - s - 1) % n
            last = s == n - 2
            upcoming = post_rs(s + 1) if not last else None
            if last:
                gathered = [post_ag(g) for g in range(n - 1)]
            for c, (a, b) in enumerate(chunks(i)):
                self._wait(left, waiting[c], deadline)
                mine = seg[i][a:b]
                _reduce_into(mine, scratch[s % 2][a:b], op)
                if last:
                    _finish_avg(mine, op, n)        # segment r+1 is this rank's, fully reduced
                    sends += self._send(right, key(n - 1, c), _byte_view(mine))
                else:
                    sends += self._send(right, key(s + 1, c), _byte_view(mine))
            waiting = upcoming
        # all-gather: each reduced segment travels once around the ring
        for s in range(n - 1):
            i = (r - s) % n
            for c, (a, b) in enumerate(chunks(i)):
                self._wait(left, gathered[s][c], deadline)
                if s < n - 2:
                    sends += self._send(right, key(n + s, c), _byte_view(seg[i][a:b]))
        self._wait_sent(sends, deadline)

    def _start_reduction(self, tensors, opts):
        """Check the tensors and the op at the call (a refusal leaves the
        group in step), then number the collective: (op, sequence)."""
        self._check_devices(tensors)
        op = _op_of(opts)
        for t in tensors:
            _check_op(op, t.dtype)
        return op, self._next_seq()

    def allreduce(self, tensors, opts=None):
        op, seq = self._start_reduction(tensors, opts)

        def run(deadline):
            for i, t in enumerate(tensors):
                work = _contiguous(t).reshape(-1)
                self._allreduce_flat(work, op, deadline, seq * 64 + i)
                if work.data_ptr() != t.data_ptr() or not t.is_contiguous():
                    t.copy_(work.view(t.shape))
        return self._submit("all_reduce", run, tensors, getattr(opts, "timeout", None))

    def allreduce_coalesced(self, tensors, opts=None):
        op, seq = self._start_reduction(tensors, opts)

        def run(deadline):
            by_dtype: dict = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for k, group in enumerate(by_dtype.values()):
                flat = torch.cat([t.reshape(-1) for t in group]) if group else None
                self._allreduce_flat(flat, op, deadline, seq * 64 + k)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
        return self._submit("all_reduce_coalesced", run, tensors, getattr(opts, "timeout", None))

    # ---- broadcast and reduce (binomial trees)
    def broadcast(self, tensors, opts=None):
        self._check_devices(tensors)
        root = opts.rootRank if opts is not None else 0
        seq = self._next_seq()

        def run(deadline):
            n, r = self._size, self._rank
            for i, t in enumerate(tensors):
                work = _contiguous(t)
                buf = _byte_view(work)
                vr = (r - root) % n
                mask = 1
                while mask < n:                         # receive from the parent
                    if vr & mask:
                        self._recv((vr - mask + root) % n, (COLL, i, seq), buf, deadline)
                        break
                    mask <<= 1
                mask >>= 1
                reqs = []
                while mask > 0:                         # send to the children
                    if vr + mask < n:
                        reqs += self._send((vr + mask + root) % n, (COLL, i, seq), buf)
                    mask >>= 1
                self._wait_sent(reqs, deadline)
                if work is not t:
                    t.copy_(work)
        return self._submit("broadcast", run, tensors, getattr(opts, "timeout", None))

    def reduce(self, tensors, opts=None):
        self._check_devices(tensors)
        root = opts.rootRank if opts is not None else 0
        op = _op_of(opts)
        for t in tensors:
            _check_op(op, t.dtype)
        seq = self._next_seq()

        def run(deadline):
            n, r = self._size, self._rank
            for i, t in enumerate(tensors):
                # non-roots reduce into a copy: reduce leaves their input unchanged
                work = _contiguous(t).clone() if r != root else _contiguous(t)
                tmp = torch.empty_like(work)
                vr = (r - root) % n
                mask = 1
                while mask < n:
                    if vr & mask:
                        self._wait_sent(self._send((vr - mask + root) % n, (COLL, i, seq), _byte_view(work)),
                                        deadline)
                        break
                    if vr + mask < n:
                        self._recv((vr + mask + root) % n, (COLL, i, seq), _byte_view(tmp), deadline)
                        _reduce_into(work, tmp, op)
                    mask <<= 1
                if r == root:
                    _finish_avg(work, op, n)
                    if work is not t:
                        t.copy_(work)
        return self._submit("reduce", run, tensors, getattr(opts, "timeout", None))

    # ---- gathers and scatters (rings and direct)
    def _ring_allgather(self, blocks: list, deadline, seq, tag0=0) -> None:
        """blocks[i] (contiguous) holds rank i's part; blocks[rank] is filled."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        for s in range(n - 1):
            out_i, in_i = (r - s) % n, (r - s - 1) % n
            self._exchange(right, _byte_view(blocks[out_i]), left, _byte_view(blocks[in_i]),
                           (COLL, tag0 + s, seq), deadline)

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        seq = self._next_seq()

        def run(deadline):
            for i, (outs, inp) in enumerate(zip(output_tensors, input_tensors)):
                blocks = [_contiguous(o) for o in outs]
                blocks[self._rank].copy_(inp)
                self._ring_allgather(blocks, deadline, seq, tag0=i * self._size)
                for o, b in zip(outs, blocks):
                    if o is not b:
                        o.copy_(b)
        return self._submit("all_gather", run, output_tensors, getattr(opts, "timeout", None))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output, input, opts=None):
        self._check_devices(output, input)
        seq = self._next_seq()

        def run(deadline):
            work = _contiguous(output)
            flat = work.reshape(-1)
            per = input.numel()
            if flat.numel() != per * self._size:
                raise ValueError("all_gather_into_tensor: the output must hold world_size inputs")
            blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
            blocks[self._rank].copy_(input.reshape(-1))
            self._ring_allgather(blocks, deadline, seq)
            if work is not output:
                output.copy_(work)
        return self._submit("all_gather_into_tensor", run, output, getattr(opts, "timeout", None))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check_devices(outputs, inputs)
        seq = self._next_seq()

        def run(deadline):
            for k, (output, input) in enumerate(zip(outputs, inputs)):
                work = _contiguous(output)
                flat = work.reshape(-1)
                per = input.numel()
                blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
                blocks[self._rank].copy_(input.reshape(-1))
                self._ring_allgather(blocks, deadline, seq, tag0=k * self._size)
                if work is not output:
                    output.copy_(work)
        return self._submit("all_gather_into_tensor_coalesced", run, outputs, getattr(opts, "timeout", None))

    def _ring_reduce_scatter(self, blocks: list, op, deadline, seq, tag0=0) -> torch.Tensor:
        """blocks[i]: this rank's contribution to rank i's result (left
        unchanged); returns the reduced block for this rank."""
        n, r = self._size, self._rank
        right, left = (r + 1) % n, (r - 1) % n
        acc = [b.clone() for b in blocks]
        tmp = torch.empty(max((b.numel() for b in blocks), default=0), dtype=blocks[0].dtype)
        for s in range(n - 1):
            out_i, in_i = (r - s - 1) % n, (r - s - 2) % n
            incoming = tmp[:acc[in_i].numel()]
            self._exchange(right, _byte_view(acc[out_i]), left, _byte_view(incoming),
                           (COLL, tag0 + s, seq), deadline)
            _reduce_into(acc[in_i], incoming, op)
        mine = acc[r]
        _finish_avg(mine, op, n)
        return mine

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        op = _op_of(opts)
        for t in output_tensors:
            _check_op(op, t.dtype)
        seq = self._next_seq()

        def run(deadline):
            for i, (out, ins) in enumerate(zip(output_tensors, input_tensors)):
                blocks = [_contiguous(b).reshape(-1) for b in ins]
                out.copy_(self._ring_reduce_scatter(blocks, op, deadline, seq, i * self._size).view(out.shape))
        return self._submit("reduce_scatter", run, output_tensors, getattr(opts, "timeout", None))

    def _reduce_scatter_base(self, output, input, opts=None):
        self._check_devices(output, input)
        op = _op_of(opts)
        _check_op(op, output.dtype)
        seq = self._next_seq()

        def run(deadline):
            flat = _contiguous(input).reshape(-1)
            per = output.numel()
            if flat.numel() != per * self._size:
                raise ValueError("reduce_scatter_tensor: the input must hold world_size outputs")
            blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
            output.copy_(self._ring_reduce_scatter(blocks, op, deadline, seq).view(output.shape))
        return self._submit("reduce_scatter_tensor", run, output, getattr(opts, "timeout", None))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._check_devices(outputs, inputs)
        op = _op_of(opts)
        seq = self._next_seq()

        def run(deadline):
            for k, (output, input) in enumerate(zip(outputs, inputs)):
                _check_op(op, output.dtype)
                flat = _contiguous(input).reshape(-1)
                per = output.numel()
                blocks = [flat[i * per:(i + 1) * per] for i in range(self._size)]
                output.copy_(self._ring_reduce_scatter(blocks, op, deadline, seq, k * self._size)
                             .view(output.shape))
        return self._submit("reduce_scatter_tensor_coalesced", run, outputs, getattr(opts, "timeout", None))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        seq = self._next_seq()

        def run(deadline):
            self._pairwise([_contiguous(t) for t in input_tensors], output_tensors, deadline, seq)
        return self._submit("all_to_all", run, output_tensors, getattr(opts, "timeout", None))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._check_devices(output, input)
        seq = self._next_seq()

        def run(deadline):
            n = self._size
            src = _contiguous(input)
            dst = _contiguous(output)

            def pieces(t, splits):
                rows = t.shape[0] if t.dim() else 1
                splits = list(splits) if splits else [rows // n] * n
                if sum(splits) != rows or len(splits) != n:
                    raise ValueError("all_to_all_single: split sizes must name a count per rank "
                                     "and add up to the tensor's first dimension")
                out, at = [], 0
                for s in splits:
                    out.append(t[at:at + s])
                    at += s
                return out
            ins = pieces(src, input_split_sizes)
            outs = pieces(dst, output_split_sizes)
            self._pairwise(ins, outs, deadline, seq)
            if dst is not output:
                output.copy_(dst)
        return self._submit("all_to_all_single", run, output, getattr(opts, "timeout", None))

    def _pairwise(self, ins, outs, deadline, seq) -> None:
        n, r = self._size, self._rank
        outs[r].copy_(ins[r])
        for s in range(1, n):
            to, frm = (r + s) % n, (r - s) % n
            dest = _contiguous(outs[frm])
            self._exchange(to, _byte_view(_contiguous(ins[to])), frm, _byte_view(dest), (COLL, s, seq), deadline)
            if dest is not outs[frm]:
                outs[frm].copy_(dest)

    def gather(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        root = opts.rootRank if opts is not None else 0
        seq = self._next_seq()

        def run(deadline):
            inp = _contiguous(input_tensors[0])
            if self._rank != root:
                self._wait_sent(self._send(root, (COLL, 0, seq), _byte_view(inp)), deadline)
                return
            outs = output_tensors[0]
            for peer in range(self._size):
                if peer == root:
                    outs[peer].copy_(inp)
                    continue
                dest = _contiguous(outs[peer])
                self._recv(peer, (COLL, 0, seq), _byte_view(dest), deadline)
                if dest is not outs[peer]:
                    outs[peer].copy_(dest)
        return self._submit("gather", run, output_tensors, getattr(opts, "timeout", None))

    def scatter(self, output_tensors, input_tensors, opts=None):
        self._check_devices(output_tensors, input_tensors)
        root = opts.rootRank if opts is not None else 0
        seq = self._next_seq()

        def run(deadline):
            out = output_tensors[0]
            if self._rank != root:
                dest = _contiguous(out)
                self._recv(root, (COLL, 0, seq), _byte_view(dest), deadline)
                if dest is not out:
                    out.copy_(dest)
                return
            ins = [_contiguous(t) for t in input_tensors[0]]
            reqs = []
            for peer in range(self._size):
                if peer != root:
                    reqs += self._send(peer, (COLL, 0, seq), _byte_view(ins[peer]))
            out.copy_(ins[root])
            self._wait_sent(reqs, deadline)
        return self._submit("scatter", run, output_tensors, getattr(opts, "timeout", None))

    def barrier(self, opts=None):
        seq = self._next_seq()

        def run(deadline):
            n, r = self._size, self._rank
            k = 1
            step = 0
            while k < n:                     # dissemination: log2(n) rounds
                self._exchange((r + k) % n, b"", (r - k) % n, bytearray(), (COLL, step, seq), deadline)
                k <<= 1
                step += 1
        return self._submit("barrier", run, [], getattr(opts, "timeout", None))

    # ---- point to point: started on the caller's thread, never queued
    # behind collectives or other receives (an irecv posted first must not
    # hold up a send issued after it); sends complete on the group's send
    # thread, receives on the peer's reader thread.
    # torch 2.13's names for the single-tensor and coalesced variants
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
