# cython: language_level=3
"""HPACK (RFC 7541), the header compression of HTTP/2, for fabric.grpc's
HTTP/2 core (fabric/grpc/_h2.pyx).

Decoder: the whole of RFC 7541 (indexed fields, literals with and without
indexing, never-indexed literals, dynamic table size updates, Huffman
strings). Headers come out as (name, value) tuples of bytes; a field taken
from a table is the table's own tuple (nothing is allocated for it). A header
list larger than max_header_list is cut (and reported), but every field is
still decoded, so the dynamic table stays what the peer's encoder thinks it is.

Encoder: static table matches, a dynamic table of its own (bounded by the
peer's SETTINGS_HEADER_TABLE_SIZE and by 4096 bytes), literals without
Huffman coding (the peer's decoder takes either). Values that change with
every call (grpc-timeout, grpc-message, binary metadata, long values) are not
indexed, so they do not push out the ones that repeat (:path, :authority,
content-type, grpc-status); credentials are sent never-indexed.
"""
import collections

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from fabric.grpc._outbuf cimport ob_byte, ob_put, ob_reserve, outbuf_t


class HpackError(Exception):
    """A header block that cannot be decoded (HTTP/2 COMPRESSION_ERROR: the
    connection cannot go on, the two tables no longer agree)."""


DEFAULT_TABLE_SIZE = 4096
ENTRY_OVERHEAD = 32
cdef Py_ssize_t MAX_INT = 1 << 30          # larger integers than any sane length or index


# RFC 7541 Appendix A
STATIC_TABLE = (
    (b":authority", b""), (b":method", b"GET"), (b":method", b"POST"), (b":path", b"/"),
    (b":path", b"/index.html"), (b":scheme", b"http"), (b":scheme", b"https"), (b":status", b"200"),
    (b":status", b"204"), (b":status", b"206"), (b":status", b"304"), (b":status", b"400"),
    (b":status", b"404"), (b":status", b"500"), (b"accept-charset", b""), (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""), (b"accept-ranges", b""), (b"accept", b""), (b"access-control-allow-origin", b""),
    (b"age", b""), (b"allow", b""), (b"authorization", b""), (b"cache-control", b""),
    (b"content-disposition", b""), (b"content-encoding", b""), (b"content-language", b""),
    (b"content-length", b""), (b"content-location", b""), (b"content-range", b""), (b"content-type", b""),
    (b"cookie", b""), (b"date", b""), (b"etag", b""), (b"expect", b""), (b"expires", b""), (b"from", b""),
    (b"host", b""), (b"if-match", b""), (b"if-modified-since", b""), (b"if-none-match", b""),
    (b"if-range", b""), (b"if-unmodified-since", b""), (b"last-modified", b""), (b"link", b""),
    (b"location", b""), (b"max-forwards", b""), (b"proxy-authenticate", b""), (b"proxy-authorization", b""),
    (b"range", b""), (b"referer", b""), (b"refresh", b""), (b"retry-after", b""), (b"server", b""),
    (b"set-cookie", b""), (b"strict-transport-security", b""), (b"transfer-encoding", b""),
    (b"user-agent", b""), (b"vary", b""), (b"via", b""), (b"www-authenticate", b""),
)
cdef Py_ssize_t STATIC_COUNT = 61

cdef dict STATIC_EXACT = {}
cdef dict STATIC_NAME = {}
for _i, _h in enumerate(STATIC_TABLE):
    STATIC_EXACT.setdefault(_h, _i + 1)
    STATIC_NAME.setdefault(_h[0], _i + 1)

# RFC 7541 Appendix B: the code length of each symbol (0-255, 256 = EOS). The
# code is canonical (codes of one length are consecutive, in symbol order),
# so the lengths define it; the decoder below relies on that.
HUFFMAN_LENGTHS = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28,
    28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6,
    6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8,
    7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7,
    7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23,
    24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22,
    23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25,
    26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24,
    20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27,
    27, 27, 27, 26, 30,
)

