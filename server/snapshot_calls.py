"""The snapshot calls of the Shard service (Snapshot, CommitSnapshot, Restore,
ListSnapshots, DeleteSnapshot) over a server's buffers and its snapshot folder: capture a job
at a version and write this server's shard file, commit the manifest, load a snapshot's part
resharded for this server's index, list what is there (for a scoped caller, only its jobs),
remove a tag that none of the others is using here."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from paramshard.protos import codec, slicing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.manifest import ParamEntry, recorded_model_config, recorded_parts
from paramshard.protos.placement import recorded_placement
from paramshard.protos.words import listed
from paramshard.server.buffers.slice_state import master_itemsize, slice_bytes
from paramshard.server.buffers.spec_checks import check_spec
from paramshard.server.buffers.store import BufferSlice, BufferStore, status_row
from paramshard.server.rpc.scopes import Scope
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.request_bounds import check_name, check_placement
from paramshard.server.runtime.run_names import run_root
from paramshard.server.snapshots.deletion import KEPT_NAMED
from paramshard.server.snapshots.files import SnapshotDir

__all__ = ["CHECKED_S", "SnapshotCalls"]

CHECKED_S = 60.0
"""How long a restore's check (phase one, ``check_only``) holds its tag against deletion here,
until the restore loads it (phase two, on every server once all checked): a tag deleted
between the phases would load on some servers and fail on others."""


class SnapshotCalls:
    """The servicer's snapshot methods, each given what it needs of the call (a timeout, the
    caller's scope) instead of the gRPC context."""

    def __init__(self, buffers: BufferStore, snapshots: SnapshotDir) -> None:
        self.buffers, self.snapshots = buffers, snapshots
        self.live_ranks: Callable[[str], frozenset[int] | None] = lambda run: None
        """The ranks of a run that hold leases here (the server's ``LeaseTable.live_ranks``)."""
        self._using: Counter[tuple[str, str]] = Counter()  # (job, tag) -> calls using it
        self._checked: dict[tuple[str, str], float] = {}  # (job, tag) -> a restore's check
        self._use_lock = threading.Lock()

    @contextmanager
    def _use(self, job: str, tag: str) -> Iterator[None]:
        """Marks ``job/tag`` in use by this call (a DeleteSnapshot of it is refused). A file
        of it that vanishes meanwhile (deleted by another server of a shared folder) fails
        the call with FAILED_PRECONDITION, not INTERNAL."""
        with self._use_lock:
            self._using[job, tag] += 1
        try:
            yield
        except FileNotFoundError as exc:
            raise ShardError.precondition(
                f"snapshot '{job}/{tag}': {Path(exc.filename or '?').name} vanished during the"
                " call (the tag deleted meanwhile?)"
            ) from None
        finally:
            with self._use_lock:
                self._using[job, tag] -= 1
                if not self._using[job, tag]:
                    del self._using[job, tag]

    def job_slices(self, job: str) -> list[BufferSlice]:
        slices = self.buffers.jobs().get(job)
        if not slices:
            raise ShardError.not_found(f"job '{job}' is not on this server")
        return slices

    def snapshot(self, req: pb.SnapshotRequest, timeout: float) -> Any:
        """This server's shard of ``req.job`` at ``req.version``, written. The wait for that
        version ends at ``timeout``, or once the caller went away (server/runtime/callers.py):
        the shard is then free for another call at once, not held until the deadline."""
        slices = self.job_slices(req.job)
        check_placement(req.server_index, req.num_servers, "snapshot")
        held = (slices[0].spec.server_index, slices[0].spec.num_servers)
        if (req.server_index, req.num_servers) != held:
            raise ShardError.precondition(
                f"snapshot of job '{req.job}': this server holds slice {held[0]} of {held[1]},"
                f" the request names shard {req.server_index} of {req.num_servers}"
            )
        self.snapshots.path(req.job, req.tag)  # checks names and that a directory is set
        # paid for first, snapshots at once could take the host's memory: the host copies, and
        # the shard file encoded from them (as large)
        copies = 2 * sum(b.capture_bytes() for b in slices)
        self.buffers.budget.reserve(copies, "snapshots", f"snapshot of job '{req.job}'")
        try:
            with self._use(req.job, req.tag):
                return self._snapshot(req, slices, timeout)
        finally:
            self.buffers.budget.release(copies, "snapshots")

    def _snapshot(
        self,
        req: pb.SnapshotRequest,
        slices: list[BufferSlice],
        timeout: float,
    ) -> Any:
        # (tag, shard) is this call's until it ends; the shard file then keeps it
        reservation = self.snapshots.reserve(
            req.job, req.tag, req.server_index, req.num_servers, req.version
        )
        requested: list[BufferSlice] = []
        try:
            try:  # every buffer asks first, so none can step past the version while we wait
                for b in slices:
                    b.request_capture(req.version)
                    requested.append(b)
                captured = [b.capture(req.version, timeout) for b in slices]
            finally:  # this call's requests only: another call's for the version stay
                for b in requested:
                    b.release_capture(req.version)
            file, nbytes, sha = self.snapshots.write_shard(
                req.job, req.tag, req.server_index, req.num_servers, req.version, captured
            )
        finally:
            reservation.release()
        # the slices the shard holds, as the manifest will list them: read afresh, a buffer
        # registered while the capture waited was listed and the snapshot could not restore
        rows = [status_row(b) for b in slices]
        return pb.SnapshotReply(
            file=file, bytes=nbytes, sha256=sha, version=req.version, buffers=rows
        )

    def commit(self, req: pb.CommitSnapshotRequest) -> Any:
        with self._use(req.job, req.tag):
            path = self.snapshots.commit(req.job, req.tag, req.manifest_json)
        return pb.CommitSnapshotReply(path=path)

    def delete(self, req: pb.DeleteSnapshotRequest) -> Any:
        """Removes ``req.job/req.tag`` here (or, ``check_only``, says whether it would),
        unless a call of this server uses it or a restore checked it (``CHECKED_S``)."""
        key, where = (req.job, req.tag), f"snapshot '{req.job}/{req.tag}'"
        with self._use_lock:  # held while the files go: no call of the tag starts meanwhile
            if self._using[key]:
                raise ShardError.precondition(
                    f"delete: {where} is in use on this server (a Snapshot, CommitSnapshot or"
                    " Restore of it runs): try again once it has ended"
                )
            checked = time.monotonic() - self._checked.get(key, -math.inf)
            if checked < CHECKED_S:
                raise ShardError.precondition(
                    f"delete: a restore of {where} was checked on this server {checked:.1f} s"
                    f" ago and has not loaded it (held for {CHECKED_S:g} s): try again later"
                )
            self._checked.pop(key, None)
            done = self.snapshots.delete(req.job, req.tag, req.check_only)
        return pb.DeleteSnapshotReply(
            found=done.found,
            files=done.files,
            bytes=done.bytes,
            complete=done.complete,
            kept=sorted(done.kept)[:KEPT_NAMED],
            more_kept=max(0, len(done.kept) - KEPT_NAMED),
        )

    def restore(self, req: pb.RestoreRequest) -> Any:
        check_placement(req.server_index, req.num_servers, "restore")
        if req.into:  # a job name whatever the snapshot lists (a manifest may list no buffer)
            check_name(req.into, "job", "Restore")
            self._check_new(req)
        else:
            self._check_not_training(req)
        tag = self.snapshots.latest(req.job) if req.tag == "latest" else req.tag
        with self._use(req.job, tag):
            reply = self._restore(req, tag)
        with self._use_lock:  # checked: held until loaded (a restore checks all, then loads)
            if req.check_only:
                self._checked[req.job, tag] = time.monotonic()
            else:
                self._checked.pop((req.job, tag), None)
        return reply

    def _restore(self, req: pb.RestoreRequest, tag: str) -> Any:
        manifest = self.snapshots.load_manifest(req.job, tag)
        layout = self.snapshots.layout(req.job, tag, manifest)
        specs = [self._spec(req, name, info, recorded_model_config(manifest))
                 for name, info in manifest["buffers"].items()]  # fmt: skip
        for spec in specs:  # a manifest is a caller's file (CommitSnapshot): checked as sent
            check_spec(spec, "Restore")
        target = req.into or req.job
        what = f"restore of job '{req.job}'" + (f" as '{req.into}'" if req.into else "")
        self.buffers.check_room(target, specs, what)
        # paid for first: the slices built, and their params and state as read from the files
        need = sum(slice_bytes(spec) + _read_bytes(spec, layout) for spec in specs)
        self.buffers.budget.reserve(need, "snapshots", what)
        try:
            slices = [self._restored(req, tag, manifest, layout, spec) for spec in specs]
        finally:
            self.buffers.budget.release(need, "snapshots")
        if not req.into and self._own_ranks_restore(req):  # after the files' own checks
            self._check_fits(req, tag, specs)
        if req.check_only:
            return pb.RestoreReply(tag=tag, version=manifest["version"], buffers=len(slices))
        # all read and checked: in one go (as a new job only, under another name)
        self.buffers.replace_job(target, slices, "snapshot", new=bool(req.into))
        return pb.RestoreReply(tag=tag, version=manifest["version"], buffers=len(slices))

    @staticmethod
    def _spec(
        req: pb.RestoreRequest, name: str, info: dict[str, Any], model_config: str
    ) -> pb.RegisterBufferRequest:
        """Buffer ``name`` of a snapshot's manifest, as this server registers its slice."""
        return pb.RegisterBufferRequest(
            ref=pb.BufferRef(job=req.into or req.job, buffer=name),
            numel=info["numel"],
            num_servers=req.num_servers,
            server_index=req.server_index,
            contributors=req.contributors or info["contributors"],
            params=[ParamEntry.from_manifest(p).to_pb() for p in info["params"]],
            optimizer=pb.OptimizerSpec(
                name=info["optimizer"]["name"], hyper=info["optimizer"]["hyper"]
            ),
            master_dtype=codec.wire_dtype(codec.master_dtype(info.get("master_dtype"))),
            model_config=model_config,
        )

    def _restored(
        self,
        req: pb.RestoreRequest,
        tag: str,
        manifest: dict[str, Any],
        layout: dict[str, Any],
        spec: pb.RegisterBufferRequest,
    ) -> BufferSlice:
        """The slice ``spec`` of snapshot ``tag``, read and built (not swapped in)."""
        name = spec.ref.buffer
        start, stop = slicing.slice_bounds(spec.numel, req.num_servers, req.server_index)

        def read(kind: str) -> Any:
            return self.snapshots.read_range(req.job, tag, manifest, name, kind, start, stop)

        row = layout.get(name, {"state": set(), "step_count": 0})
        state = {k: read(f"state.{k}") for k in sorted(row["state"])}
        return BufferSlice.restored(
            spec, manifest["version"], read("params"), state, row["step_count"]
        )

    def _own_ranks_restore(self, req: pb.RestoreRequest) -> bool:
        """Whether a rank of the run that trains ``req.job`` here (its ranks hold leases)
        restores it: its ``load_checkpoint`` or recovery, which needs the model it trains. A
        tool's restore replaces whatever the job holds, as taken (``paramshard restore``)."""
        runs = {b.run for b in self.buffers.jobs().get(req.job, []) if b.run}
        return any(self.live_ranks(run) and run_root(req.run) == run for run in runs)

    def _check_fits(self, req: pb.RestoreRequest, tag: str, specs: list[Any]) -> None:
        """A snapshot its own ranks restore over the job they train is of their model: each
        buffer both have of the same size, parameters (names, shapes, places) and optimizer
        (the buffers themselves may differ: a job's raw client may have made more since).
        Before, another model's snapshot was swapped in, and its ranks failed later and less
        clearly (a pull outside the slice; an optimizer's unknown hyper-parameter at the
        first step; a collective waiting out its deadline). The placement, the data-parallel
        ranks and the hyper-parameters may differ: a restore reshards, and schedules move."""
        held = {b.name: b.spec for b in self.buffers.jobs().get(req.job, [])}
        if not held:
            return

        def params(spec: Any) -> list[tuple[str, tuple[int, ...], int]]:
            return [(p.name, tuple(p.shape), p.offset) for p in spec.params]

        got = {spec.ref.buffer: spec for spec in specs}
        why = []
        for name in sorted(set(got) & set(held)):
            new, old = got[name], held[name]
            if new.numel != old.numel or params(new) != params(old):
                why.append(f"buffer '{name}' holds other parameters (names, shapes or places)")
            elif new.optimizer.name != old.optimizer.name:
                why.append(
                    f"buffer '{name}': optimizer {new.optimizer.name} in the snapshot,"
                    f" {old.optimizer.name} here"
                )
        if why:
            raise ShardError.precondition(
                f"restore: snapshot '{req.job}/{tag}' is not of the model that registered job"
                f" '{req.job}' here ({listed(why, most=3)}); drop the job first (paramshard"
                " drop) to restore the snapshot as it was taken"
            )

    def _check_new(self, req: pb.RestoreRequest) -> None:
        """A restore ``into`` another name makes a new job: it never replaces one (a job of
        its own run's, or anyone's, would be swapped under its ranks)."""
        if req.into in self.buffers.jobs():
            raise ShardError.precondition(
                f"restore of job '{req.job}' as '{req.into}': a job '{req.into}' is on this"
                " server already; restore as a new name, or drop that job first"
            )

    def _check_not_training(self, req: pb.RestoreRequest) -> None:
        """Refuses to restore a job whose run trains it (its ranks hold leases here) unless a
        rank of that run asks (a recovery): the state would change under running ranks,
        whose next call fails (seen: ``paramshard restore`` while a job trained)."""
        for run in sorted({b.run for b in self.buffers.jobs().get(req.job, []) if b.run}):
            live = self.live_ranks(run)
            if live and run_root(req.run) != run:
                raise ShardError.precondition(
                    f"restore: job '{req.job}' is being trained: {len(live)} rank(s) of run"
                    f" '{run}' hold leases on this server; restore it once they stopped (the"
                    " run's own ranks restore it when they recover)"
                )

    def _listed(self, req: pb.ListSnapshotsRequest, scope: Scope | None) -> list[dict[str, Any]]:
        """``SnapshotDir.list``; for a scoped caller naming no job, each job in scope listed
        on its own (another job's manifests are not even read)."""
        if req.job or scope is None or self.snapshots.root is None:
            return self.snapshots.list(req.job, req.torn)
        found, torn = [], []
        for name in sorted(p.name for p in self.snapshots.root.iterdir() if p.is_dir()):
            if scope.allows_job(name):
                try:
                    rows = self.snapshots.list(name, req.torn)
                except ShardError:
                    continue  # not a job's folder (a name no job may have)
                found += [r for r in rows if not r.get("torn")]
                torn += [r for r in rows if r.get("torn")]
        return found + torn

    def list(self, req: pb.ListSnapshotsRequest, scope: Scope | None) -> Any:
        infos = []
        for m in self._listed(req, scope):
            if m.get("torn"):
                infos.append(pb.SnapshotInfo(**m))
                continue
            servers, cluster = recorded_placement(m)
            infos.append(
                pb.SnapshotInfo(
                    job=m["job"],
                    tag=m["tag"],
                    version=m["version"],
                    num_servers=m["num_servers"],
                    created_unix=m["created_unix"],
                    servers=servers,
                    cluster_servers=cluster,
                    parts=recorded_parts(m),
                )
            )
        return pb.ListSnapshotsReply(snapshots=infos)


def _read_bytes(spec: pb.RegisterBufferRequest, layout: dict[str, Any]) -> int:
    """The params and optimizer state of slice ``spec`` as read from a snapshot's files (the
    state arrays its ``layout`` lists), before the slice copies them in."""
    start, stop = slicing.slice_bounds(spec.numel, spec.num_servers, spec.server_index)
    arrays = 1 + len(layout.get(spec.ref.buffer, {}).get("state", ()))
    return (stop - start) * master_itemsize(spec) * arrays
