"""A gRPC client that never reads: HTTP/2 by hand, announcing a flow-control window of 0, so a
server can send it no reply bytes and must hold each reply while the connection is open
(tests/test_hardening_round3.py). Unary calls only; replies are never parsed."""

from __future__ import annotations

import socket
import struct

__all__ = ["Unread"]


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _length(n: int, bits: int) -> bytes:
    """HPACK's integer with a ``bits``-bit prefix (first byte's high bits zero)."""
    top = (1 << bits) - 1
    if n < top:
        return bytes([n])
    out, n = [top], n - top
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    return bytes([*out, n])


def _header(name: str, value: str) -> bytes:
    """A literal header field without indexing, name and value as plain strings."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + _length(len(raw_name), 7) + raw_name + _length(len(raw_value), 7) + raw_value


class Unread:
    """One HTTP/2 connection to ``address`` whose replies are never read."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.authority = address
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        settings = struct.pack(">HI", 4, 0)  # SETTINGS_INITIAL_WINDOW_SIZE = 0
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, settings))
        self.sock.sendall(_frame(4, 1, 0, b""))  # acknowledges the server's settings
        self.stream = 1

    def call(self, path: str, message: bytes, token: str | None = None) -> None:
        fields = [(":method", "POST"), (":scheme", "http"), (":path", path),
                  (":authority", self.authority), ("content-type", "application/grpc"),
                  ("te", "trailers")]  # fmt: skip
        if token:
            fields.append(("authorization", f"Bearer {token}"))
        block = b"".join(_header(k, v) for k, v in fields)
        body = b"\x00" + struct.pack(">I", len(message)) + message  # gRPC's length prefix
        self.sock.sendall(_frame(1, 4, self.stream, block) + _frame(0, 1, self.stream, body))
        self.stream += 2

    def close(self) -> None:
        self.sock.close()
