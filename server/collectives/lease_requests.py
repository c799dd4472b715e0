"""The checks a lease request passes before anything changes (server/collectives/leases.py
holds the rules that use them; server/collectives/lease_records.py what they read).

One process a rank: each request names its process and its client in the process
(``LeaseRequest.holder``, ``client``). While a rank's lease is held through an open stream,
another process's requests for it are refused with ALREADY_EXISTS (``check_holder``): two jobs
under one run id would otherwise sum into each other's slots. A restarted trainer takes the
rank over once the old process's streams ended. A client's requests that come late change
nothing: a release once the process's next client holds the rank (``superseded``), a renewal
or stream once the client released (``released_before``). A client being made in a process new
to a run in which no live process is behind any lease starts a new run (``abandoned``: a killed
job run again), once the server has heard from none of its ranks for ``SETTLE_S``
(``check_settled``); a restart of a rank of a run that ended on a final notice meets it
(``restart_of``).
"""

from __future__ import annotations

from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.run_ids import run_id_problem
from paramshard.server.collectives.gone_keys import of_run
from paramshard.server.collectives.lease_records import SETTLE_S, RunRecord
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.request_bounds import check_epoch

__all__ = [
    "abandoned",
    "check_holder",
    "check_request",
    "check_settled",
    "ended_run",
    "released_before",
    "restart_of",
    "superseded",
]

MAX_WORLD = 1 << 20
TTL_MS = (100, 600_000)
MAX_REJOIN_MS = 3_600_000
MAX_REASON_CHARS = 1024
MAX_HOLDER_CHARS = 256
MAX_LAUNCH_CHARS = 64


def check_request(req: pb.LeaseRequest) -> None:
    """Refuses a malformed request before anything changes."""
    problem = run_id_problem(req.run)
    if problem is not None:
        raise ShardError.invalid(f"Lease: {problem}")
    if not 1 <= req.world_size <= MAX_WORLD or req.rank >= req.world_size:
        raise ShardError.invalid(
            f"Lease: rank {req.rank} of world size {req.world_size} (1..{MAX_WORLD} ranks)"
        )
    if not req.release and not TTL_MS[0] <= req.ttl_ms <= TTL_MS[1]:
        raise ShardError.invalid(
            f"Lease: ttl_ms must be in {TTL_MS[0]}..{TTL_MS[1]}, got {req.ttl_ms}"
        )
    if req.rejoin_ms > MAX_REJOIN_MS:
        raise ShardError.invalid(f"Lease: rejoin_ms must be at most {MAX_REJOIN_MS}")
    if len(req.abort) > MAX_REASON_CHARS:
        raise ShardError.invalid(f"Lease: an abort reason is at most {MAX_REASON_CHARS} chars")
    if len(req.holder) > MAX_HOLDER_CHARS:
        raise ShardError.invalid(f"Lease: a holder is at most {MAX_HOLDER_CHARS} characters")
    if len(req.launch) > MAX_LAUNCH_CHARS:
        raise ShardError.invalid(f"Lease: a launch id is at most {MAX_LAUNCH_CHARS} characters")
    check_epoch(req.epoch, "Lease")


def check_holder(run: RunRecord | None, req: pb.LeaseRequest, now: float) -> None:
    """Refuses ``req`` when another process holds its rank through an open stream, or renewed
    it since its last stream ended (a blip reset the stream; it opens another at once): two
    jobs share the run id, or the rank was started twice. Their collectives would meet in the same
    slots, and a sum that mixes two jobs' gradients fails nowhere, so the second one is told
    instead (ALREADY_EXISTS), before anything changes: the first one's lease, epoch and run go
    on untouched. A holder whose streams all ended (its process died) is replaced: that is a
    restart. A request without a holder (an older client) is refused by a named holder's
    stream too (it would release the rank or start a new run in its place), but it does not
    refuse others. The message shows a holder without its random part (``holder_id`` in
    client/lease_holds.py), which another process would need to pass for it."""
    lease = run.leases.get(req.rank) if run is not None else None
    if lease is None or not lease.holder:
        return
    # renewed lately (a client whose stream broke renews every second until its next opens)
    renewed = lease.reheard and lease.closed_at is None and now - lease.heard < SETTLE_S
    if lease.holder != req.holder and (lease.holds or renewed):
        how = "through an open lease stream" if lease.holds else "renewing it (its stream broke)"
        raise ShardError.conflict(
            f"Lease: rank {req.rank} of run '{req.run}' is held by another process"
            f" ({_shown(lease.holder)}) {how}; this one is"
            f" {_shown(req.holder) or 'unnamed (an older client)'}. Two"
            " jobs share the run id (give each its own PARAMSHARD_RUN), or the rank was"
            " started twice. (A host that vanished holds its stream until this server's TCP"
            " user timeout ends it.)"
        )


def _shown(holder: str) -> str:
    return holder.rsplit(" ", 1)[0]


