"""``paramshard launch``: start shard servers and trainer ranks on this host, torchrun style.

    paramshard launch --nproc 2 train.py --lr 3e-4            # 2 local servers + 2 ranks
    paramshard launch --nproc 4 --servers h1:50051,h2:50051 train.py   # servers already running
    paramshard launch --nnodes 2 --node-rank 1 --nproc 4 --servers ... --run-id exp7 train.py

Without ``--servers`` it starts one ``paramshard serve --port 0`` per rank on 127.0.0.1 and reads
each one's "listening on ADDRESS" line (bounded by ``--start-timeout``), each with a snapshot
directory (``--snapshot-dir``, default under the run directory). With ``--servers`` it waits,
equally bounded, until every server's health check says SERVING and checks the token; a server
it cannot reach is named with the cause within seconds (paramshard/local_servers.py). While it
runs, a run file lets the job tools find the run (paramshard/run_files.py). Then it starts
``--nproc`` copies of ``python SCRIPT ARGS`` with the environment torchrun would give them plus
the cluster: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, PARAMSHARD_SERVERS,
PARAMSHARD_RUN (one id shared by all ranks, so two runs on the same servers never share
collective slots) and PARAMSHARD_TOKEN (from ``--token-file``). The MALLOC_* settings of
docs/design.md §7.5 go to the local servers only: a rank's allocator is left as torchrun leaves
it (docs/launch.md, "Memory"), unless the environment sets them. Like torchrun, it sets
OMP_NUM_THREADS when it is unset and there is more than one rank, to each rank's share of the
cores (``omp_threads``) where torchrun sets 1, and says so.

Every line a rank prints comes out as ``[rank R] LINE`` (stdout to stdout, stderr to stderr);
server lines go to stderr as ``[server I] LINE``. Ctrl-C and SIGTERM are forwarded to the ranks;
a second one kills them. When a rank exits non-zero the others get SIGTERM, ``--grace`` seconds,
then SIGKILL, and the launcher exits with that rank's code. Local servers are stopped last.
With ``--max-restarts K`` a failed ZeRO-1/2 or FSDP rank is started again instead, alone, and
resumes at the servers' step, and with ``--max-server-restarts K`` a local server that exits
is started again, empty, at its address (paramshard/restarts.py). ``--config FILE`` hands
every rank the same ShardingConfiguration file and ``--log-dir DIR`` keeps each rank's output
in files, in torchrun's layout (paramshard/launch_files.py).
"""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import signal
import sys
from typing import Any

from paramshard import elastic
from paramshard.client.run_id import run_id_from_env
from paramshard.commands import (
    EXIT_USAGE,
    CommandError,
    arg,
    cluster_spec,
    command,
    positive,
    positive_int,
    read_token,
)
from paramshard.finished_ranks import tell_ended, tell_stopped
from paramshard.launch_env import omp_threads, rank_env
from paramshard.launch_files import RankLogs, config_env
from paramshard.local_servers import (
    CONNECT_GRACE_S,
    SERVER_STOP_S,
    START_TIMEOUT_S,
    restart_local_server,
    start_local_servers,
    wait_serving,
)
from paramshard.local_tokens import LocalTokens
from paramshard.processes import Child, relay, say, spawn, stop, watch
from paramshard.protos.run_ids import run_id_problem
from paramshard.restarts import RankRestarts, ServerRestarts, supervise
from paramshard.run_files import announce_run, drop_unused_snapshot_dir, local_snapshot_dir

