"""What the shared-memory probes of tests/test_hardening_round2_shm.py do by hand: raw calls with
a token, and the segment handshake with the descriptor kept (a probe resizes it)."""

from __future__ import annotations

import mmap
import os
import socket
from typing import Any

import grpc

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.shm import PROOF_BYTES

SERVICE = "/paramshard.v1.Shard"


def raw(
    address: str, method: str, request: Any, token: str | None = None, timeout: float = 10
) -> tuple[grpc.StatusCode, str, bytes | None]:
    """(code, details, reply bytes) of one unary call."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(
            f"{SERVICE}/{method}",
            request_serializer=codec.serialize,
            response_deserializer=lambda b: b,
        )
        try:
            return grpc.StatusCode.OK, "", stub(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), None


def offer(address: str, token: str | None, nbytes: int = 2**20) -> pb.OfferSegmentReply:
    code, details, reply = raw(
        address, "OfferSegment", pb.OfferSegmentRequest(nbytes=nbytes), token
    )
    assert code == grpc.StatusCode.OK, (code, details)
    return pb.OfferSegmentReply.FromString(reply)


def claim(socket_name: str, ticket: bytes, timeout: float = 10.0) -> int:
    """The descriptor the server hands over for ``ticket``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect("\0" + socket_name[1:])
        sock.sendall(ticket)
        msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
    assert msg == b"ok" and len(fds) == 1, msg
    return fds[0]


class Segment:
    """A confirmed segment of ``token`` on ``address``: its id, descriptor and mapping."""

    def __init__(
        self,
        address: str,
        token: str | None,
        nbytes: int = 2**20,
        confirm: bool = True,
        offered: pb.OfferSegmentReply | None = None,
    ) -> None:
        self.address, self.token = address, token
        offered = offered or offer(address, token, nbytes)
        self.id, self.nbytes = offered.segment, offered.nbytes
        self.fd = claim(offered.socket, offered.ticket)
        self.map = mmap.mmap(self.fd, self.nbytes)
        if confirm:
            code, details = self.confirm()
            assert code == grpc.StatusCode.OK, (code, details)

    def confirm(self) -> tuple[grpc.StatusCode, str]:
        proof = pb.ConfirmSegmentRequest(segment=self.id, proof=self.map[:PROOF_BYTES])
        code, details, _ = raw(self.address, "ConfirmSegment", proof, self.token)
        return code, details

    def ref(self, nbytes: int | None = None) -> pb.ShmRef:
        return pb.ShmRef(
            segment=self.id, offset=0, nbytes=self.nbytes if nbytes is None else nbytes
        )

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
