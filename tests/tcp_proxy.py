"""A loopback TCP relay for tests of what crosses the wire."""
import socket
import threading


class Proxy:
    """A TCP relay between a client and a server on loopback that counts the
    bytes each way (what compression saves is measured on the wire) and can
    freeze: stop relaying while keeping every connection open, as a peer
    behind a dead route or a hung host looks."""

    def __init__(self, port):
        self.target = port
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port = self.lst.getsockname()[1]
        self.up = self.down = 0
        self.socks = []
        self.connections = 0
        self.closed = 0                       # connections an end closed
        self.frozen = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.lst.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(("127.0.0.1", self.target))
            except OSError:                   # the server is gone: so is this client's connection
                a.close()
                continue
            self.socks += [a, b]
            self.connections += 1
            threading.Thread(target=self._pump, args=(a, b, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, "down"), daemon=True).start()

    def _pump(self, src, dst, direction):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if self.frozen.is_set():
                    continue                  # swallowed: nothing gets through, nothing is closed
                setattr(self, direction, getattr(self, direction) + len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if direction == "down":
                self.closed += 1
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def freeze(self):
        self.frozen.set()

    def close(self):
        # shutdown first: it wakes the relay's threads blocked in accept() and
        # recv() (close() alone leaves them blocked until interpreter exit,
        # where they fail with nobody left to report it)
        for s in [self.lst] + self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.lst.close()
        for s in self.socks:
            s.close()
