"""Checkpoints and recovery of a ``HybridShardedModel``: one snapshot per (stage, tensor rank)
part, taken and restored together, and what ``train_with_recovery`` calls after a failure.
"""

from __future__ import annotations

import time
from typing import Any

from paramshard.client.carry import restore_or_carry
from paramshard.client.tensor_parts import part_job
from paramshard.strategies.data_parallel.checkpoints import confirm_kept
from paramshard.strategies.data_parallel.elastic_checkpoints import server_versions

__all__ = ["HybridCheckpoints"]


class HybridCheckpoints:
    """``HybridShardedModel``'s snapshots and recovery; its parts are ``replica`` (this rank's
    ZeRO-1 part), ``pipeline`` and the groups' clients."""

    config: Any
    replica: Any
    pipeline: Any
    groups: Any
    data_parallel_size: int
    topology: Any
    _verdict: Any
    _invalidate: Any
    _loaded: tuple[str, float] | None = None  # as ``ElasticCheckpoints._loaded``

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, tag: str) -> int:
        """Snapshot of the whole model on the servers under ``tag``: one snapshot per (stage,
        tensor rank) job (``<job>.pp<s>.tp<t>``), all at one version and committed only once
        every part is written, tensor-parallel parts marked in their manifests.
        ``paramshard export --snapshot <dir>/<job>/<tag>`` puts the whole model back together.
        Every rank calls it at the same point; returns the version captured."""
        from paramshard.client import tools

        world = self.config.client
        self.replica.ensure_idle()
        world.barrier()  # every part has stepped as far as it will before the capture
        version = self.replica.step_count
        if world.rank == 0:
            version = tools.snapshot(world, self.config.job, tag)["version"]
        world.barrier()
        return version

    def load_checkpoint(self, tag: str = "latest") -> int:
        """Restores snapshot ``tag`` of the whole model (resharded over these servers if their
        number changed) and continues from its step. All parts are checked on every server
        before any is swapped in, and "latest" is the newest tag every part has. A snapshot
        taken in another pipeline x tensor layout, or of a data-parallel job, is carried to
        this one, parameters and optimizer state (client/carry.py). Every rank calls it."""
        replica, world = self.replica, self.config.client
        if not replica.registered:
            raise RuntimeError("load_checkpoint needs a HybridShardedOptimizer attached first")
        replica.ensure_idle()
        world.barrier()  # nobody still reads the old state when rank 0 replaces it
        layout = (self.topology.pipeline_parallel_size, self.topology.tensor_parallel_size)
        restore_or_carry(
            world,
            self.config.job,
            tag,
            self.data_parallel_size,
            layout,
            replica.prepare_carried,
        )
        world.barrier()
        self._loaded = None if tag == "latest" else (tag, time.time())
        version = replica.adopt_server_version()
        self._invalidate()
        world.barrier()
        return version

    # -- recovery (strategies.train_with_recovery) -----------------------------------------------
    @property
    def registered(self) -> bool:
        """Whether the optimizer is attached (this rank's part registered on its servers)."""
        return self.replica.registered

    @property
    def step_count(self) -> int:
        """Optimizer steps applied (the servers' version of this rank's part)."""
        return self.replica.step_count

    def restart_collectives(self, epoch: int) -> None:
        """After a failure left ranks at different collectives: every group this rank is in
        numbers its collectives afresh in ``epoch`` (the same on every rank)."""
        tied = [group for group, _ in self.pipeline.tied_groups]
        groups = (self.groups.tp, self.groups.pp, self.groups.dp, *tied)
        for client in (self.config.client, *groups):
            if client is not None:
                client.restart_collectives(epoch)

    def abandon_step(self) -> None:
        """Drops a step that cannot finish (a server died): pushes in flight, the pipeline's
        pending transfers, gradients pushed so far."""
        self.replica.abandon_step()
        self.pipeline.abandon()
        self._verdict = None
        self._invalidate()

    @property
    def recovery_source(self) -> str:
        """What ``recover`` restores from, in words (for the recovery's messages)."""
        return "restoring every part from their newest common snapshot"

    def confirm_kept(self) -> None:
        """Raises a recoverable NOT_FOUND when a server of any part lost it after the last
        update (strategies/data_parallel/checkpoints.py). Every rank asks about every part,
        so all recover together: asking about its own part only, a rank whose part was whole
        returned while the ranks of the part that was not recovered alone, and failed."""
        world, topo, step = self.config.client, self.topology, self.replica.step_count
        held: dict[int, dict[str, int | None]] = {}  # server -> part -> version, asked once
        for pp in range(topo.pipeline_parallel_size):
            for tp in range(topo.tensor_parallel_size):
                job = part_job(self.config.job, pp, tp)
                ranks = topo.data_group(topo.rank_of(pp, tp, 0))  # the part's replicas
                servers = list(dict.fromkeys(world.server_of(r) for r in ranks))
                for i in servers:
                    if i not in held:
                        held[i] = server_versions(world, i)
                lost = [i for i in servers if held[i].get(job) != step]
                confirm_kept(world, job, step, lost)

    def recover(self) -> int:
        """After a server died and came back: every part returns to the newest snapshot all
        parts have (``load_checkpoint("latest")``; a restarted server gets its own slices
        back); returns the step to continue from. Every rank calls it. After a rollback
        (``load_checkpoint`` of an older tag) with no snapshot taken since, that tag
        (``tools.recovery_tag``)."""
        from paramshard.client import tools

        loaded = self._loaded
        tag = tools.recovery_tag(self.config.client, self.config.job, loaded)
        version = self.load_checkpoint(tag)
        self._loaded = loaded if tag != "latest" else None  # still the one to go back to
        return version
