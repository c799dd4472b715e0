"""What a server's leases say of the ranks a wait waits for (server/collectives/leases.py
asks, for the slots' and buffers' waits and for Status's pending rows): where each missing
rank is (``whereabouts``), and whether they all ended for good (``ended``)."""

from __future__ import annotations

from collections.abc import Sequence

from paramshard.protos.ended_ranks import ENDED
from paramshard.server.collectives.lease_records import RunRecord
from paramshard.server.runtime.rank_lists import MAX_LISTED
from paramshard.server.runtime.run_names import grouped, run_root

__all__ = ["whereabouts", "ended"]


def whereabouts(runs: dict[str, RunRecord], run: str, ranks: Sequence[int], now: float) -> str:
    """What the leases in ``runs`` say of the first 4 of ``ranks`` of ``run``, for a wait that
    waited for them (a group's ranks are not the run's: nothing): a rank that released its
    lease and holds none (its process ended, or closed its client: it contributes no more
    unless it leases again), a rank whose lease lapsed while the run waits for it to come back
    (a restart), a rank alive (its lease held) that has not come, and one that holds no lease
    here while others of its run do. Single reads of dicts and fields, no walk, so the caller
    need not hold the lease table's lock."""
    found = None if grouped(run) else runs.get(run_root(run))
    if found is None:
        return ""
    words = []
    for rank in ranks[:4]:
        lease = found.leases.get(rank)
        if lease is None and (at := found.released_at.get(rank)) is not None:
            where = _process(found.released_by.get(rank, ("",))[0])
            words.append(
                f"; rank {rank} released its lease here {now - at:.1f} s ago (its process ended"
                f" or closed its client){where}"
            )
        elif lease is not None and lease.lapsed_at is not None and not lease.live(now):
            words.append(
                f"; rank {rank}'s lease lapsed {now - lease.lapsed_at:.1f} s ago; the run waits"
                f" {lease.rejoin_s:g} s from then for it to come back{_process(lease.holder)}"
            )
        elif lease is not None and lease.live(now):
            how = "its connection here is open" if lease.holds else "it renews its lease"
            words.append(
                f"; rank {rank} is alive ({how}) but has not come: stopped, slow, or at"
                f" another collective{_process(lease.holder)}"
            )
        elif lease is None:
            words.append(f"; rank {rank} holds no lease here: not started, or cut off")
    return "".join(words)


def _process(holder: str) -> str:
    """`` (host NAME pid N)``: the process that held a rank's lease, as its client names
    itself (client/lease_holds.py ``holder_id``, its random part left out); "" for none."""
    name, _, _ = holder.rpartition(" ")
    return f" (host {name[:80]})" if name else ""


def ended(runs: dict[str, RunRecord], run: str, ranks: Sequence[int], now: float) -> str:
    """Words for a wait on ``ranks`` of ``run`` when every one of them (at least one) ended
    for good: released its lease with ``LeaseRequest.ends`` (its process exited normally,
    nothing starts it again) and holds none; "" otherwise, for a group's ranks, and for a list
    cut at ``MAX_LISTED`` (more may be missing). Single reads of dicts, as ``whereabouts``."""
    found = None if grouped(run) or not 0 < len(ranks) < MAX_LISTED else runs.get(run_root(run))
    if found is None or not found.ended_at:
        return ""
    when = [found.ended_at.get(r) if r not in found.leases else None for r in ranks]
    if any(t is None for t in when):
        return ""
    ago = now - max(t for t in when if t is not None)
    return (
        f"missing rank(s) {', '.join(map(str, ranks[:8]))}{', ...' if len(ranks) > 8 else ''}"
        f" ended: their process exited with no uncaught exception (its script's end, or"
        f" sys.exit; the last {ago:.1f} s ago) and {ENDED};"
        " every rank must make the same collectives and steps (uneven inputs?)"
    )
