"""What ``train_with_recovery`` reports (strategies/recovery.py): the losses of the steps trained,
the recoveries, what each cost and what started it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["RESTARTED", "RecoveryReport"]

RESTARTED = "RESTARTED"
"""``RecoveryReport.causes``: a rank restarted alone met the others in a new epoch."""


@dataclass
class RecoveryReport:
    """What happened: losses by step (replayed steps overwrite), recoveries and their cost.

    ``resumed_at[i]`` is the step the i-th recovery continued from and ``failed_at[i]`` the
    step that was running when it failed (``failed_at[i] - resumed_at[i]`` steps replayed)."""

    losses: dict[int, float] = field(default_factory=dict)
    recoveries: int = 0
    recovery_seconds: list[float] = field(default_factory=list)
    replayed_steps: int = 0
    failed_at: list[int] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    """The gRPC code that started each recovery: UNAVAILABLE or NOT_FOUND where this rank met
    the failed server itself, ABORTED where another rank's notice reached it first
    (client/leases.py), DEADLINE_EXCEEDED where a wait ran out; ``RESTARTED`` where this
    process came restarted alone and met the others in a new epoch."""
    committed_without_loss: list[int] = field(default_factory=list)
    """Steps whose update the servers had committed when this rank's ``train_step`` failed
    after it (say, in the loss's all-reduce): trained and not replayed, but with no loss in
    ``losses``. ``progress`` was not called for them; ``should_stop`` is asked about the last
    step the servers hold after the recovery, with a NaN loss."""
    stopped_early: bool = False

    def recovered(self, failed: int, restored: int, began: float) -> None:
        """Records a recovery from step ``failed`` that resumed at step ``restored`` and began
        at ``began`` (monotonic). A rank whose failed call came after the step's update (the
        loss's all-reduce) finds the servers one step ahead of it: that step was trained, only
        its loss is unknown."""
        self.replayed_steps += max(0, failed - restored)
        self.committed_without_loss.extend(range(failed, restored))
        self.recovery_seconds.append(time.monotonic() - began)
        self.failed_at.append(failed)
        self.resumed_at.append(restored)

    @property
    def trained_steps(self) -> list[int]:
        """Every step this rank saw trained, in order: with a loss or committed without one."""
        return sorted(set(self.losses) | set(self.committed_without_loss))
