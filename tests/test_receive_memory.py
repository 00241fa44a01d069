"""The memory large received messages land in (fabric/protocol/core/ready_memory.h):
huge-page blocks faulted in once and reused, bounded by FABRIC_RECV_CACHE."""
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import fabric
from fabric.protocol import engine

MIB = 1 << 20
READY_MIN = MIB            # FAB_RM_MIN
HUGE = 2 * MIB             # FAB_RM_ALIGN


def address(buf):
    return np.frombuffer(buf, np.uint8).ctypes.data if len(buf) else 0


def run_child(code, **env):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=100, env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr
    return out.stdout


class ReceiveMemory(RuleBasedStateMachine):
    """Buffers taken and dropped in any order: no two live buffers overlap
    (each keeps the pattern written into it), the free blocks kept stay
    within the bound, and the blocks in use are exactly the live large ones."""

    def __init__(self):
        super().__init__()
        gc.collect()
        self.start = engine.recv_pool_stats()
        self.live = {}          # id -> (buffer, fill byte)
        self.next_id = 0

    @rule(size=st.sampled_from([0, 1, 300 << 10, READY_MIN - 1, READY_MIN, READY_MIN + 1,
                                3 * MIB, 2 * HUGE, 5 * MIB + 7]))
    def take(self, size):
        buf = fabric.empty(size)
        assert len(buf) == size
        fill = self.next_id % 251 + 1
        if size:
            view = np.frombuffer(buf, np.uint8)
            view[:] = fill
            if size >= READY_MIN:
                assert address(buf) % HUGE == 0, "a ready block starts on a huge page"
        self.live[self.next_id] = (buf, fill)
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def drop(self, data):
        key = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[key]

    @rule()
    def trim(self):
        engine.trim_recv_memory()
        assert engine.recv_pool_stats()["blocks"] == 0

    @invariant()
    def patterns_intact(self):
        for buf, fill in self.live.values():
            if len(buf):
                view = np.frombuffer(buf, np.uint8)
                assert view[0] == fill and view[-1] == fill and view[len(view) // 2] == fill

    @invariant()
    def bounded_and_counted(self):
        s = engine.recv_pool_stats()
        assert s["bytes"] <= s["limit"] + (16 << 20)       # ready tier + the small malloc tier
        large = [b for b, _ in self.live.values() if len(b) >= READY_MIN]
        assert s["in_use_blocks"] - self.start["in_use_blocks"] == len(large)
        assert s["in_use_bytes"] - self.start["in_use_bytes"] >= sum(len(b) for b in large)

    def teardown(self):
        self.live.clear()


ReceiveMemory.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_receive_memory_state_machine = pytest.mark.timeout(120)(ReceiveMemory.TestCase)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", ["recv", "recv_into_empty"])
def test_a_receive_loop_stops_faulting_after_its_first_messages(way):
    """16 MiB messages: 4096 fresh small pages each without reuse; after the
    first two (one held by the application while the next arrives) the loop
    runs on pages already there."""
    out = run_child(f"""
        import resource, fabric
        fab = fabric.Fabric("tcp"); lst = fab.listen(); ep = fab.connect(lst.address, timeout=10)
        peer = lst.accept(timeout=10)
        data = bytes(range(256)) * (1 << 16)
        faults = []
        msg = None
        for i in range(8):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            req = ep.isend(data)
            if "{way}" == "recv":
                msg = peer.recv(timeout=30)
            else:
                msg = fabric.empty(len(data)); peer.recv_into(msg, timeout=30)
            req.wait(timeout=30)
            assert msg[:256] == data[:256] and msg[-256:] == data[-256:]
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        s = fab.receive_memory
        print(max(faults[3:]), s["reused"], s["mapped"])
        fab.close()
    """)
    worst, reused, mapped = map(int, out.split())
    assert worst < 256, f"{worst} page faults for one 16 MiB message after warm-up"
    assert reused >= 5 and mapped <= 3


@pytest.mark.timeout(60)
def test_free_blocks_kept_stay_within_fabric_recv_cache():
    out = run_child("""
        import fabric
        from fabric.protocol import engine
        big = [fabric.empty(8 << 20) for _ in range(3)]
        del big                                    # each larger than the bound: given back
        s = engine.recv_pool_stats()
        print(s["blocks"], s["unmapped"])
        small = [fabric.empty(2 << 20) for _ in range(5)]
        del small                                  # 2 MiB blocks: two fit in 4 MiB
        s = engine.recv_pool_stats()
        print(s["blocks"], s["bytes"], s["limit"])
    """, FABRIC_RECV_CACHE=str(4 << 20))
    first, second = out.splitlines()
    assert first.split() == ["0", "3"]
    blocks, kept, limit = map(int, second.split())
    assert limit == 4 << 20 and kept <= limit and blocks == 2


@pytest.mark.timeout(60)
def test_prepare_maps_blocks_ahead_and_trim_gives_them_back():
    out = run_child("""
        import ctypes, resource, fabric
        from fabric.protocol import engine
        print(fabric.prepare_receive_memory(32 << 20, count=2))
        s = engine.recv_pool_stats(); print(s["blocks"], s["bytes"])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buf = fabric.empty(32 << 20)
        ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 120, len(buf))   # pages already there
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del buf
        print(fabric.trim_receive_memory(), engine.recv_pool_stats()["blocks"])
    """)
    added, pooled, faults, trimmed = out.splitlines()
    assert added == "2"
    assert pooled.split() == ["2", str(64 << 20)]
    assert int(faults) < 64, f"{faults} faults writing a prepared block"
    assert trimmed.split() == [str(64 << 20), "0"]


@pytest.mark.timeout(60)
def test_a_forked_child_allocates_and_frees():
    out = run_child("""
        import os, fabric
        keep = fabric.empty(4 << 20)
        pid = os.fork()
        if pid == 0:
            bufs = [fabric.empty(4 << 20) for _ in range(3)]
            del bufs
            os._exit(0 if fabric.empty(4 << 20) is not None else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert out.strip() == "0"


def test_empty_rejects_a_negative_size():
    with pytest.raises(ValueError):
        fabric.empty(-1)
    with pytest.raises(ValueError):
        fabric.prepare_receive_memory(-1)


def test_info_reports_receive_memory():
    from fabric import info
    data = info.gather_memory()
    text = "\n".join(info.format_memory(data))
    assert "receive memory" in text and "transparent huge pages" in text
    assert data["limit"] > 0