# canonical decoding: codes of length L are hf_first[L] .. hf_limit[L] - 1 (as
# L-bit numbers), in the order of hf_symbols from hf_offset[L]
cdef uint32_t hf_first[32]
cdef uint32_t hf_limit[32]
cdef int hf_offset[32]
cdef int hf_symbols[257]
cdef uint32_t hf_code[257]          # for tests and the encoder of tests (huffman_encode)


cdef int hf_lengths[257]


cdef inline int hf_len(int sym) noexcept:
    return hf_lengths[sym]


cdef void _build_huffman():
    cdef int L, s, n = 0
    cdef uint32_t code = 0
    cdef int prev_len = 0
    for L in range(32):
        hf_first[L] = hf_limit[L] = 0
        hf_offset[L] = 0
    for s in range(257):
        hf_lengths[s] = HUFFMAN_LENGTHS[s]
    for L in range(1, 31):
        code <<= 1
        hf_first[L] = code
        hf_offset[L] = n
        for s in range(257):
            if hf_lengths[s] == L:
                hf_symbols[n] = s
                hf_code[s] = code
                n += 1
                code += 1
        hf_limit[L] = code


_build_huffman()


cdef Py_ssize_t huffman_decode(const unsigned char* src, Py_ssize_t n, unsigned char* dst) except -1:
    """Decode n bytes of Huffman code into dst (room for n * 8 // 5 bytes);
    the decoded length. Padding must be the EOS code's first bits, at most 7."""
    cdef uint64_t acc = 0
    cdef int nbits = 0
    cdef Py_ssize_t i = 0, k = 0
    cdef int L
    cdef uint32_t code
    cdef int sym
    while True:
        while nbits <= 56 and i < n:
            acc = (acc << 8) | src[i]
            i += 1
            nbits += 8
        if nbits == 0:
            return k
        sym = -1
        L = 5
        while L <= nbits and L <= 30:
            code = <uint32_t>((acc >> (nbits - L)) & ((<uint64_t>1 << L) - 1))
            if code < hf_limit[L]:
                sym = hf_symbols[hf_offset[L] + <int>(code - hf_first[L])]
                break
            L += 1
        if sym < 0:
            # out of input inside a code: the rest must be padding
            if nbits > 7 or (acc & ((<uint64_t>1 << nbits) - 1)) != (<uint64_t>1 << nbits) - 1:
                raise HpackError("invalid Huffman padding")
            return k
        if sym == 256:
            raise HpackError("EOS in a Huffman-coded string")
        dst[k] = <unsigned char>sym
        k += 1
        nbits -= L