def restart_of(run: RunRecord, req: pb.LeaseRequest) -> bool:
    """Whether ``req`` restarts a rank of ``run`` (``LeaseRequest.restarted``, same world size),
    started by a launcher one of whose processes leased in it (``launch``: a new job run again
    under the run id has launchers of its own; a restart without one, from an older client,
    is taken at its word)."""
    if not req.restarted or run.world_size != req.world_size:
        return False
    return not req.launch or req.launch in run.launches.values()


def released_before(run: RunRecord | None, req: pb.LeaseRequest) -> bool:
    """Whether renewal or stream ``req`` comes from a client that released its rank's lease
    here already: sent before the release, it came after. It holds nothing: a lease made from
    it would keep an ended run from being forgotten (the next run would meet its keys), or,
    held by a stream its client is closing, lapse and abort a run that goes on. Not late: an
    abort (the run's notice, a rank's to post whenever it can), and a release that says the
    rank ended for good (``ends``), which a client that closed before its process's exit sends
    at that exit (client/leases.py, ``_end_closed``): news its first release could not carry."""
    if req.abort or (req.release and req.ends):
        return False
    if run is None or not req.holder or not req.client:  # an older client: not told apart
        return False
    return run.released_by.get(req.rank) == (req.holder, req.client)


def ended_run(name: str, run: RunRecord, slots: Any) -> bool:
    """Whether run ``name``, whose leases are all gone, ended: every rank released its lease,
    or some did and nothing of the run waits in a slot of ``slots`` (an elastic job whose
    ranks never all ran). A rank that comes after its peers left, to read what they sent,
    finds its run still there."""
    if len(run.released) >= run.world_size:
        return True
    return bool(run.released) and not any(of_run(x.key, name) for x in slots.open_slots())


def abandoned(run: RunRecord, req: pb.LeaseRequest, now: float) -> bool:
    """Whether ``req`` comes from a client being made (``fresh``: a running rank never ends its
    own run) in a process new to run ``run`` (it holds none of its leases) while no lease of
    the run has a live process behind it: none held by an open stream or renewed since its
    last stream ended, and no rank awaited for a restart. That is a job whose ranks were all
    killed (a launcher that saw one rank die stops the others: nothing was released, and no
    rank lived on to witness a lapse), run again under its run id at once: a new run, or it
    would meet the old one's keys and open slots. A run whose ranks released theirs is left
    to ``ended_run``. Cheap for a rank's own renewals (its lease's holder is asked first), for
    a live run (its first live lease ends the walk) and while the run settles (its verdict is
    kept: the new job's clients ask again and again)."""
    if not req.fresh or not req.holder or req.release or not run.leases:
        return False
    if run.settling is not None and now < run.settling[0]:  # so found lately (check_settled)
        return req.holder not in run.settling[1]
    mine = run.leases.get(req.rank)
    if mine is not None and mine.holder == req.holder:
        return False
    return not any(
        lease.holds
        or (lease.closed_at is None and lease.expires >= now)
        or lease.holder == req.holder
        or (lease.rejoin_s > 0 and now - lease.expires < lease.rejoin_s)
        for lease in run.leases.values()
    )


def check_settled(run: RunRecord, req: pb.LeaseRequest, now: float) -> None:
    """Refuses ``req``, from a process new to abandoned run ``run``, while the server heard
    from one of its ranks less than ``SETTLE_S`` ago (ALREADY_EXISTS, which a new client asks
    again): they may be reconnecting, and a new run in its place would end their open slots.
    Nothing changes. The verdict is kept until the settle time ends (``RunRecord.settling``),
    so the new job's clients, asking again, do not each walk the run."""
    if run.settling is None or run.settling[0] <= now:
        quiet = now - max(lease.last_alive for lease in run.leases.values())
        if quiet >= SETTLE_S:
            return
        run.settling = (now + SETTLE_S - quiet, frozenset(x.holder for x in run.leases.values()))
    quiet = SETTLE_S - (run.settling[0] - now)
    raise ShardError.conflict(
        f"Lease: run '{req.run}' has no live rank on this server, but it heard from one"
        f" {quiet:.1f} s ago; a new job takes over the run id once it has heard from none"
        f" for {SETTLE_S:.0f} s (its ranks may be reconnecting). Ask again."
    )


def superseded(run: RunRecord, req: pb.LeaseRequest) -> bool:
    """Whether release ``req`` comes from another client than the one that renewed or held
    its rank's lease last: a closed client whose release, late on a loaded machine, reached
    this server after the same process's next client leased the rank. It drops nothing: the
    lease is the new client's, and counted as released it would end a run that goes on. So
    does a release without a holder (an older client) of a named process's lease."""
    lease = run.leases.get(req.rank)
    if lease is None or not lease.holder:  # an older client's: not told apart
        return False
    return (lease.holder, lease.client) != (req.holder, req.client)
