"""Everything fabric.grpc does with h2, hyperframe and hpack beyond their
public API, in one place, for speed. Written for h2 4.1 to 4.4,
hyperframe 6.x and hpack 4.x (tested with h2 4.4.1, hyperframe 6.1.0,
hpack 4.2.0). The internals used:

- H2Connection._frame_dispatch_table (h2 routes received frames by their
  exact class): one connection's own table gets a cheap-repr DataFrame
  subclass and a hook after GOAWAY; H2Connection.incoming_buffer (an
  h2.frame_buffer.FrameBuffer, still empty: its _data) is replaced by a
  subclass for that connection.
- hyperframe's DataFrame._body_repr and serialize_padding_data (the repr
  the subclass reproduces).
- H2Connection.state_machine (ConnectionInputs.SEND_DATA / RECV_DATA,
  ConnectionState.CLOSED / CLIENT_OPEN / SERVER_OPEN), _get_stream_by_id and
  _inbound_flow_control_window_manager.window_consumed; H2Stream's
  state_machine (StreamInputs.SEND_DATA / RECV_DATA), _inbound_window_manager
  and outbound_flow_control_window: large DATA frames written and read by
  fabric.grpc itself, with h2's bookkeeping kept as its send_data and
  receive_data would keep it.
- hpack's Encoder/Decoder header_table (maxsize, resized, dynamic_entries),
  and H2Connection.encoder/decoder replaced by memoizing wrappers.

Nothing here changes a class of another library: only the one
H2Connection object a driver hands to install() is touched.

At import the installed versions are checked against that range and every
internal is probed; if anything is missing (or FABRIC_GRPC_PLAIN_H2=1 is
set) AVAILABLE is False, REASON says why, install() leaves the connection
alone and the drivers use h2's public API only: every DATA frame through
h2, and a graceful GOAWAY ends the calls in flight with it (h2 refuses
frames once it has seen one).
"""
from __future__ import annotations

import binascii
import os
import struct

import h2
import h2.config
import h2.connection

# the range this module was written for (pyproject.toml pins the same for h2)
H2_VERSIONS = ((4, 1), (4, 5))               # >= 4.1, < 4.5
HYPERFRAME_VERSIONS = ((6, 0), (7, 0))
HPACK_VERSIONS = ((4, 0), (5, 0))

FRAME_HEADER = struct.Struct(">HBBBI")       # length (24 bits as H+B), type, flags, stream id
DATA, END_STREAM_FLAG, PADDED_FLAG = 0x0, 0x1, 0x8
FAST_DATA_MIN = 64 << 10                     # DATA frames from this size bypass h2's byte handling


def _version(text: str) -> tuple[int, int]:
    parts = (text.split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)


def _in_range(name: str, text: str, bounds) -> str | None:
    low, high = bounds
    if not low <= _version(text) < high:
        return f"{name} {text} is outside {'.'.join(map(str, low))} to <{'.'.join(map(str, high))}"
    return None