__all__ = ["launch", "read_token"]

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals the launcher passes on to its ranks before it stops them and its servers and
removes its run file, the four torchrun forwards. SIGHUP comes when the terminal it ran in
closes (an ssh session ended), SIGQUIT from Ctrl-\\; their default actions would end the
launcher at once and leave its servers and run file behind."""


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 0")
    return value


@command(
    arg("--nproc", type=positive_int, required=True, help="ranks to start on this host"),
    arg(
        "--servers",
        metavar="HOST:PORT,...",
        help="running shard servers to use (default: start --nproc local ones on 127.0.0.1)",
    ),
    arg(
        "--device",
        default="cpu",
        help="device of the local servers: cpu, cuda (server i on cuda:i) or cuda:K"
        " (default: %(default)s)",
    ),
    arg("--nnodes", type=positive_int, default=1, help="hosts running ranks (default: 1)"),
    arg(
        "--node-rank",
        type=non_negative_int,
        default=0,
        help="this host's index: its ranks are node-rank * nproc + 0..nproc-1 (default: 0)",
    ),
    arg(
        "--run-id",
        default=None,
        help="PARAMSHARD_RUN shared by all ranks; needed with --nnodes > 1"
        " (default: $PARAMSHARD_RUN, else torchrun's $TORCHELASTIC_RUN_ID, else a random id)",
    ),
    arg(
        "--config",
        metavar="FILE",
        default=None,
        help="a ShardingConfiguration file (.json, .toml, .yaml) every rank's"
        " ShardingConfiguration.from_env() starts from (PARAMSHARD_CONFIG); its keyword"
        " arguments override the file",
    ),
    arg(
        "--log-dir",
        metavar="DIR",
        default=None,
        help="also write each rank's output to DIR/RUN_ID/attempt_N/RANK/stdout.log and"
        " stderr.log (torchrun's layout; N counts that rank's restarts)",
    ),
    arg(
        "--redirects",
        action="store_true",
        help="with --log-dir: the ranks' output goes to the files only, not to this console"
        " (torchrun's --redirects 3 without --tee)",
    ),
    arg(
        "--token-file",
        default=None,
        help="the bearer token for the ranks (PARAMSHARD_TOKEN): a file holding the token, or"
        " a server token file ('ROLE TOKEN' lines) whose train token is used; without"
        " --servers, the local servers check that file's tokens (a bare token: as admin)",
    ),
    arg(
        "--start-timeout",
        type=positive,
        default=None,
        help="seconds the servers get to start or to answer SERVING (default: 60). With"
        " --servers, a server that cannot be reached (connection refused, DNS, TLS, token) is"
        " refused within 3 s unless this is given: then it is awaited that long (servers"
        " starting beside the trainers, as in docker/k8s)",
    ),
    arg(
        "--grace",
        type=positive,
        default=10.0,
        help="seconds the ranks get after SIGTERM/SIGINT, then SIGKILL (default: %(default)g)",
    ),
    arg(
        "--max-restarts",
        type=non_negative_int,
        default=0,
        help="restart a failed rank, alone, up to this many times in all: for ZeRO-1/2 and"
        " FSDP, whose state is on the servers (a DDP or 3D rank's failure still stops the job;"
        " default: %(default)s)",
    ),
    arg(
        "--max-server-restarts",
        type=non_negative_int,
        default=0,
        help="start a local server that exits again, empty, at its address, up to this many"
        " times in all; ranks in train_with_recovery restore its state from replicas or"
        " snapshots (default: %(default)s: a server's exit stops the job)",
    ),
    arg(
        "--snapshot-dir",
        metavar="DIR",
        default=None,
        help="where the local servers write snapshots (paramshard snapshot) and read them"
        " (restore); default: the run directory's RUN_ID/snapshots (docs/launch.md). With"
        " --servers, each server's own --snapshot-dir applies",
    ),
    arg(
        "--elastic",
        action="store_true",
        help="elastic data parallelism (ZeRO-1/2, FSDP; docs/elastic.md): ranks may leave and"
        " join between steps; a rank that fails for good leaves and the others train on"
        " (PARAMSHARD_ELASTIC=1); --nproc is then the most ranks",
    ),
    arg(
        "--min-nproc",
        type=positive_int,
        default=None,
        metavar="M",
        help="with --elastic: a step trains with at least M ranks; below that the ranks wait,"
        " bounded, then fail naming who is there (PARAMSHARD_MIN_NPROC; default: 1)",
    ),
    arg("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)"),
    arg("script", metavar="SCRIPT", help="the training script (or module with -m)"),
    arg("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments"),
)
def launch(args: argparse.Namespace) -> int:
    """Start shard servers and --nproc trainer ranks (torchrun style); stop them all at the end.

    Each rank runs 'python SCRIPT ARGS' with RANK, WORLD_SIZE, LOCAL_RANK, PARAMSHARD_SERVERS,
    PARAMSHARD_RUN set (and OMP_NUM_THREADS, to its share of the cores, when unset and
    --nproc > 1); its lines are printed as '[rank R] ...'.
    Without --servers, --nproc local servers are started on 127.0.0.1 and stopped at the end.
    Ctrl-C, SIGTERM, SIGHUP and SIGQUIT are forwarded to the ranks. If a rank fails, the
    others are stopped (SIGTERM, --grace seconds, SIGKILL) and the launcher exits with the
    failed rank's code; 0 when all ranks succeed. With --max-restarts K, a failed ZeRO-1/2 or
    FSDP rank is started again instead (K times in all) and resumes at the servers' step.
    With --max-server-restarts K, a local server that exits is started again, empty, at its
    address, and ranks in train_with_recovery restore its state.
    """
    if args.node_rank >= args.nnodes:
        raise CommandError(
            f"--node-rank {args.node_rank} must be < --nnodes {args.nnodes}", EXIT_USAGE
        )
    if args.nnodes > 1 and not args.servers:
        raise CommandError(
            "--nnodes > 1 needs --servers: every host must use the same ones", EXIT_USAGE
        )
    run_id = args.run_id or run_id_from_env() or ""
    if args.nnodes > 1 and not run_id:
        raise CommandError("--nnodes > 1 needs --run-id (the same on every host)", EXIT_USAGE)
    run_id = run_id or f"run-{secrets.token_hex(6)}"
    if (problem := run_id_problem(run_id)) is not None:  # every rank's client would refuse it
        raise CommandError(f"--run-id: {problem}", EXIT_USAGE)
    if not args.module and not os.path.isfile(args.script):
        raise CommandError(f"no such script: {args.script}", EXIT_USAGE)
    if args.servers and args.max_server_restarts:
        raise CommandError(
            "--max-server-restarts restarts the local servers; servers given with --servers"
            " are restarted by whatever runs them (docs/deployment.md)",
            EXIT_USAGE,
        )
    if args.servers and args.snapshot_dir:
        raise CommandError(
            "--snapshot-dir is for the local servers; with --servers, each server's own"
            " --snapshot-dir applies",
            EXIT_USAGE,
        )
    if args.servers:  # a bad address or TLS file is said before anything is printed or run
        cluster_spec(args.servers).close()
    token = read_token(args.token_file)
    start_timeout = args.start_timeout or START_TIMEOUT_S
    world_size = args.nnodes * args.nproc
    elastic.check(args, world_size)
    ranks_config = config_env(args.config)
    logs = RankLogs.create(args.log_dir, run_id)
    if args.redirects and logs is None:
        raise CommandError("--redirects needs --log-dir (where the output goes)", EXIT_USAGE)
    console_out, console_err = (None, None) if args.redirects else (sys.stdout, sys.stderr)

    base = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **ranks_config,
        **elastic.elastic_env(args),
    }
    if (threads := omp_threads(base, args.nproc)) is not None:
        base["OMP_NUM_THREADS"] = str(threads)
        say(f"OMP_NUM_THREADS={threads} for every rank (the cores shared among {args.nproc}"
            " ranks); set it in the environment to choose")  # fmt: skip
    restarts = RankRestarts.create(args.max_restarts)
    server_restarts = ServerRestarts(args.max_server_restarts)
    received: list[int] = []
    events: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe inside a signal handler
    supervising = False

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        if not supervising:  # still starting: unwind, and the finally clause stops everything
            raise _Interrupted(signum)
        events.put(("signal", None, signum))  # supervise forwards it; stop() sees `received`

    previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    servers: list[Child] = []
    ranks: list[Child] = []
    announced = None
    local_tokens = LocalTokens()
    try:
        snapshot_dir = None
        if args.servers:
            addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
            patience = args.start_timeout or CONNECT_GRACE_S  # asked for: servers still starting
            wait_serving(addresses, token, start_timeout, unreachable_s=patience)
        else:
            if os.environ.get("PARAMSHARD_SERVERS", "").strip():  # the job tools read it
                say("PARAMSHARD_SERVERS is set, but without --servers launch starts servers"
                    " of its own; the ranks use those")  # fmt: skip
            try:
                snapshot_dir = local_snapshot_dir(args.snapshot_dir, run_id)
            except OSError as exc:
                raise CommandError(
                    f"--snapshot-dir {args.snapshot_dir}: {exc}", EXIT_USAGE
                ) from None
            serve_args = ["--snapshot-dir", snapshot_dir] if snapshot_dir else []
            serve_args += local_tokens.serve_args(args.token_file)  # they check the tokens
            servers, addresses = start_local_servers(
                args.nproc,
                args.device,
                base,  # the servers get MALLOC_* there; the ranks do not
                start_timeout,
                serve_args=serve_args,
            )
            server_restarts.start_again = lambda i: restart_local_server(
                i, addresses[i], args.device, base, start_timeout, serve_args
            )
            say(f"started {len(servers)} shard servers: {', '.join(addresses)}")
        announced = announce_run(run_id, addresses, args.token_file, args.config, snapshot_dir)
        if announced.path is not None:
            say(f"run {run_id}: the job tools (paramshard status, ...) find it: {announced.path}")
        if snapshot_dir:
            say(f"snapshots go to {snapshot_dir}")

        supervising = True
        python = [sys.executable, "-m"] if args.module else [sys.executable]

        def start_rank(rank: int) -> Child:
            env = rank_env(
                base,
                rank=rank,
                local_rank=rank - args.node_rank * args.nproc,
                nproc=args.nproc,
                node_rank=args.node_rank,
                world_size=world_size,
                servers=addresses,
                run_id=run_id,
                token=token,
            )
            env.update(restarts.env(rank))
            out, err = logs.open(rank, restarts.attempt(rank)) if logs else (None, None)
            child = spawn(f"rank {rank}", [*python, args.script, *args.script_args], env)
            child.rank = rank
            relay(child, child.proc.stdout, console_out, None, out)
            relay(child, child.proc.stderr, console_err, None, err)
            watch(child, events)
            return child

        if logs:
            also = "only" if args.redirects else "also"
            say(f"rank output {also} goes to {logs.root}/attempt_N/RANK/stdout.log, stderr.log")
        for local_rank in range(args.nproc):
            ranks.append(start_rank(args.node_rank * args.nproc + local_rank))
        for server in servers:
            watch(server, events)
        departures = None
        if args.elastic:  # one host: this launcher runs every rank, and sees the job's size
            departures = elastic.Departures((args.min_nproc or 1) if args.nnodes == 1 else 0)

        def finished(rank: int) -> None:
            """A rank exited 0: it ended for good, which its own release may not have said."""
            failed = tell_ended(addresses, token, run_id, rank, world_size)
            if failed:
                say(
                    f"rank {rank} exited 0; telling the servers it ended failed"
                    f" ({'; '.join(failed)}): a wait for it lasts until its deadline"
                )

        def given_up(rank: int, why: str) -> None:
            """A rank that failed and is not restarted: its peers on other hosts stop now, not
            at their deadline or at its restart's wait."""
            if failed := tell_stopped(addresses, token, run_id, rank, world_size, why):
                say(f"telling the servers that rank {rank} stops failed ({'; '.join(failed)})")

        return supervise(
            ranks,
            servers,
            events,
            received,
            args.grace,
            restarts,
            start_rank,
            departures,
            server_restarts,
            finished,
            given_up,
        )
    except _Interrupted as exc:
        say(f"{signal.Signals(exc.signum).name} while starting: stopping")
        return 128 + exc.signum
    finally:
        supervising = True  # from here on a signal only hurries the stops below
        stop(ranks, signal.SIGTERM, args.grace, received)
        stop(servers, signal.SIGTERM, SERVER_STOP_S, received)
        restarts.close()
        local_tokens.close()
        if announced is not None:
            announced.remove()  # the job tools no longer find this run
        drop_unused_snapshot_dir(run_id)  # also when it stopped before announcing the run
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Interrupted(Exception):
    """A signal of ``FORWARDED`` before the ranks run (the launcher exits with 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
