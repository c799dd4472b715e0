"""Review of ba79382 ("Clients and tools against a server that lies"): where its fixes are too
loose (a lying server still gets through with a small variation) or too tight (a legitimate
use is refused). Each test fails on ba79382.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
from lying_servers import job_status, lying_server

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.jobs import server_jobs
from paramshard.client.slot_reads import read_whole
from paramshard.protos import shard_pb2 as pb
from paramshard.protos import shard_pb2_grpc

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31m"


def _client(address: str, **kw: Any) -> ShardClient:
    return ShardClient(ClusterSpec([address]), timeout_s=5, retries=1, **kw)


# -- slot reads: a reply is checked against its own header, never against the read asked ------


def _slot_reply(offset: int, numel: int, total: int, chunk: int, key: str) -> pb.ReadSlotReply:
    header = pb.SlotHeader(
        key=key,
        expected=1,
        readers=1,
        total_numel=total,
        shape=[total],
        chunk_numel=chunk,
        chunk=pb.Chunk(offset=offset, numel=numel, dtype=pb.FLOAT32),
    )
    return pb.ReadSlotReply(header=header, data=np.full(numel, 7, np.float32).tobytes())


@pytest.mark.parametrize("lie", ["short_chunk", "other_offset"])
def test_slot_read_reply_that_misses_its_chunk_is_not_used(monkeypatch, lie: str) -> None:
    """client/slot_reads.py ``_Whole.take`` checks a reply's bytes against the numel of the
    reply's own header, not against the chunk it read: a ReadSlot reply saying "chunk 0 holds
    1 element" of a 1,000-element slot cut in one chunk (``short_chunk``), or answering the
    read of chunk 1000 with chunk 0 again (``other_offset``), marks the chunk read, and
    ``read_whole`` (``recv``, ``all_gather``) returns ``np.empty`` memory (this process's old
    heap bytes) for the rest, no error. It must fail DATA_LOSS naming the server, as a short
    pull reply does."""
    monkeypatch.setenv("PARAMSHARD_SHM", "0")
    monkeypatch.setenv("PARAMSHARD_SESSIONS", "0")
    total = 1000 if lie == "short_chunk" else 2000

    def read(request: Any, context: grpc.ServicerContext) -> pb.ReadSlotReply:
        if lie == "short_chunk":
            return _slot_reply(0, 1, total, total, request.key)
        return _slot_reply(0, 1000, total, 1000, request.key)  # whatever offset was asked

    with lying_server(ReadSlot=read) as server:
        client = _client(server.address)
        try:
            with pytest.raises(RuntimeError, match=server.address):  # as ``recv`` reads
                ((got, _, _),) = read_whole(client.run, 0, [(0, "review:p2p1-0/1")], hint=4000)
                pytest.fail(f"read {got.size} values, {np.sum(got != 7)} of them never sent")
        finally:
            client.close()


# -- the command line: text a server sent, relayed by launch's own messages --------------------


class _LaunchServer(shard_pb2_grpc.ShardServicer):
    def Lease(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused" + ESCAPES)


def test_launch_messages_show_a_servers_control_characters_as_escapes(tmp_path) -> None:
    """paramshard/terminal.py wraps sys.stdout/sys.stderr, but ``paramshard launch`` writes
    its own messages as bytes to ``sys.stderr.buffer`` (processes.py ``say`` -> ``emit``),
    which ``Printable`` hands through unchanged. ``launch --servers`` with a server that
    refuses the launcher's Lease release ("rank 0 exited 0; telling the servers it ended
    failed (ADDRESS: CODE: details)", paramshard/launch.py ``finished``) prints the server's
    details raw: its ESC/OSC sequences reach the user's terminal (as do ``still waiting for
    server ...`` in local_servers.py and restarts.py's messages)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    shard_pb2_grpc.add_ShardServicer_to_server(_LaunchServer(), server)
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    script = tmp_path / "rank.py"
    script.write_text("pass\n")
    env = {
        **os.environ,
        "PARAMSHARD_SHM": "0",
        "PARAMSHARD_RUN_DIR": str(tmp_path / "runs"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    env.pop("PARAMSHARD_SERVERS", None)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "paramshard", "launch", "--nproc", "1"]
            + ["--servers", f"127.0.0.1:{port}", str(script)],
            capture_output=True,
            timeout=30,
            env=env,
            check=False,
        )
    finally:
        server.stop(grace=None).wait(5)
    err = result.stderr.decode("utf-8", "backslashreplace")
    assert "refused" in err, err[-2000:]  # the server's message was printed
    assert "\x1b" not in err and "\x07" not in err, err[-2000:]


# -- Status: the host-memory bound refuses what allocates nothing ------------------------------


def test_status_of_a_float32_parameter_that_fits_the_host_is_used(monkeypatch) -> None:
    """client/jobs.py ``_check_params`` refuses a whole server's Status (DATA_LOSS, "a reply
    this client cannot use") when one parameter's elements x 8 bytes pass this host's memory,
    whatever its dtype: a legitimate float32 parameter of 2**31 elements (8 GiB: a large
    embedding) seen from a 12 GiB host (a login node) stops ``paramshard snapshot``,
    ``delete-snapshot``, ``inspect`` and ``export`` of every job on that server, though a
    snapshot allocates nothing here and the parameter's float32 values fit the host."""
    real = os.sysconf

    def sysconf(name: Any) -> int:
        if name == "SC_PHYS_PAGES":
            return 12 * 2**30 // real("SC_PAGE_SIZE")
        return real(name)

    monkeypatch.setattr(os, "sysconf", sysconf)
    status = job_status("big", [("embed.weight", (2**21, 2**10))])
    with lying_server(Status=lambda r, c: status) as server:
        client = _client(server.address)
        try:
            held = server_jobs(client)
        finally:
            client.close()
    assert "big" in held.status
