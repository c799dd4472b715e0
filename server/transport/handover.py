"""The abstract Unix socket through which a server hands its shared segments' descriptors to
the callers holding their tickets (server/transport/shm.py).

Every process of the host can see the socket (``/proc/net/unix``) and connect to it without a
token, so a connection must cost the others nothing: one thread serves them all at once
(``selectors``), never waiting on any of them. A connection that has not sent its ticket
within ``HANDOVER_S`` is closed, a peer (its process, by ``SO_PEERCRED``) holds at most
``PER_PEER`` connections open (a new one closes its oldest), and past ``MAX_CONNECTIONS`` in
all the oldest is closed. A client sends its ticket as soon as it connects, so idle
connections, however many, delay nobody's claim: they only push out each other.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from paramshard.protos.shm import TICKET_BYTES, handover_name

__all__ = ["Handover", "HANDOVER_S", "PER_PEER", "MAX_CONNECTIONS"]

log = logging.getLogger(__name__)

HANDOVER_S = 2.0
"""A connection that has not sent its whole ticket by then is closed (a client sends it at once)."""
PER_PEER = 4
"""Connections of one process open at once (a client opens one at a time)."""
MAX_CONNECTIONS = 64
"""Connections open at once, over all processes."""
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class _Pending:
    peer: int  # the connecting process's pid (0 where the kernel does not say)
    deadline: float
    ticket: bytearray = field(default_factory=bytearray)


class Handover:
    """A listening abstract socket and the thread that serves it. ``claim(ticket)`` returns a
    descriptor to send for a ticket (the caller's to close: we close it once sent), or None
    for a ticket it does not know."""

    def __init__(self, claim: Callable[[bytes], int | None]) -> None:
        self._claim = claim
        self.name = handover_name()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind("\0" + self.name)  # abstract: gone with the process, no file
            self._listener.listen(64)
            self._listener.setblocking(False)
            self._wake, self._waker = socket.socketpair()
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="shm-handover", daemon=True)
        self._thread.start()

    def close(self) -> None:
        try:
            self._waker.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._waker.close()

    # -- the serving thread -----------------------------------------------------------------
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake, selectors.EVENT_READ)
        pending: dict[socket.socket, _Pending] = {}  # accepted first, first (deadline order)
        try:
            while True:
                timeout = None
                if pending:
                    first = next(iter(pending.values()))
                    timeout = max(0.0, first.deadline - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.fileobj is self._wake:
                        return
                    if key.fileobj is self._listener:
                        self._accept(sel, pending)
                    elif key.fileobj in pending:
                        self._read(sel, pending, key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, p in pending.items() if p.deadline <= now]:
                    self._drop(sel, pending, conn)
        except Exception:  # a bug: the segments stay usable in-band, the server goes on
            log.exception("the shared-memory handover stopped")
        finally:
            for conn in list(pending):
                self._drop(sel, pending, conn)
            sel.close()
            self._listener.close()
            self._wake.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]) -> None:
        for _ in range(MAX_CONNECTIONS):  # then the others' tickets get their turn
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: those open go first
                log.debug("shared-memory handover: accept failed: %s", exc)
                time.sleep(0.05)  # the listener stays readable: no busy loop meanwhile
                return
            conn.setblocking(False)
            peer = _peer_pid(conn)
            mine = [c for c, p in pending.items() if p.peer == peer]
            if len(mine) >= PER_PEER:
                self._drop(sel, pending, mine[0])
            if len(pending) >= MAX_CONNECTIONS:
                self._drop(sel, pending, next(iter(pending)))
            pending[conn] = _Pending(peer, time.monotonic() + HANDOVER_S)
            sel.register(conn, selectors.EVENT_READ)
            self._read(sel, pending, conn)  # the ticket is often there already

    def _read(
        self,
        sel: selectors.BaseSelector,
        pending: dict[socket.socket, _Pending],
        conn: socket.socket,
    ) -> None:
        state = pending[conn]
        try:
            part = conn.recv(TICKET_BYTES - len(state.ticket))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            part = b""
        if not part:
            self._drop(sel, pending, conn)
            return
        state.ticket += part
        if len(state.ticket) < TICKET_BYTES:
            return
        try:
            fd = self._claim(bytes(state.ticket))
        except OSError as exc:  # out of descriptors (EMFILE): this claim fails, not the thread
            log.warning("shared segment handover refused: %s", exc)
            fd = None
        try:
            if fd is None:
                conn.send(b"no")
            else:
                socket.send_fds(conn, [b"ok"], [fd])  # an empty buffer: never blocks
        except OSError as exc:
            log.debug("shared segment handover failed: %s", exc)
        finally:
            if fd is not None:
                os.close(fd)
            self._drop(sel, pending, conn)

    def _drop(
        self,
        sel: selectors.BaseSelector,
        pending: dict[socket.socket, _Pending],
        conn: socket.socket,
    ) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def _peer_pid(conn: socket.socket) -> int:
    """The pid of the process that connected (``SO_PEERCRED``), 0 where there is none."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return 0
    try:
        pid, _, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    except OSError:
        return 0
    return pid
