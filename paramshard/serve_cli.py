"""``paramshard serve``: one shard server until SIGINT or SIGTERM (``paramshard health``, which
asks whether one is serving: paramshard/health_cli.py)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
from pathlib import Path

from paramshard.commands import (
    EXIT_USAGE,
    CommandError,
    arg,
    command,
    int_in,
    non_negative,
    port_number,
    positive,
    positive_int,
    server_tokens,
    warn,
)
from paramshard.protos.placement import MAX_SERVERS
from paramshard.serve_setup import (
    check_port_free,
    is_loopback,
    join_host_port,
    raise_open_files_limit,
    reexec_with_malloc_env,
    restore_at_start,
)
from paramshard.server.rpc.call_limits import CallLimits
from paramshard.stop_signals import StopSignals

_THREADS = CallLimits()  # the flags' defaults: CallLimits' own (a light import, no gRPC)

EXIT_WATCHDOG_S = 10.0
"""Once stopped, the process must be gone within this long: every thread of the server has
been told to end. Past it, faulthandler prints every thread's stack and exits 1 (it needs no
GIL, so an interpreter stuck in its own teardown ends too): a hang shows where it is."""


# ------------------------------------------------------------------------------------- serve
@command(
    arg(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s; any non-loopback address needs TLS,"
        " a --token-file, or --insecure)",
    ),
    arg(
        "--port",
        type=port_number,
        default=50051,
        help="port (default: %(default)s; 0 picks a free one, printed when serving)",
    ),
    arg("--device", default="cpu", help="where slices live: cpu or cuda:N (default: %(default)s)"),
    arg(
        "--max-receive-mb",
        type=positive,
        default=256.0,
        help="largest request accepted, MiB (default: %(default)g)",
    ),
    arg(
        "--max-job-gb",
        type=non_negative,
        default=0.0,
        help="memory one job may hold on this server, GiB (default: 0 = unlimited)",
    ),
    arg(
        "--max-slot-mb",
        type=non_negative,
        default=0.0,
        help="memory all reduction slots and mailboxes may hold together, MiB: keeps room for"
        " buffers when callers fill mailboxes nobody reads; the slots one token opened hold at"
        " most half of it (default: 0 = only --max-memory, and half of that a token)",
    ),
    arg(
        "--max-memory",
        metavar="SIZE",
        help="memory this server may hold for its callers: buffers, staged gradients, slots,"
        " mailboxes, replicas; bytes with an optional unit (8GiB, 512MiB, 2GB) or a percentage"
        " (default: 90%% of this host's memory, or of the device's on a GPU; 0 = unlimited)",
    ),
    arg(
        "--pending-ttl",
        type=positive,
        default=600.0,
        metavar="SECONDS",
        help="reduction slots and mailboxes with no contribution or read for this long are"
        " dropped, their waiting readers fail with ABORTED (default: %(default)g)",
    ),
    arg(
        "--max-wait-s",
        type=positive,
        default=120.0,
        metavar="SECONDS",
        help="longest any call waits (a pull for a future version, a slot read, a step"
        " waiting for gradients) before DEADLINE_EXCEEDED, and a call that came while this"
        " server's Python threads stalled waits to be taken up (at least 30 s)"
        " (default: %(default)g)",
    ),
    arg(
        "--workers",
        type=positive_int,
        default=_THREADS.workers,
        help="handler threads; every waiting call holds one, and a quarter of those waiting"
        " calls may take can hold gradient pushes waiting for their turn in the rank order"
        " (default: %(default)s)",
    ),
    arg(
        "--reserved-workers",
        type=positive_int,
        help="handler threads waiting calls never take: pushes, steps and Status always find"
        " one; a waiting call beyond waits in line if it came in a session, else gets"
        " RESOURCE_EXHAUSTED (default: a quarter of --workers, at most 16)",
    ),
    arg(
        "--max-waiting-read",
        type=positive_int,
        default=_THREADS.max_waiting_read,
        help="waiting calls (pulls, slot reads) of read tokens at once; one more gets"
        " RESOURCE_EXHAUSTED (default: %(default)s)",
    ),
    arg(
        "--max-streams",
        type=int_in(0),
        default=_THREADS.max_streams,
        help="open reflection / health Watch streams at once, on threads of their own; one"
        " more gets RESOURCE_EXHAUSTED (default: %(default)s)",
    ),
    arg(
        "--max-sessions",
        type=int_in(0),
        default=_THREADS.max_sessions,
        help="open client streams at once, on threads of their own: sessions (one per client,"
        " carrying its data-plane calls; of read tokens at most a quarter) and trainers' lease"
        " streams (one per rank); a client past it calls one by one, a rank's lease then lives"
        " on renewals alone; 0: none (default: %(default)s)",
    ),
    arg(
        "--max-pending-calls",
        type=positive_int,
        default=_THREADS.max_pending_calls,
        help="calls gRPC keeps before a thread takes them up (a burst of many ranks' calls,"
        " a stall of the server); one more ends CANCELLED unrun. Size it at 8 per rank using"
        " the server, or more (default: %(default)s)",
    ),
    arg(
        "--grace",
        type=non_negative,
        default=5.0,
        help="seconds running calls get to finish on SIGINT/SIGTERM (default: %(default)g)",
    ),
    arg("--tls-cert", metavar="FILE", help="PEM certificate (chain) of this server: serve TLS"),
    arg("--tls-key", metavar="FILE", help="PEM private key of --tls-cert"),
    arg(
        "--tls-ca",
        metavar="FILE",
        help="PEM CA certificate(s): require client certificates signed by it (mutual TLS)",
    ),
    arg(
        "--token-file",
        metavar="FILE",
        help="bearer tokens, one 'ROLE TOKEN [jobs=P,...] [runs=P,...]' per line (roles read <"
        " train < admin, and peer: the servers' own token for replicas, the same line in every"
        " server's file); every call then needs 'authorization: Bearer TOKEN' (clients:"
        " PARAMSHARD_TOKEN). jobs= and runs= scope a token to the jobs and runs (PARAMSHARD_RUN)"
        " it may touch: each P an exact name or a prefix ending in '*', e.g. 'train TOKEN"
        " jobs=team-a/*'; one of them alone sets both; peer tokens take none; a line without"
        " them may touch every job (docs/security.md)",
    ),
    arg(
        "--peer-ca",
        metavar="FILE",
        help="PEM CA certificate(s) the other servers' certificates are checked against when"
        " this server sends them replicas over TLS (default: --tls-ca, else the system's roots)",
    ),
    arg(
        "--peer-identity",
        action="append",
        default=[],
        metavar="NAME",
        help="with --tls-ca (mutual TLS): a client certificate whose subject CN or a DNS"
        " alternative name is NAME has the peer role (replicas) without a token; the servers"
        " present their own --tls-cert to each other, so give them that name (repeatable)",
    ),
    arg(
        "--metrics-port",
        type=port_number,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port); with"
        " --token-file only to a bearer token of role read or above, a scoped one seeing its"
        " jobs' series",
    ),
    arg(
        "--metrics-host",
        metavar="HOST",
        help="address of the metrics endpoint (default: --host)",
    ),
    arg("--snapshot-dir", metavar="DIR", help="where snapshots are written and read"),
    arg(
        "--restore",
        metavar="TAG",
        help="at start, load this server's part of snapshot TAG ('latest': the newest complete"
        " one) of every job in --snapshot-dir",
    ),
    arg(
        "--index",
        type=int_in(0, MAX_SERVERS - 1),
        help="this server's index in the cluster (with --restore)",
    ),
    arg(
        "--num-servers",
        type=int_in(1, MAX_SERVERS),
        help="servers in the cluster (with --restore; default: as in the snapshot)",
    ),
    arg(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS or a token: anyone who reaches the port"
        " can read or overwrite the model",
    ),
)
def serve(args: argparse.Namespace) -> int:
    """Run one shard server until SIGINT or SIGTERM.

    Prints 'paramshard serve: listening on HOST:PORT (device D, pid N)' once it accepts calls
    (then 'paramshard serve: metrics at URL' with --metrics-port).
    The first SIGINT/SIGTERM stops it gracefully (running calls get --grace seconds, then
    whatever still waits ends, and the process exits); a second one ends the process at once.
    The MALLOC_* settings of docs/design.md §7.5 are applied by re-executing the interpreter when
    they are missing from the environment.

    Security (docs/design.md §6.1): --tls-cert/--tls-key serve TLS, --tls-ca adds mutual TLS, and
    --token-file requires a bearer token whose role covers the call: read (Status, PullParams),
    train (pushes, steps, collectives), admin (DropJob, snapshots, restore, replication), peer
    (replicas from the other servers; this server sends its own with it, over TLS when it
    serves TLS). A token line may add jobs=P,... and runs=P,... (exact names, or prefixes
    ending in '*'): that token's calls naming any other job or run get PERMISSION_DENIED before
    their request is parsed, and its Status shows only its jobs. Health checks and reflection
    stay open (at most --max-streams streams at once).
    Without TLS or tokens only loopback addresses are allowed, unless --insecure.

    Bounds (docs/design.md §6.2): --max-memory for everything kept for callers, --pending-ttl for
    abandoned slots and mailboxes, --max-wait-s for any wait; waiting calls never take the
    last --reserved-workers threads, and read tokens' at most --max-waiting-read of them.
    """
    reexec_with_malloc_env(args.argv)
    raise_open_files_limit()
    host = args.host.strip("[]")

    from paramshard.server import ShardServer
    from paramshard.server.config import (
        BoundsConfig,
        SecurityConfig,
        ServerConfig,
        as_flags,
    )
    from paramshard.server.rpc.admission import default_reserved
    from paramshard.server.runtime import backend

    tokens = server_tokens(args.token_file) if args.token_file is not None else {}
    pem = {  # read by SecurityConfig, after it checked which go together
        name: Path(path)
        for name, path in (
            ("tls_cert", args.tls_cert),
            ("tls_key", args.tls_key),
            ("tls_ca", args.tls_ca),
            ("peer_tls_ca", args.peer_ca),
        )
        if path is not None
    }
    try:
        config = ServerConfig(
            host=host,
            port=args.port,
            device=args.device,
            snapshot_dir=args.snapshot_dir,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            security=SecurityConfig(
                tokens=tokens,
                insecure=args.insecure,
                peer_identities=tuple(args.peer_identity),
                **pem,
            ),
            bounds=BoundsConfig(
                max_memory=args.max_memory,
                max_job_bytes=int(args.max_job_gb * 2**30),
                max_slot_bytes=int(args.max_slot_mb * 2**20),
                max_receive_bytes=int(args.max_receive_mb * 2**20),
                max_wait_s=args.max_wait_s,
                pending_ttl_s=args.pending_ttl,
            ),
            threads=CallLimits(
                workers=args.workers,
                reserved=args.reserved_workers or default_reserved(args.workers),
                max_waiting_read=args.max_waiting_read,
                max_streams=args.max_streams,
                max_sessions=args.max_sessions,
                max_pending_calls=args.max_pending_calls,
            ),
        )
    except ValueError as exc:
        raise CommandError(as_flags(str(exc)), EXIT_USAGE) from None

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    listen = join_host_port(host or "0.0.0.0", args.port)
    check_port_free(host or "0.0.0.0", args.port)
    try:
        server = ShardServer(config=config)
    except backend.BackendError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    except ImportError as exc:  # --metrics-port without prometheus_client
        raise CommandError(str(exc), EXIT_USAGE) from None
    except ValueError as exc:  # PEM that is not PEM, and the like
        raise CommandError(as_flags(str(exc)), EXIT_USAGE) from None
    except (OSError, RuntimeError) as exc:  # grpcio raises RuntimeError when the port is taken
        why = f"cannot listen on {listen}: {exc}"
        if args.tls_cert:  # gRPC says only that it failed to bind; its log says why
            why += (
                " (the port was free a moment before: gRPC fails the same way when --tls-key"
                " is not the key of --tls-cert, or either does not parse)"
            )
        raise CommandError(why) from None

    stops = StopSignals()
    stops.install()
    try:
        try:
            server.start()
        except OSError as exc:  # the metrics port is taken
            raise CommandError(str(exc)) from None
        address = join_host_port(host or "0.0.0.0", server.port)
        if server.exposed:
            warn(
                f"listening on {address} with no TLS and no token (--insecure): anyone who"
                " can reach this port can read or overwrite the model"
            )
        elif tokens and not server.tls and not is_loopback(host):
            warn(
                f"listening on {address} with tokens but no TLS: tokens and the model travel"
                " in clear text (add --tls-cert/--tls-key)"
            )
        if args.restore:
            restore_at_start(server, args)
        print(
            f"paramshard serve: listening on {address} (device {backend.device},"
            f" pid {os.getpid()})",
            flush=True,
        )
        if server.metrics_port is not None:
            metrics_host = host if args.metrics_host is None else args.metrics_host.strip("[]")
            where = join_host_port(metrics_host or "0.0.0.0", server.metrics_port)
            print(f"paramshard serve: metrics at http://{where}/metrics", flush=True)
        stops.wait()
        why = signal.Signals(stops.received[0]).name
        print(f"paramshard serve: {why}: stopping (grace {args.grace:g} s)", flush=True)
        server.stop(args.grace)
        print("paramshard serve: stopped", flush=True)
        faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True)
    except BaseException:
        server.stop(0)
        raise
    finally:
        stops.restore()
    return 0
