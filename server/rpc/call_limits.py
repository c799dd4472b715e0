"""The bounds on the calls a server runs at once, which the admission gate keeps
(server/rpc/admission.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GRPC_INT_MAX", "CallLimits", "default_reserved"]


def default_reserved(workers: int) -> int:
    """Threads kept for working calls unless told: a quarter of the workers, at most 16."""
    return max(1, min(16, workers // 4))


GRPC_INT_MAX = 2**31 - 1
"""The largest value of a gRPC setting (pending requests, threads, a message's length, a wait
in seconds): they are 32-bit."""


@dataclass(frozen=True)
class CallLimits:
    """Bounds on the calls a server runs at once (``paramshard serve`` flags in brackets)."""

    workers: int = 128
    """Threads for calls [--workers]; waiting calls take at most ``workers - reserved``."""
    reserved: int = 16
    """Threads a waiting call never takes: pushes, steps and Status always find one
    [--reserved-workers]."""
    max_waiting_read: int = 16
    """Calls of waiting methods by ``read`` tokens at once (inspect, get, export)
    [--max-waiting-read]."""
    max_streams: int = 4
    """Open reflection / health Watch streams at once, on threads of their own
    [--max-streams]."""
    max_sessions: int = 64
    """Open client sessions (server/transport/sessions.py) at once, on threads of their own, of read
    tokens at most a quarter (``CallGate.read_bound``); 0 turns sessions off
    [--max-sessions]."""
    max_pending_calls: int = 16384
    """Calls gRPC's core keeps while no thread has taken them up yet (a burst of many ranks'
    calls, a stall of the server's Python threads); one more ends CANCELLED unrun. gRPC's own
    default, 1,000 and at most 3,000, cancelled calls of a few hundred ranks' windows
    (client/rpc.py ``MAX_IN_FLIGHT`` calls each) [--max-pending-calls]."""

    def __post_init__(self) -> None:
        for name, low in (
            ("workers", 2),
            ("reserved", 1),
            ("max_waiting_read", 1),
            ("max_pending_calls", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or not low <= value <= GRPC_INT_MAX:
                raise ValueError(
                    f"CallLimits.{name} must be an int in {low}..2**31 - 1, got {value!r}"
                )
        for name in ("max_streams", "max_sessions"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= GRPC_INT_MAX:
                raise ValueError(f"CallLimits.{name} must be an int in 0..2**31 - 1, got {value!r}")
        if self.reserved >= self.workers:
            raise ValueError(
                f"CallLimits.reserved ({self.reserved}) must be below workers ({self.workers}):"
                " waiting calls need threads too"
            )

    @property
    def threads(self) -> int:
        """The size of the server's thread pool: the workers, the streams' and the sessions'
        own."""
        return self.workers + self.max_streams + self.max_sessions