def _probe() -> str | None:
    """Why the internals cannot be used here, or None if they can."""
    if os.environ.get("FABRIC_GRPC_PLAIN_H2", "") not in ("", "0"):
        return "FABRIC_GRPC_PLAIN_H2 is set"
    try:
        import hpack
        import hyperframe
        from h2.connection import ConnectionInputs, ConnectionState
        from h2.frame_buffer import FrameBuffer
        from h2.stream import StreamInputs
        from hyperframe.frame import DataFrame, GoAwayFrame
    except ImportError as e:
        return f"an h2 module is missing: {e}"
    for name, module, bounds in (("h2", h2, H2_VERSIONS), ("hyperframe", hyperframe, HYPERFRAME_VERSIONS),
                                 ("hpack", hpack, HPACK_VERSIONS)):
        why = _in_range(name, getattr(module, "__version__", "0"), bounds)
        if why:
            return why
    for owner, names in ((ConnectionInputs, ("SEND_DATA", "RECV_DATA")),
                         (ConnectionState, ("CLOSED", "CLIENT_OPEN", "SERVER_OPEN")),
                         (StreamInputs, ("SEND_DATA", "RECV_DATA")),
                         (DataFrame, ("_body_repr", "serialize_padding_data"))):
        for name in names:
            if not hasattr(owner, name):
                return f"{owner.__name__}.{name} is missing"
    # a real connection with a real stream: the attributes live on instances
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", "/p"), (":authority", "a")])
    table = getattr(conn, "_frame_dispatch_table", None)
    if not isinstance(table, dict) or DataFrame not in table or GoAwayFrame not in table:
        return "H2Connection._frame_dispatch_table is not a dict keyed by frame class"
    buffer = getattr(conn, "incoming_buffer", None)
    if type(buffer) is not FrameBuffer or not hasattr(buffer, "_data") or not hasattr(buffer, "max_frame_size"):
        return "H2Connection.incoming_buffer is not a FrameBuffer with _data and max_frame_size"
    for name in ("state_machine", "_get_stream_by_id", "_inbound_flow_control_window_manager",
                 "encoder", "decoder"):
        if not hasattr(conn, name):
            return f"H2Connection.{name} is missing"
    if not hasattr(conn._inbound_flow_control_window_manager, "window_consumed"):
        return "the connection's window manager has no window_consumed"
    if not hasattr(conn.state_machine, "process_input") or not hasattr(conn.state_machine, "state"):
        return "H2Connection.state_machine has no process_input/state"
    stream = conn._get_stream_by_id(1)
    for name in ("state_machine", "_inbound_window_manager", "outbound_flow_control_window"):
        if not hasattr(stream, name):
            return f"H2Stream.{name} is missing"
    for coder in (conn.encoder, conn.decoder):
        table = getattr(coder, "header_table", None)
        if not all(hasattr(table, name) for name in ("maxsize", "resized", "dynamic_entries")):
            return f"hpack {type(coder).__name__}.header_table lacks maxsize/resized/dynamic_entries"
    return None


REASON = _probe() or ""
AVAILABLE = not REASON

if AVAILABLE:
    from h2.connection import ConnectionInputs, ConnectionState
    from h2.frame_buffer import FrameBuffer
    from h2.stream import StreamInputs
    from hyperframe.frame import DataFrame, GoAwayFrame


# ---------------------------------------------------------------- per connection
def install(conn: h2.connection.H2Connection) -> bool:
    """Set up one fresh connection for the fast path: cheap DATA reprs,
    calls that survive a graceful GOAWAY, remembered HPACK work. True if
    the fast path is in use (large DATA frames may be written and read with
    charge_data_sent/charge_data_received)."""
    if not AVAILABLE:
        return False
    install_cheap_frame_buffer(conn)
    _keep_streams_open_on_goaway(conn)
    conn.encoder = MemoHpack(conn.encoder, "encode")
    conn.decoder = MemoHpack(conn.decoder, "decode")
    return True


def accept_frames_up_to(conn: h2.connection.H2Connection, size: int) -> None:
    """Take frames of up to size bytes at once, before the peer acknowledges
    our SETTINGS (it may use them as soon as it has read them; grpcio does).
    incoming_buffer is a public attribute of h2's connection, kept if absent."""
    conn.max_inbound_frame_size = size
    buffer = getattr(conn, "incoming_buffer", None)
    if buffer is not None and hasattr(buffer, "max_frame_size"):
        buffer.max_frame_size = size


def connection_closed(conn: h2.connection.H2Connection) -> bool | None:
    """Whether h2's connection state is CLOSED (it sent or took a GOAWAY it
    did not reopen after, or failed); None when that cannot be read."""
    if not AVAILABLE:
        return None
    return conn.state_machine.state == ConnectionState.CLOSED


