"""Every handler of the Shard service runs inside ``guard``: a request that did not parse is
INVALID_ARGUMENT with the parser's complaint, a ``ShardError`` becomes its status with the
method's name in front, and anything else is a bug, logged and answered INTERNAL while the
server keeps serving (a server never crashes on a request). While it runs, the call is known
as its caller's (``runtime.callers``: whether the caller went away, whose share it counts
against), and numpy's warnings about non-finite values are quiet."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from paramshard.server.rpc.auth import caller_of
from paramshard.server.rpc.parsers import Malformed
from paramshard.server.runtime import backend, callers
from paramshard.server.runtime.errors import ShardError, clip, named

__all__ = ["guard"]

log = logging.getLogger("paramshard.server")


def guard(name: str, fn: Callable[[Any, grpc.ServicerContext], Any]) -> Callable:
    """Handler ``fn`` of method ``name``, guarded (above)."""

    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            words = "" if request.oversize else f"request does not parse as a {name} message: "
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip(f"{name}: {words}{request.error}"))
        try:
            with backend.nonfinite_quietly(), callers.serving(context, caller_of(context)):
                return fn(request, context)
        except ShardError as exc:
            context.abort(exc.code, clip(named(name, exc.message)))
        except Exception as exc:  # a bug, not bad input: report it, keep serving
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, clip(f"{name}: {type(exc).__name__}: {exc}"))

    return handle
