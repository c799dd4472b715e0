"""The safety net under ``close()``: servers and clients a process left open are closed before
the interpreter tears down.

Every ``ShardServer`` and ``ShardClient`` closes explicitly (``stop()``, ``close()``, ``with``);
that is the fix. This is what still happens when a program forgets, or dies on an exception
before its ``finally``: gRPC objects left to the interpreter's exit hang it. At exit Python
first marks every thread pool shut (``concurrent.futures``' own exit hook), so a running gRPC
server's serving thread dies on the next call that comes in ("cannot schedule new futures
after shutdown"), and the server never shuts down; the final garbage collection then drains
its completion queue for ever (the main thread in ``epoll_wait`` under ``gc_collect_main``, no
Python frames). So the hook closing what is open runs before that pool hook: ``threading``'s
exit hooks run before the threads are joined and before ``atexit``'s, last registered first,
and this module registers after ``concurrent.futures.thread`` (imported above it) did.

A closed client could hang the exit too. A gRPC call object left for the interpreter's last
garbage collection takes its lock there (grpc's ``_Rendezvous.__del__``); by then the daemon
threads are gone, and if one died holding that lock (a thread that read or served the call),
the main thread waits for it for ever (seen: the main thread in that ``__del__``, no other
thread but OpenBLAS's, once in about 80 exits of ranks on a loaded machine, each of which
had closed its client). So a call's last reference must go while every thread runs: a
stream's close drops it (``let_go``), its reader cuts the cycle a call that raised itself is
in (``unlink``), and the exit hook collects whatever cycle is left before the interpreter
tears down.

A process forked from one that holds servers or clients (a DataLoader's workers, a
``multiprocessing`` pool) inherits this registry but none of the threads behind those objects:
a gRPC lock one of them held at the fork stays taken in the child for ever. The child's exit
ran the hook all the same (multiprocessing's children run ``threading``'s exit hooks), and
closing the parent's client there hung every such worker (a DataLoader waits 5 s for its
workers, then kills them: 5 s an epoch) and could say, in the parent's name, that its rank had
ended. So a forked child starts with an empty registry (``_forget_inherited``): what its
parent made is the parent's to close; what the child makes, it closes itself (gRPC does not
support a client made in a forked child, which may abort in gRPC's own code: docs/launch.md).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import gc
import itertools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "bounded",
    "close_at_exit",
    "forget",
    "close_all",
    "ending_normally",
    "exiting",
    "let_go",
    "step_s",
    "uncaught",
    "unlink",
    "STEP_S",
]

STEP_S = 1.0
"""How long one step of a close waits (the servers' replies to a release, a thread's end, a
channel's close), so that a close always ends. Normally each takes milliseconds. But a
KeyboardInterrupt that lands inside gRPC's channel code (Python runs the handler wherever the
interrupted thread is, even between a lock's acquisition and the ``with`` that releases it)
can leave the channel's lock taken or a call that no thread will ever complete: a rank of
``paramshard launch`` interrupted mid-call then waited for ever in its close. Past the bound
the step is left unfinished (a daemon thread, a reply never read) and the process exits."""

log = logging.getLogger("paramshard")

_lock = threading.Lock()
_open: dict[int, tuple[weakref.ref, Callable[[Any], None]]] = {}
_order = itertools.count()
_ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_used = False  # whether this process made a server or a client (its exit collects cycles)
_ending = False  # the exit hook runs, and no exception went uncaught (``ending_normally``)
_uncaught: BaseException | None = None  # at the exit hook: the exception that went uncaught


def close_at_exit(obj: Any, close: Callable[[Any], None]) -> None:
    """``close(obj)`` runs at the interpreter's exit unless ``forget(obj)`` came first (its
    own close did). Holds ``obj`` weakly; the latest registered is closed first (clients,
    made after the servers they call, before those servers)."""
    global _used
    with _lock:
        _used = True
        key = next(_order)
        _ids[obj] = key
        _open[key] = (weakref.ref(obj), close)


WEDGED_STEP_S = 0.1
"""How long a step waits while one left past its bound still runs: a lock left taken in a
channel holds every later step on it, and those add up (a session and a lease stream a server,
their threads, the channel: 5 s a server at ``STEP_S``)."""
_late: set[threading.Thread] = set()  # steps left past their bound (those still running count)
_late_lock = threading.Lock()


def step_s() -> float:
    """How long the next step of a close may wait: ``STEP_S``, or ``WEDGED_STEP_S`` while a
    step of this process left past its bound has not ended. One that was only slow (a loaded
    machine: a cancel waiting seconds for the interpreter's lock) ends later, and the steps
    after it get ``STEP_S`` again; one that waits on a lock left taken never ends."""
    with _late_lock:
        _late.difference_update([t for t in _late if not t.is_alive()])
        return WEDGED_STEP_S if _late else STEP_S


def bounded(step: Callable[[], Any], name: str) -> bool:
    """Runs one step of a close (a call's ``cancel``, a channel's ``close``) on a daemon thread
    and waits for it ``step_s()`` at most: whether it ended. Past the bound it is left to that
    thread, and the close goes on."""
    thread = threading.Thread(target=step, name=name, daemon=True)
    thread.start()
    wait = step_s()
    thread.join(wait)
    if thread.is_alive():
        with _late_lock:
            _late.add(thread)
        log.warning("%s took over %g s (a gRPC lock left taken?); left to the exit", name, wait)
        return False
    return True


def let_go(holder: Any, name: str) -> Callable[[], None]:
    """A step of a close (for ``bounded``): cancels the gRPC call ``holder.<name>`` and takes
    it off ``holder``, so that its last reference goes on this step's thread or on the thread
    that reads the call, both running, and never at the interpreter's exit (see above)."""

    def step() -> None:
        call = getattr(holder, name)
        setattr(holder, name, None)
        if call is not None:
            call.cancel()

    return step


def unlink(error: BaseException) -> None:
    """Cuts the cycle of a gRPC call that raised itself (a stream's ``RpcError`` is its call):
    its traceback holds the frame that raised it, which holds the call. Call it in the
    ``except`` that caught it; nothing after reads the traceback."""
    error.__traceback__ = None


def forget(obj: Any) -> None:
    """``obj`` was closed: nothing to do for it at exit."""
    with _lock:
        key = _ids.pop(obj, None)
        if key is not None:
            _open.pop(key, None)


def exiting() -> bool:
    """Whether this process is at its exit (the exit hook runs), however it ends."""
    return _ending or _uncaught is not None


def ending_normally() -> bool:
    """Whether this process is at its exit (the exit hook runs) with no uncaught exception:
    its script ran to its end, or called ``sys.exit`` (whose code no exit hook can read, so a
    ``sys.exit(1)`` counts as normal here). A client's release then says the rank ends for
    good (client/leases.py)."""
    return _ending


def uncaught() -> BaseException | None:
    """At this process's exit (the exit hook runs): the exception that went uncaught and ends
    it, if any; None before the exit."""
    return _uncaught


def _interactive() -> bool:
    """Whether this process runs an interactive session (the REPL, ``python -i``, IPython, a
    notebook's kernel). An error shown at its prompt sets ``sys.last_value`` and the session
    goes on, so at its exit that names no error that ended it: before, a rank driven from one
    posted the run's final notice as it exited (client/leases.py) for an error long past."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython is not None and get_ipython() is not None


def _at_exit() -> None:
    global _ending, _uncaught
    # set for an uncaught exception, which ends a script but not an interactive session
    _uncaught = None if _interactive() else getattr(sys, "last_value", None)
    _ending = _uncaught is None
    close_all()


def close_all() -> None:
    """Closes everything still registered, latest first (the exit hook)."""
    with _lock:
        pending = [_open.pop(k) for k in sorted(_open, reverse=True)]
        _ids.clear()
    for ref, close in pending:
        obj = ref()
        if obj is None:
            continue
        try:
            close(obj)
        except Exception:  # noqa: BLE001 - at exit: close the others whatever this one did
            log.exception("closing %r at exit failed", obj)
        except BaseException as exc:  # a Ctrl-C or a signal handler's sys.exit in a close:
            # the rest still close (each step is bounded); before, a live client after it
            # was left unreleased, and its peers took its rank for lost
            log.warning("closing %r at exit: %s; the rest are closed", obj, type(exc).__name__)
    if _used:
        gc.collect()  # gRPC calls in cycles go now, while the threads that lock them run


def _forget_inherited() -> None:
    """In a forked child: nothing of the parent's is this process's to close at its exit, and
    the locks may have been held by a parent thread at the fork (new ones, then)."""
    global _lock, _late_lock, _used, _open, _ids
    _lock, _late_lock = threading.Lock(), threading.Lock()
    _open, _ids, _used = {}, weakref.WeakKeyDictionary(), False
    _late.clear()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forget_inherited)

# threading's exit hooks are internal to the standard library (concurrent.futures uses them);
# atexit, should they ever go, runs too late to save a running server but still closes clients.
getattr(threading, "_register_atexit", atexit.register)(_at_exit)
