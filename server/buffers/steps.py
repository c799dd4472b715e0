"""A slice's optimizer step: the reduced gradient's norms and finiteness (for global clipping and
the all-or-none non-finite decision), and the step itself, applied or skipped once."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.membership import check_generation
from paramshard.server.buffers.nonfinite import all_finite, nonfinite_refusal
from paramshard.server.buffers.slice_state import SliceState
from paramshard.server.optimizers import OptimizerError
from paramshard.server.runtime import backend
from paramshard.server.runtime.errors import ShardError

__all__ = ["Steps"]


class Steps(SliceState):
    """GradNorm and Step of one slice. A step first lets ``Captures`` copy the version a
    snapshot waits for (``_capture``), so ``BufferSlice`` combines the two."""

    def sum_squares(self, step: int, timeout: float, generation: int | None = None) -> float:
        """This slice's sum of squares of the reduced gradient of ``step`` (an elastic step:
        of membership ``generation``, server/buffers/membership.py)."""
        kept = "applied_sum_squares"
        return self._norm_of(step, timeout, kept, self._sum_squares, generation)

    def param_sum_squares(
        self, step: int, timeout: float, generation: int | None = None
    ) -> list[float]:
        """The same, one value per registered parameter (its elements in this slice)."""
        kept = "applied_param_sum_squares"
        return self._norm_of(step, timeout, kept, self._param_sum_squares, generation)

    def finite(self, step: int, timeout: float, generation: int | None = None) -> bool:
        """Whether this slice's reduced gradient of ``step`` holds no NaN or Inf."""
        return self._norm_of(step, timeout, "applied_finite", self._finite, generation)

    def _norm_of(
        self, step: int, timeout: float, kept_attr: str, compute: Any, generation: int | None
    ) -> Any:
        """``compute()`` of the reduced gradient of ``step``, waiting for it, or the value
        kept when the step was applied (a faster rank already stepped)."""
        with self.cond:
            if step < self.version:
                kept = getattr(self, kept_attr)
                if kept is not None and kept[0] == step:
                    return kept[1]
                raise ShardError.precondition(
                    f"{self.label}: step {step} is already applied (version {self.version});"
                    " its gradient is gone"
                )
            self.wait_for(
                lambda: self.version > step or self._reduced(step, generation),
                timeout,
                f"the reduced gradient of step {step}",
            )
            if self.version > step:
                kept = getattr(self, kept_attr)
                if kept is None or kept[0] != step:
                    raise ShardError.precondition(
                        f"{self.label} moved to version {self.version} while waiting; the"
                        f" gradient of step {step} is gone"
                    )
                return kept[1]
            return compute()

    def step_would_wait(self, step: int) -> bool:
        """Whether a Step of ``step`` would wait for pushes now: a peek without the lock, for
        the admission gate (server/rpc/admission.py)."""
        return self.version == step and not self._reduced(step)

    def _reduced(self, step: int, generation: int | None = None) -> bool:
        """All contributions of ``step`` are in (of membership ``generation``, when given: a
        newer one raises). An empty slice (a buffer with fewer elements than servers) receives
        no pushes, so it is reduced whenever it is asked."""
        if self.slice_numel == 0:
            return self.version == step
        if generation is not None and not check_generation(
            self.label, self.pending, step, generation
        ):
            return False
        return self.pending is not None and self.pending.step == step and self.pending.reduced

    def _sum_squares(self) -> float:
        """Of the pending reduced gradient (caller holds the lock)."""
        if self.slice_numel == 0:
            return 0.0
        pending = self.pending
        assert pending is not None and pending.reduced
        if pending.sum_squares is None:
            g = self.grad
            pending.sum_squares = backend.sum_squares(g)
        return pending.sum_squares

    def _param_sum_squares(self) -> list[float]:
        """Per registered parameter, of the pending reduced gradient (caller holds the lock)."""
        if self.slice_numel == 0:
            return [0.0] * len(self.param_ranges)
        pending = self.pending
        assert pending is not None and pending.reduced
        if pending.param_sum_squares is None:
            g = self.grad
            pending.param_sum_squares = [
                backend.sum_squares(g[lo:hi]) if hi > lo else 0.0 for lo, hi in self.param_ranges
            ]
        return pending.param_sum_squares

    def _finite(self) -> bool:
        """Of the pending reduced gradient (caller holds the lock)."""
        if self.slice_numel == 0:
            return True
        pending = self.pending
        assert pending is not None and pending.reduced
        if pending.finite is None:
            pending.finite = all_finite(self.grad, self._sum_squares())
        return pending.finite

    def step(
        self,
        step: int,
        args: pb.StepArgs,
        timeout: float,
        skip: bool = False,
        generation: int | None = None,
    ) -> int:
        """Applies step ``step`` (``skip``: discards its gradient and moves the version on;
        ``generation``: an elastic step's membership generation the caller trained)."""
        self.check_step_args(args)
        with self.cond:
            if step < self.version:
                return self.version  # applied already: the first request won
            if step > self.version:
                raise ShardError.precondition(
                    f"{self.label} is at version {self.version}; cannot apply step {step}"
                )
            self.wait_for(
                lambda: self.version > step or self._reduced(step, generation),
                timeout,
                f"all gradient contributions of step {step}",
            )
            if self.version == step:
                if not skip and not self._finite():
                    raise ShardError.precondition(nonfinite_refusal(self.label, step))
                self._apply_step(args, skip)
                self.cond.notify_all()
            return self.version

    def check_step_args(self, args: pb.StepArgs) -> None:
        try:
            self.optimizer.check_hyper(dict(args.hyper))
        except OptimizerError as exc:
            raise ShardError.invalid(f"{self.label}: {exc}") from None
        if not np.isfinite(args.clip_coef) or args.clip_coef < 0:
            raise ShardError.invalid(f"{self.label}: clip_coef must be >= 0, got {args.clip_coef}")

    def _apply_step(self, args: pb.StepArgs, skip: bool = False) -> None:
        """Caller holds the lock and has checked ``args``. ``skip``: the gradient is discarded,
        params and optimizer state stay as they are, only the version moves on."""
        if self.version in self.capture_requests and self.version not in self.captures:
            self._capture()  # a snapshot wants the state before this step
        began = time.perf_counter()
        # kept for ranks that ask for this step's norm after a faster rank stepped
        self.applied_sum_squares = (self.version, self._sum_squares())
        self.applied_param_sum_squares = (self.version, self._param_sum_squares())
        self.applied_finite = (self.version, self._finite())
        if skip:
            self.skipped_steps += 1
        else:
            self.optimizer.update_hyper(dict(args.hyper))
            if args.clip_coef and args.clip_coef != 1.0:
                self.grad *= self.dtype.type(args.clip_coef)
            if self.slice_numel:
                self.optimizer.step(self.master, self.grad)
        self.version += 1
        self.pending = None
        self.last_step_seconds = time.perf_counter() - began
        self.last_step_unix = time.time()
        if self.replicator is not None:
            self.replicator.on_version(self)
