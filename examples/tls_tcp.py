"""TLS on the tcp fabric: Fabric("tcp", ssl=...) with your own ssl contexts.

A throwaway self-signed certificate for 127.0.0.1 is made with the openssl
command; in real use the certificates come from your CA. A client that does
not trust the certificate is refused with fabric.AuthenticationError.

    python examples/tls_tcp.py
"""
from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import tempfile

import fabric


def make_certificate(directory: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def main() -> int:
    if shutil.which("openssl") is None:
        print("tls_tcp: skipped, the openssl command is not installed")
        return 0
    with tempfile.TemporaryDirectory() as d:
        cert, key = make_certificate(d)
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert, key)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)    # verifies the certificate and the host name
        client.load_verify_locations(cert)

    # listen() uses the server context, connect() the client context
    with fabric.Fabric("tcp", ssl=(server, client)) as fab:
        lst = fab.listen("127.0.0.1:0")
        ep = fab.connect(lst.address, timeout=10)
        peer = lst.accept(timeout=10)
        ep.send(b"secret" * 100_000)                       # every byte is encrypted, large messages too
        assert peer.recv(timeout=30) == b"secret" * 100_000

        untrusting = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts only the system's CAs
        untrusting.load_default_certs()
        with fabric.Fabric("tcp", ssl=untrusting) as other:
            try:
                other.connect(lst.address, timeout=10)
            except fabric.AuthenticationError as e:
                refused = e
            else:
                print("a client without the certificate connected", file=sys.stderr)
                return 1
    print(f"tls_tcp: 600000 bytes over TLS; an untrusting client refused ({type(refused).__name__}): OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
