"""``paramshard status``: what each shard server holds and, with ``--pending``, what waits on it.

``--pending`` is the hang doctor (docs/design.md §3.7). A collective hangs when a rank never
reaches it; every server it was due on lists it, per run, with its kind and sequence number,
the ranks whose contribution is in (RANKS IN), those whose is not (RANKS MISSING), the ranks
blocked reading it (RANKS WAITING) or that have yet to read it (NOT READ BY), and how long
ago it was opened (AGE) and last touched (IDLE). Gradient steps waiting for contributions
(``push_grad``, run = job, seq = step) are listed the same way, and mailbox messages sent but
not taken yet in a table of their own.
The rows come from the servers' Status replies (``StatusReply.pending``, role ``read``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from paramshard.commands import (
    EXIT_FAILURE,
    RUN,
    arg,
    cluster_spec,
    command,
    human_bytes,
    human_duration,
    positive,
    positive_int,
    table,
)
from paramshard.membership_status import membership_text, ranks_text

__all__ = ["status", "STATUS_COLUMNS", "PENDING_COLUMNS", "MESSAGE_COLUMNS"]

STATUS_COLUMNS = (
    "SERVER",
    "HEALTH",
    "DEVICE",
    "JOBS",
    "BUFFERS",
    "MAX VERSION",
    "PARAMS",
    "GRADS",
    "OPTIMIZER",
    "MEMORY",
    "DEVICE MEMORY",
    "UPTIME",
)
_RIGHT_ALIGNED = frozenset(range(3, len(STATUS_COLUMNS)))
PENDING_COLUMNS = (
    "RUN", "KIND", "SEQ", "PART", "RANKS IN", "RANKS MISSING", "RANKS WAITING", "NOT READ BY",
    "AGE", "IDLE", "KEY",
)  # fmt: skip
MESSAGE_COLUMNS = ("RUN", "FROM", "TO", "TAG", "SEQ", "BYTES", "AGE", "KEY")


@command(
    arg(
        "--servers",
        metavar="HOST:PORT,...",
        help="servers to ask (default: $PARAMSHARD_SERVERS, else the run paramshard launch is"
        " running)",
    ),
    RUN,
    arg("--json", action="store_true", help="print the servers' Status replies as JSON"),
    arg(
        "--timeout",
        type=positive,
        default=5.0,
        help="deadline per server, seconds (default: %(default)g)",
    ),
    arg(
        "--pending",
        action="store_true",
        help="also list what waits on each server: open collectives (who arrived, who is"
        " missing, for how long), gradient steps waiting for ranks, unread mailbox messages",
    ),
    arg(
        "--max-pending",
        type=positive_int,
        default=100,
        metavar="N",
        help="rows of pending work per server at most (default: %(default)s; servers cap it"
        " at 1000 and say how many they left out)",
    ),
)
def status(args: argparse.Namespace) -> int:
    """Show what each shard server holds: jobs, buffers, versions, bytes, memory, uptime.

    With --pending, also what waits on each server, per run: every open collective (its kind
    and sequence number, which ranks arrived, which are missing, which wait to read it, and
    for how long), gradient steps waiting for ranks, and mailbox messages nobody took yet.
    A server that does not answer gets an error row; the exit code is then 1. Elastic jobs
    (docs/elastic.md) get a section of their own: each one's members, the ranks that joined
    and left, the steps trained at each world size, and its newest events.
    """
    from paramshard.client import ShardClient

    spec = cluster_spec(args.servers, args.run_id, role="read")
    client = ShardClient(spec, timeout_s=args.timeout, retries=1)
    try:
        replies = client.status(pending=args.pending, max_pending=args.max_pending)
    finally:
        client.close()
    if args.json:
        print(json.dumps(replies, indent=2))
    else:
        print(table(STATUS_COLUMNS, [_status_row(r) for r in replies], _RIGHT_ALIGNED))
        for r in replies:
            if "error" in r:
                print(f"{r['address']}: {r['error']}")
        elastic = membership_text(replies)
        if elastic:
            print(f"\n{elastic}")
        if args.pending:
            for r in replies:
                if "error" not in r:
                    print(f"\n{_pending_text(r)}")
    return EXIT_FAILURE if any("error" in r for r in replies) else 0


def _status_row(reply: dict[str, Any]) -> list[str]:
    if "error" in reply:
        return [reply["address"], "error", *["-"] * (len(STATUS_COLUMNS) - 2)]
    jobs = reply.get("jobs", [])
    buffers = [b for job in jobs for b in job.get("buffers", [])]

    def total(key: str) -> str:  # uint64 fields arrive as strings (protobuf JSON mapping)
        return human_bytes(sum(int(b.get(key, 0)) for b in buffers))

    version = max((int(b.get("version", 0)) for b in buffers), default=None)
    limit = int(reply.get("memory_limit", 0))
    used = human_bytes(int(reply.get("memory_used", 0)))
    memory = f"{used} / {human_bytes(limit) if limit else 'no limit'}"
    device = (
        f"{human_bytes(int(reply.get('device_memory_used', 0)))}"
        f" / {human_bytes(int(reply.get('device_memory_total', 0)))}"
    )
    return [
        reply["address"],
        "ok",
        reply.get("device", "?"),
        str(len(jobs)),
        str(len(buffers)),
        "-" if version is None else str(version),
        total("param_bytes"),
        total("grad_bytes"),
        total("optimizer_bytes"),
        memory,
        device,
        human_duration(float(reply.get("uptime_seconds", 0.0))),
    ]


def _pending_text(reply: dict[str, Any]) -> str:
    """The pending work of one server: open collectives and steps, then unread messages."""
    rows = reply.get("pending", [])
    messages = [p for p in rows if _unread_message(p)]
    work = [p for p in rows if not _unread_message(p)]
    left_out = int(reply.get("pending_left_out", 0))
    where = f"{reply['address']} (server {reply['index']})"
    if not rows:
        return f"Pending on {where}: nothing waits"
    lines = [
        f"Pending on {where}: {len(work)} open collective(s) or step(s),"
        f" {len(messages)} unread message(s)"
        + (f", {left_out} more not listed (--max-pending)" if left_out else "")
    ]
    if work:
        work.sort(key=lambda p: (p["run"], p["kind"], int(p["seq"]), p["part"]))
        text = table(PENDING_COLUMNS, [_pending_row(p) for p in work], frozenset({2, 3, 8, 9}))
        lines += ["  " + line for line in text.splitlines()]
    if messages:
        messages.sort(key=lambda p: (p["run"], p["channel"], int(p["seq"])))
        text = table(MESSAGE_COLUMNS, [_message_row(p) for p in messages], frozenset({4, 5, 6}))
        lines += ["  Unread messages:"] + ["  " + line for line in text.splitlines()]
    return "\n".join(lines)


def _unread_message(p: dict[str, Any]) -> bool:
    """A mailbox message that is in, waiting for its receiver (not one waiting for a sender)."""
    return p["kind"] == "send" and bool(p["arrived"]) and not p["missing"]


def _pending_row(p: dict[str, Any]) -> list[str]:
    unknown = not p["missing"] and not p["arrived"] and int(p["expected"]) == 0
    return [
        p["run"],
        p["kind"],
        str(p["seq"]),
        str(p["part"]) if p["kind"] not in ("push_grad", "send", "slot") else "-",
        ranks_text(p["arrived"]),
        "? (no contribution yet)" if unknown else ranks_text(p["missing"]),
        ranks_text(p["waiting"]),
        ranks_text(p["unread_by"]),
        _age(p["age_seconds"]),
        _age(p["idle_seconds"]),
        p["key"],
    ]


def _message_row(p: dict[str, Any]) -> list[str]:
    pair, _, tag = p["channel"].partition(".")
    src, _, dst = pair.partition("-")
    return [
        p["run"],
        src,
        dst,
        tag or "-",
        str(p["seq"]),
        human_bytes(int(p["bytes"])),
        _age(p["age_seconds"]),
        p["key"],
    ]


def _age(seconds: float) -> str:
    """``4.2s`` under a minute (hangs are told apart by seconds), else as ``human_duration``."""
    return f"{float(seconds):.1f}s" if float(seconds) < 60 else human_duration(float(seconds))