def huffman_decode_bytes(data):
    """(tests) Decode a Huffman-coded string."""
    cdef bytes b = bytes(data)
    cdef Py_ssize_t n = len(b)
    cdef unsigned char* out = <unsigned char*>malloc(n * 8 // 5 + 1)
    if out == NULL:
        raise MemoryError()
    try:
        k = huffman_decode(<const unsigned char*>PyBytes_AS_STRING(b), n, out)
        return PyBytes_FromStringAndSize(<char*>out, k)
    finally:
        free(out)


def huffman_encode_bytes(data):
    """(tests) Huffman-code a string, padded with EOS bits as RFC 7541 says."""
    cdef uint64_t acc = 0
    cdef int nbits = 0, L
    cdef unsigned char c
    out = bytearray()
    for c in bytes(data):
        L = hf_len(c)
        acc = ((acc << L) | hf_code[c]) & 0xFFFFFFFFFFFF
        nbits += L
        while nbits >= 8:
            out.append((acc >> (nbits - 8)) & 0xFF)
            nbits -= 8
    if nbits:
        out.append(((acc << (8 - nbits)) | ((1 << (8 - nbits)) - 1)) & 0xFF)
    return bytes(out)


cdef inline Py_ssize_t read_int(const unsigned char* p, Py_ssize_t n, Py_ssize_t* pos, int prefix) except -1:
    """An integer with a prefix of `prefix` bits at p[pos] (RFC 7541 5.1)."""
    cdef Py_ssize_t mask = (1 << prefix) - 1
    cdef Py_ssize_t v = p[pos[0]] & mask
    cdef int shift = 0
    cdef unsigned char c
    pos[0] += 1
    if v < mask:
        return v
    while True:
        if pos[0] >= n:
            raise HpackError("header block ends inside an integer")
        c = p[pos[0]]
        pos[0] += 1
        v += <Py_ssize_t>(c & 0x7F) << shift
        shift += 7
        if v > MAX_INT or shift > 35:
            raise HpackError("integer too large in a header block")
        if not c & 0x80:
            return v


cdef object read_string(const unsigned char* p, Py_ssize_t n, Py_ssize_t* pos):
    """A string literal (RFC 7541 5.2) as bytes."""
    cdef bint huffman
    cdef Py_ssize_t length, k
    cdef unsigned char small[512]
    cdef unsigned char* out
    if pos[0] >= n:
        raise HpackError("header block ends before a string")
    huffman = p[pos[0]] & 0x80
    length = read_int(p, n, pos, 7)
    if length > n - pos[0]:
        raise HpackError("string longer than its header block")
    if not huffman:
        s = PyBytes_FromStringAndSize(<const char*>(p + pos[0]), length)
        pos[0] += length
        return s
    if length * 8 // 5 + 1 <= 512:
        out = small
    else:
        out = <unsigned char*>malloc(length * 8 // 5 + 1)
        if out == NULL:
            raise MemoryError()
    try:
        k = huffman_decode(p + pos[0], length, out)
        s = PyBytes_FromStringAndSize(<const char*>out, k)
    finally:
        if out != small:
            free(out)
    pos[0] += length
    return s


cdef class Decoder:
    """One connection's HPACK decoder (the peer's encoder's mirror)."""

    def __init__(self, Py_ssize_t max_header_list=65536, Py_ssize_t table_size=DEFAULT_TABLE_SIZE):
        self.entries = []
        self.size = 0
        self.max_size = table_size
        self.settings_max = table_size
        self.max_header_list = max_header_list

    cdef object _entry(self, Py_ssize_t index):
        cdef Py_ssize_t d
        if index <= 0:
            raise HpackError("header index 0")
        if index <= STATIC_COUNT:
            return STATIC_TABLE[index - 1]
        d = index - STATIC_COUNT
        if d > PyList_GET_SIZE(self.entries):
            raise HpackError(f"header index {index} is not in the table")
        return self.entries[PyList_GET_SIZE(self.entries) - d]

    cdef void _evict(self) noexcept:
        cdef object e
        while self.size > self.max_size and self.entries:
            e = self.entries.pop(0)
            self.size -= PyBytes_GET_SIZE(e[0]) + PyBytes_GET_SIZE(e[1]) + ENTRY_OVERHEAD

    cdef int _add(self, object entry) except -1:
        cdef Py_ssize_t s = PyBytes_GET_SIZE(entry[0]) + PyBytes_GET_SIZE(entry[1]) + ENTRY_OVERHEAD
        if s > self.max_size:
            # RFC 7541 4.4: an entry larger than the table empties it
            self.entries = []
            self.size = 0
            return 0
        self.size += s
        self.entries.append(entry)
        self._evict()
        return 0

    cdef int decode_into(self, const unsigned char* p, Py_ssize_t n, list out) except -1:
        """Decode a whole header block, appending (name, value) tuples to
        out; 1 if the list went over max_header_list (out holds what fit)."""
        cdef Py_ssize_t pos = 0, index, v
        cdef Py_ssize_t listed = 0
        cdef bint at_start = True, too_large = False
        cdef unsigned char b
        cdef object entry, name, value
        while pos < n:
            b = p[pos]
            if b & 0x80:                       # indexed field
                entry = self._entry(read_int(p, n, &pos, 7))
            elif b & 0x40:                     # literal, added to the table
                index = read_int(p, n, &pos, 6)
                name = self._entry(index)[0] if index else read_string(p, n, &pos)
                value = read_string(p, n, &pos)
                entry = (name, value)
                self._add(entry)
            elif b & 0x20:                     # dynamic table size update
                if not at_start:
                    raise HpackError("table size update after the first field of a block")
                v = read_int(p, n, &pos, 5)
                if v > self.settings_max:
                    raise HpackError(f"table size update to {v}, above the {self.settings_max} we allow")
                self.max_size = v
                self._evict()
                continue
            else:                              # literal not indexed (0000) or never indexed (0001)
                index = read_int(p, n, &pos, 4)
                name = self._entry(index)[0] if index else read_string(p, n, &pos)
                value = read_string(p, n, &pos)
                entry = (name, value)
            at_start = False
            listed += PyBytes_GET_SIZE(entry[0]) + PyBytes_GET_SIZE(entry[1]) + ENTRY_OVERHEAD
            if listed > self.max_header_list:
                too_large = True
            if not too_large:
                out.append(entry)
        return 1 if too_large else 0

    def decode(self, data):
        """(tests, tools) The headers of one block: (list, too_large)."""
        cdef bytes b = bytes(data)
        out = []
        too_large = self.decode_into(<const unsigned char*>PyBytes_AS_STRING(b), len(b), out)
        return out, bool(too_large)

    @property
    def table(self):
        """The dynamic table, newest first."""
        return list(reversed(self.entries))

    @property
    def table_size(self):
        return self.size


cdef set NOT_INDEXED = {b"grpc-timeout", b"grpc-message", b"grpc-status-details-bin", b"content-length",
                        b"grpc-previous-rpc-attempts", b"grpc-retry-pushback-ms"}
cdef set NEVER_INDEXED = {b"authorization", b"proxy-authorization", b"cookie", b"set-cookie"}
cdef Py_ssize_t INDEX_MAX_VALUE = 256     # longer values are not worth a table slot


cdef inline int put_int(outbuf_t* out, Py_ssize_t v, int prefix, unsigned char first) except -1:
    cdef Py_ssize_t mask = (1 << prefix) - 1
    if v < mask:
        return ob_byte(out, first | <unsigned char>v)
    ob_byte(out, first | <unsigned char>mask)
    v -= mask
    while v >= 128:
        ob_byte(out, <unsigned char>((v & 0x7F) | 0x80))
        v >>= 7
    return ob_byte(out, <unsigned char>v)


cdef inline int put_string(outbuf_t* out, object s) except -1:
    cdef Py_ssize_t n = PyBytes_GET_SIZE(s)
    put_int(out, n, 7, 0)
    return ob_put(out, PyBytes_AS_STRING(s), n)


cdef class Encoder:
    """One connection's HPACK encoder."""

    def __init__(self, Py_ssize_t limit=DEFAULT_TABLE_SIZE):
        self.exact = {}
        self.by_name = {}
        self.fifo = collections.deque()
        self.inserted = 0
        self.size = 0
        self.limit = limit
        self.max_size = min(limit, DEFAULT_TABLE_SIZE)   # the peer's limit until it says otherwise
        self.pending_update = -1

    def set_peer_limit(self, Py_ssize_t peer_size):
        """The peer's SETTINGS_HEADER_TABLE_SIZE: our table shrinks to it if
        need be, and the next block starts with the size update(s)."""
        cdef Py_ssize_t new = min(peer_size, self.limit)
        if new == self.max_size:
            return
        self.max_size = new
        # RFC 7541 4.2: the smallest size since the last block, then the final one
        self.smallest_update = new if self.pending_update < 0 else min(self.smallest_update, new)
        self.pending_update = 1
        self._evict_to(new)

    cdef void _evict_to(self, Py_ssize_t limit):
        cdef object old
        while self.size > limit and self.fifo:
            old = self.fifo.popleft()
            self.size -= <Py_ssize_t>old[1]
            header = old[2]
            if self.exact.get(header) == old[0]:
                del self.exact[header]
            if self.by_name.get(header[0]) == old[0]:
                del self.by_name[header[0]]

    cdef int _add(self, object header, Py_ssize_t entry_size) except -1:
        if entry_size > self.max_size:
            self._evict_to(0)
            return 0
        self._evict_to(self.max_size - entry_size)
        self.exact[header] = self.inserted
        self.by_name[header[0]] = self.inserted
        self.fifo.append((self.inserted, entry_size, header))
        self.inserted += 1
        self.size += entry_size
        return 0

    cdef int encode_into(self, object headers, outbuf_t* out) except -1:
        """Encode a list of (name, value) bytes tuples as one header block."""
        cdef object header, name, value, found
        cdef Py_ssize_t index, nsize, vsize
        cdef long long oldest
        if self.pending_update > 0:
            if self.smallest_update < self.max_size:
                put_int(out, self.smallest_update, 5, 0x20)
            put_int(out, self.max_size, 5, 0x20)
            self.pending_update = -1
        for header in headers:
            if type(header) is not tuple or PyTuple_GET_SIZE(header) != 2:
                header = tuple(header)
                if len(header) != 2:
                    raise ValueError(f"a header is a (name, value) pair, not {header!r}")
            name = <object>PyTuple_GET_ITEM(header, 0)
            value = <object>PyTuple_GET_ITEM(header, 1)
            if type(name) is not bytes or type(value) is not bytes:
                name = name.encode("ascii") if isinstance(name, str) else bytes(name)
                value = value.encode("latin-1") if isinstance(value, str) else bytes(value)
                header = (name, value)
            found = STATIC_EXACT.get(header)
            if found is not None:
                put_int(out, <Py_ssize_t>found, 7, 0x80)
                continue
            oldest = self.inserted - <long long>len(self.fifo)
            found = self.exact.get(header)
            if found is not None and <long long>found >= oldest:
                put_int(out, STATIC_COUNT + <Py_ssize_t>(self.inserted - <long long>found), 7, 0x80)
                continue
            found = STATIC_NAME.get(name)
            if found is not None:
                index = <Py_ssize_t>found
            else:
                found = self.by_name.get(name)
                index = STATIC_COUNT + <Py_ssize_t>(self.inserted - <long long>found) if found is not None else 0
            nsize = PyBytes_GET_SIZE(name)
            vsize = PyBytes_GET_SIZE(value)
            if name in NEVER_INDEXED:
                put_int(out, index, 4, 0x10)
            elif vsize > INDEX_MAX_VALUE or name in NOT_INDEXED or name.endswith(b"-bin") or self.max_size == 0:
                put_int(out, index, 4, 0x00)
            else:
                put_int(out, index, 6, 0x40)
                if index == 0:
                    put_string(out, name)
                put_string(out, value)
                self._add(header, nsize + vsize + ENTRY_OVERHEAD)
                continue
            if index == 0:
                put_string(out, name)
            put_string(out, value)
        return 0

    def encode(self, headers):
        """(tests, tools) One header block as bytes."""
        cdef outbuf_t out
        out.data = NULL
        out.len = out.cap = 0
        try:
            self.encode_into(headers, &out)
            return PyBytes_FromStringAndSize(<char*>out.data, out.len)
        finally:
            free(out.data)

    @property
    def table(self):
        """The dynamic table, newest first."""
        return [e[2] for e in reversed(self.fifo)]

    @property
    def table_size(self):
        return self.size
