"""``LocalCluster(processes=True)``: each rank a spawned Python process, talking gRPC over
127.0.0.1 to the cluster's servers in the parent process.

Spawn, not fork: fork would copy the parent's gRPC threads and server state into every child
(torch.multiprocessing and tests/torch_twin.py spawn for the same reason). So ``fn`` travels
pickled, by name: a module-level function of a module the child can import. Results and
exceptions come back pickled through a pipe, as plain bytes (a tensor is copied, not shared
through torch's shared-memory reductions, which need the sender alive until it is read).

The first rank to fail, or to exit without a result, ends the run: the other processes get
SIGTERM, then SIGKILL, and ``RankFailed`` names the rank; its exception's ``__cause__`` holds
the traceback printed in the child.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from paramshard.local_ranks import RankFailed, RankLeft, all_left, rank_config

__all__ = ["RemoteTraceback", "run_in_processes", "pickled_fn"]

STOP_S = 5.0  # a process gets this long after SIGTERM, then after SIGKILL


class RemoteTraceback(Exception):
    """The traceback a rank's process printed; the ``__cause__`` of the exception it raised."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


def pickled_fn(fn: Callable[..., Any]) -> bytes:
    """``fn`` pickled for the children, or a TypeError saying why it cannot be."""
    name = getattr(fn, "__qualname__", repr(fn))
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"LocalCluster(processes=True) cannot run {name!r}: it is defined in an interactive "
            "session (notebook or REPL), which spawned processes cannot import. Put it in a .py "
            "module and import it from there, or run ranks as threads (processes=False)."
        )
    try:
        return pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"LocalCluster(processes=True) sends fn to spawned processes, so it must be "
            f"picklable: a module-level function of an importable module (or a "
            f"functools.partial of one). {name!r} is not ({type(exc).__name__}: {exc}); "
            "lambdas and functions defined inside other functions are not. Move it to module "
            "level, or run ranks as threads (processes=False)."
        ) from exc


def run_in_processes(
    fn: Callable[[Any], Any],
    world_size: int,
    addresses: Sequence[str],
    run_id: str,
    fields: Mapping[str, Any],
    timeout_s: float,
    elastic: bool = False,
) -> list[Any]:
    """``fn(config)`` in one spawned process per rank; the results in rank order. ``elastic``:
    a rank that fails leaves (its result is ``RankLeft``), the others go on."""
    blob = pickled_fn(fn)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    waiting: dict[Any, int] = {}  # the read end of each rank's pipe -> the rank
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(writer, blob, rank, world_size, list(addresses), run_id, dict(fields)),
                name=f"paramshard-{run_id}-rank-{rank}",
            )
            waiting[reader] = rank
            proc.start()
            writer.close()  # the child holds the only write end: its exit means EOF here
            procs.append(proc)
        results: list[Any] = [None] * world_size
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready = mp.connection.wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(
                    f"ranks {sorted(waiting.values())} of {world_size} still running after "
                    f"{timeout_s} s (raise LocalCluster's run_timeout_s if the work is just long)"
                )
            for reader in ready:
                rank = waiting.pop(reader)
                ok, value = _receive(reader, procs[rank])
                reader.close()
                if not ok and not elastic:
                    raise RankFailed(rank, world_size, value) from value
                results[rank] = value if ok else RankLeft(rank, value)
        all_left(results, world_size)
        return results
    finally:
        for reader in waiting:
            reader.close()
        _stop(procs)


def _receive(reader: Any, proc: Any) -> tuple[bool, Any]:
    """(True, result) or (False, exception) from one rank's pipe."""
    try:
        data = reader.recv_bytes()
    except EOFError:
        proc.join(STOP_S)
        code = proc.exitcode
        killed = code is not None and code < 0
        how = f"was killed by signal {-code}" if killed else f"exited with code {code}"
        return False, RuntimeError(f"the process {how} without returning a result")
    try:
        reply = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - e.g. a class the child had and this process lacks
        return False, RuntimeError(f"its result could not be unpickled here: {exc!r}")
    if reply[0] == "ok":
        return True, reply[1]
    _, pickled, kind, message, text = reply
    try:
        error = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - an exception type that does not unpickle
        error = None
    if not isinstance(error, BaseException):
        error = RuntimeError(f"{kind}: {message}")
    error.__cause__ = RemoteTraceback(text)
    return False, error


def _stop(procs: Sequence[Any]) -> None:
    """Every process ended, bounded: SIGTERM, ``STOP_S``, SIGKILL, ``STOP_S``."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(STOP_S)
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_S)


# ----------------------------------------------------------------------------- in the child
def _rank_main(
    writer: Any,
    blob: bytes,
    rank: int,
    world_size: int,
    addresses: list[str],
    run_id: str,
    fields: dict[str, Any],
) -> None:
    try:
        fn = pickle.loads(blob)
        config = rank_config(addresses, rank, world_size, run_id, fields)
        try:
            reply: tuple = ("ok", fn(config))
        except BaseException as exc:
            if fields.get("elastic"):  # the others redo its step without it (docs/elastic.md)
                from paramshard.client.membership import leave

                leave(config.client, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            config.client.close()
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        reply = _error_reply(exc)
    try:
        data = pickle.dumps(reply)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
        data = pickle.dumps(
            _error_reply(TypeError(f"rank {rank}'s result cannot be pickled to return it: {exc}"))
        )
    writer.send_bytes(data)
    writer.close()


def _error_reply(exc: BaseException) -> tuple:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickled: bytes | None = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - sent as its type name and message instead
        pickled = None
    return ("error", pickled, type(exc).__name__, str(exc), text)