def reopen_after_goaway(conn: h2.connection.H2Connection) -> bool:
    """h2 moves to CLOSED when it sends or receives GOAWAY, and then refuses
    every later frame, also those of the calls the GOAWAY lets finish
    (RFC 9113 6.8): a stock server's graceful GOAWAY (max connection age,
    stop with grace) would fail them all. Back to OPEN; the caller keeps the
    GOAWAY's rule (no new streams, or none above its last stream id).
    False when h2 stays CLOSED (plain h2)."""
    if not AVAILABLE:
        return False
    machine = conn.state_machine
    if machine.state == ConnectionState.CLOSED:
        machine.state = (ConnectionState.CLIENT_OPEN if conn.config.client_side
                         else ConnectionState.SERVER_OPEN)
    return True


def _keep_streams_open_on_goaway(conn: h2.connection.H2Connection) -> None:
    """Reopen as soon as h2 has taken a graceful (NO_ERROR) GOAWAY, before it
    reads the frames after it in the same read."""
    table = conn._frame_dispatch_table
    original = table[GoAwayFrame]

    def receive_goaway(frame):
        result = original(frame)
        if frame.error_code == 0:
            reopen_after_goaway(conn)
        return result
    table[GoAwayFrame] = receive_goaway


# ---------------------------------------------------------------- large DATA frames
def frame_header(length: int, ftype: int, flags: int, stream_id: int) -> bytes:
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, ftype, flags, stream_id & 0x7FFFFFFF)


def parse_frame_header(view) -> tuple[int, int, int, int]:
    hi, lo, ftype, flags, sid = FRAME_HEADER.unpack_from(view)
    return (hi << 8) | lo, ftype, flags, sid & 0x7FFFFFFF


def is_fast_data(conn: h2.connection.H2Connection, length: int, ftype: int, flags: int) -> bool:
    """A frame the reader takes itself: a large DATA frame, not padded, not
    ending its stream (h2 sees those), within our frame size."""
    return (ftype == DATA and length >= FAST_DATA_MIN and not flags & (PADDED_FLAG | END_STREAM_FLAG)
            and length <= conn.max_inbound_frame_size)


def charge_data_sent(conn, stream_id: int, length: int) -> None:
    """h2's state machines and windows, as its send_data would leave them,
    for a DATA frame of length bytes we write ourselves."""
    stream = conn._get_stream_by_id(stream_id)
    conn.state_machine.process_input(ConnectionInputs.SEND_DATA)
    stream.state_machine.process_input(StreamInputs.SEND_DATA)
    stream.outbound_flow_control_window -= length
    conn.outbound_flow_control_window -= length


def charge_data_received(conn, stream_id: int, length: int) -> None:
    """The same for a DATA frame we receive ourselves (raises h2's
    ProtocolError or StreamClosedError as its receive_data would)."""
    conn.state_machine.process_input(ConnectionInputs.RECV_DATA)
    conn._inbound_flow_control_window_manager.window_consumed(length)
    stream = conn._get_stream_by_id(stream_id)
    stream.state_machine.process_input(StreamInputs.RECV_DATA)
    stream._inbound_window_manager.window_consumed(length)


# ---------------------------------------------------------------- cheap DATA reprs
def cheap_data_repr(frame) -> str:
    """repr() of a DATA frame's body as hyperframe writes it (the first 10
    bytes of the serialized body, hex, then "..."), from those bytes only."""
    padding = frame.serialize_padding_data()
    size = len(padding) + len(frame.data) + (frame.pad_length if "PADDED" in frame.flags else 0)
    if size == 0:
        return "None"
    head = padding + bytes(memoryview(frame.data)[:11])
    head = (head + b"\0" * 11)[:min(11, size)]
    text = binascii.hexlify(head).decode("ascii")
    return "<hex:" + (text[:20] + "..." if len(text) > 20 else text) + ">"


