"""What a timed-out wait waited for, when the server's own account did not arrive in time.

A server ends a wait on other ranks a little before the caller's deadline with
DEADLINE_EXCEEDED and words naming the run, the collective or step, who arrived and who is
missing (server/collectives/pending.py, server/buffers/slice_state.py). On a loaded machine
that reply can come later than the deadline, and grpc says only "Deadline Exceeded". Then the
client asks the server's hang doctor (``Status`` with ``pending``, what ``paramshard status
--pending`` shows) about the call's slot or job and puts its answer into the error.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.words import listed, said

__all__ = ["complete", "still_waiting", "STATUS_TIMEOUT_S"]

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 2.0
"""How long the question may take: the wait is over already, the error should not linger."""
_MAX_ROWS = 200


def _has_account(details: str) -> bool:
    """Whether ``details`` is the server's own account of the wait (its messages say how long
    they waited and what for)."""
    return "waited " in details


def _matches(method: str, request: Any, row: pb.PendingWork) -> bool:
    if method == "ReadSlot":
        return row.key == request.key
    if method == "ContributeRead":  # (header, payload)
        return row.key == request[0].key
    job = {
        "GradNorm": lambda: request.job,
        "Step": lambda: request.job,
        "PullParams": lambda: request.ref.job,
    }.get(method)
    return job is not None and row.kind == "push_grad" and row.run == job()


def _words(row: pb.PendingWork) -> str:
    """A pending row in words; the server's, so bounded (``words.MAX_LISTED`` ranks a list,
    names and whereabouts cut: ``words.said``)."""

    what = (
        f"step {row.seq} of job '{said(row.run, 256)}'"
        if row.kind == "push_grad"
        else (f"{said(row.kind, 64)} #{row.seq} of run '{said(row.run, 256)}'"
              f" (slot '{said(row.key, 256)}')")
    )  # fmt: skip
    return (
        f"{what}: missing rank(s) {listed(row.missing)} (arrived: {listed(row.arrived)}),"
        f" open for {row.age_seconds:.1f} s{said(row.whereabouts, 1024)}"
    )


def _server_says(core: Any, server: int, method: str, request: Any) -> tuple[list[str], str]:
    """The server's pending rows about this call, in words, or why it did not say."""
    try:
        reply = core.plain_call(
            server,
            "Status",
            pb.StatusRequest(pending=True, max_pending=_MAX_ROWS),
            STATUS_TIMEOUT_S,
        )
    except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel was closed
        return [], f"{exc.code().name}" if isinstance(exc, grpc.RpcError) else str(exc)
    alike: dict[tuple, pb.PendingWork] = {}  # a step's buffers wait alike: said once
    for row in reply.pending[:_MAX_ROWS]:  # the rows asked for, whatever came
        if _matches(method, request, row):
            slot = "" if row.kind == "push_grad" else row.key  # a push's: its buffer
            key = (row.kind, row.run, row.seq, slot, tuple(row.missing), tuple(row.arrived))
            if key not in alike or row.age_seconds > alike[key].age_seconds:
                alike[key] = row  # the oldest: the wait began there
    return [_words(r) for r in alike.values()], ""


def complete(core: Any, server: int, method: str, request: Any, details: str) -> str:
    """``details`` of a timed-out call, with the server's pending rows about it when the
    details do not already say what the call waited for."""
    if _has_account(details) or callable(request):
        return details
    rows, why = _server_says(core, server, method, request)
    if why:
        return f"{details} (no reply within {core.timeout_s:g} s; the server's Status: {why})"
    if not rows:
        return (
            f"{details} (no reply within {core.timeout_s:g} s; the server lists nothing"
            " pending for this call now)"
        )
    return f"{details} (no reply within {core.timeout_s:g} s; the server: {'; '.join(rows)})"


def still_waiting(core: Any, call: Any, waited: float) -> None:
    """Logs that ``call`` (client/rpc.py's Call) has waited ``waited`` seconds so far, with
    what its server says it waits for (client/slow_waits.py)."""
    server, method, request = call.server, call.method, call.request
    where = f"server {server} ({core.spec.addresses[server]})"
    head = f"{method} to {where} has waited {waited:.0f} s of its {core.timeout_s:g} s deadline"
    if callable(request):  # not built yet: its rows cannot be told from others'
        log.warning("%s", head)
        return
    rows, why = _server_says(core, server, method, request)
    if why:
        log.warning(
            "%s; %s did not answer a Status within %g s (%s): it may be stopped, overloaded or"
            " cut off from this rank",
            head, where, STATUS_TIMEOUT_S, why,
        )  # fmt: skip
    elif rows:
        log.warning("%s; the server waits for: %s", head, "; ".join(rows))
    else:
        log.warning("%s; the server lists nothing pending for it (its reply may be on its way)",
                    head)  # fmt: skip