def _make_cheap_frame_buffer():
    class CheapReprDataFrame(DataFrame):
        __slots__ = ()

        def _body_repr(self) -> str:
            return cheap_data_repr(self)

    CheapReprDataFrame.__name__ = "DataFrame"     # h2's log lines read as before

    class CheapFrameBuffer(FrameBuffer):
        data_frame = CheapReprDataFrame

        def __next__(self):
            frame = super().__next__()
            if type(frame) is DataFrame:
                frame.__class__ = CheapReprDataFrame
            return frame

    return CheapFrameBuffer


_CheapFrameBuffer = _make_cheap_frame_buffer() if AVAILABLE else None


def install_cheap_frame_buffer(conn: h2.connection.H2Connection) -> None:
    """h2 formats repr(frame) for every frame it receives, logging on or off,
    and hyperframe's repr of a DATA frame re-serializes the whole body and
    hex-encodes all of it before keeping 20 hex digits: three passes over
    every payload (a 4 MiB gRPC message spent 14 ms there). This connection's
    frame buffer hands out DATA frames whose repr reads 10 bytes; hyperframe
    itself, and every other user of h2 in the process, is left as it is.
    Without the hooks it needs on this connection, h2 keeps its own."""
    if _CheapFrameBuffer is None:
        return
    buffer = getattr(conn, "incoming_buffer", None)
    table = getattr(conn, "_frame_dispatch_table", None)
    if type(buffer) is not FrameBuffer or buffer._data or not isinstance(table, dict) or DataFrame not in table:
        return
    table[_CheapFrameBuffer.data_frame] = table[DataFrame]
    cheap = _CheapFrameBuffer(server=not conn.config.client_side)
    cheap.max_frame_size = buffer.max_frame_size
    conn.incoming_buffer = cheap


# ---------------------------------------------------------------- remembered HPACK work
class MemoHpack:
    """An hpack Encoder or Decoder whose work is remembered: gRPC sends the
    same few header blocks over and over (request headers of a method,
    response headers, OK trailers), and HPACK in pure Python costs ~6 us a
    block (a quarter of h2's time per call). A block is reused only while
    the dynamic table is exactly as it was when the block was made, and only
    if making it left the table unchanged, so the bytes on the wire (and the
    headers handed to h2) are what hpack itself would produce."""

    __slots__ = ("_inner", "_memo", "_version", "_coder")
    MAX_MEMO = 256

    def __init__(self, inner, coder):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "_version", 0)
        object.__setattr__(self, "_coder", coder)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)          # table size, list size limits: a new state
        object.__setattr__(self, "_version", self._version + 1)

    def _state(self):
        table = self._inner.header_table
        entries = table.dynamic_entries
        return table.maxsize, table.resized, len(entries), entries[0] if entries else None

    def _run(self, key, *args):
        hit = self._memo.get(key)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        size, resized, count, first = self._state()
        unchanged = False
        try:
            out = getattr(self._inner, self._coder)(*args)
            if self._coder == "decode":
                out = list(out)
            size2, resized2, count2, first2 = self._state()
            # entries are new tuples when added: identity tells a changed table
            unchanged = size == size2 and resized == resized2 and count == count2 and first is first2
        finally:
            if not unchanged:
                object.__setattr__(self, "_version", self._version + 1)
        if unchanged:
            if len(self._memo) >= self.MAX_MEMO:
                self._memo.clear()
            self._memo[key] = (self._version, out)
        return out

    def encode(self, headers, huffman=True):
        if type(headers) is not list or any(type(h) is not tuple for h in headers):
            return self._plain("encode", headers, huffman)
        return self._run(("e", tuple(headers), huffman), headers, huffman)

    def decode(self, data, raw=False):
        return list(self._run(("d", bytes(data), raw), data, raw))

    def _plain(self, coder, *args):
        """Not memoizable (sensitive or unusual header types): hpack itself."""
        object.__setattr__(self, "_version", self._version + 1)
        return getattr(self._inner, coder)(*args)
