"""Collectives and flat-buffer transport through the shard servers, against torch gloo and raw TCP.

    python -m benchmarks.collectives [--quick] [--sizes 1,16,64] [--world-sizes 2,4]

Measured in one run, on 127.0.0.1 (docs/design.md §7.5 has the transport facts these compare to):

- **collectives**: all_reduce, all_gather, reduce_scatter for each world size W and tensor size S,
  through the variants of ``_collective_runs.VARIANTS``: ours with each rank process hosting its own
  ShardServer (``ours``); ours with the W servers as separate processes, payloads through shared
  segments (``ours_sep``) and in-band (``ours_sep_inband``, PARAMSHARD_SHM=0); torch gloo
  (``gloo``); and, as root, the cross-host shape: one network namespace per rank on a veth bridge,
  each with its rank and its server, payloads in-band (``ours_ns``), and each rank reaching its own
  server through shared memory as a host is deployed (``ours_ns_shm``), against gloo in the same
  namespaces (``gloo_ns``). Every rank is its own process, started with subprocess so that
  ``server.MALLOC_ENV`` is in its environment before the interpreter starts; gloo ranks get the same
  settings (``--gloo-env default`` runs them in the plain environment, as torch users usually do).
  The namespaces' links run at each rate of ``--rates`` (10, 25 Gbit/s and unlimited by default:
  ``Namespaces.shape``, a tc token bucket on both ends of each host's cable); those rows are in
  ``netns.results`` with their ``rate_gbit``, and what one raw TCP stream moved across the links
  before and after each rate's cells is in ``netns.shaping[].raw_tcp_gbit``
  (benchmarks/cost_model.py predicts with it). What the lab's queues dropped and its hosts' TCP
  sent again during each variant's run is in that run's ``phases[].links``. Each rank of ours
  first times one gRPC unary call (``Status``) to the next rank's server: the median of 200 is
  in ``phases[].status_rtt_ms``, the floor under any call of ours (a 4-byte op is one or two).
- **training** (``--parts training``): a training step across the namespaces at each rate,
  ours (DDP, FSDP) against torch's (DDP, FSDP2) on gloo in the same namespaces
  (benchmarks/_ns_training.py), rows in ``netns.training``. Each repetition:
  barrier, then time the op on every rank; a repetition's time is the max over ranks; we quote
  the median over the repetitions of all rounds, after warm-up. CPU seconds per op and rank are
  reported too: on 2 cores both sides are CPU-bound, and CPU is steadier than wall time.
- **tcp**: one raw TCP stream on loopback moving S=64 MiB from a sender process to a receiver
  process (recv_into a preallocated buffer, 1-byte ack): the ceiling for one connection.
- **push_pull**: one client process pushing a 64 MiB flat gradient buffer to W server processes
  (``push_grads`` with SGD lr=0 step arguments, so each push also completes a step) and pulling
  the parameters back (``pull_params``), through shared segments (``ours``) and in-band
  (``ours_inband``, a client with ``shared_memory=False``), interleaved.
- **codec**: the same push/pull with servers started with ``fast_codec=False`` and a client that
  uses the generated protobuf classes (``ShardStub``, ``PushGradRequest(data=arr.tobytes())``)
  with the same chunking and calls in flight, against ours.

Size convention (as nccl-tests'): S is the all_reduce tensor, the all_gather
OUTPUT (each rank contributes S/W) and the reduce_scatter INPUT (each rank keeps S/W).
GB/s = S bytes / median seconds / 1e9 (algorithm bandwidth, payload bytes only).

Options: ``--parts transport,collectives``, ``--rounds N``, ``--reps N``, ``--no-separate``,
``--no-inband``, ``--no-netns``, ``--no-ns-shm``, ``--no-gloo``, ``--wait-quiet SECONDS``
(wait for other load to stop before each phase).

Prints one JSON document to stdout; progress goes to stderr. Every child process is started by
this script, has a lifetime watchdog and exits when this process dies; all are stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from typing import Any

from benchmarks._collective_ranks import (
    MiB,
    gloo_main,
    rank_main,
    server_main,
)
from benchmarks._collective_runs import (
    section_collectives,
)
from benchmarks._cpu import wait_quiet
from benchmarks._processes import ChildError, child_guard, install_cleanup, run_child, stop_all
from benchmarks._transport import (
    log,
    section_transport,
)
from benchmarks._transport_ranks import pushpull_main, tcp_recv_main, tcp_send_main
from paramshard.client.chunk_size import default_chunk_bytes  # the cells use the defaults
from paramshard.client.rpc import MAX_IN_FLIGHT


# =============================================================================== parent: phases
# ======================================================================================== main
def parse_list(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.replace(" ", "").split(",") if x]


def parse_size(text: str) -> float:
    """A size in MiB; with a B suffix, in bytes ("4B": one float32, the latency cell)."""
    return float(text[:-1]) / MiB if text.upper().endswith("B") else float(text)


def machine() -> dict[str, Any]:
    import grpc
    import numpy

    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "affinity_cores": (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        ),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu"] = names[0] if names else None
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:  # noqa: BLE001
        info["torch"] = None
    return info


def bench_main(a: argparse.Namespace) -> int:
    from paramshard.server import MALLOC_ENV

    t_start = time.monotonic()
    doc: dict[str, Any] = {"machine": machine()}
    doc["client"] = {"chunk_mib": a.chunk_mib or None, "max_in_flight": a.in_flight}
    doc["client"]["contribute_read"] = True  # one call a chunk read back: _cost_counts
    if not a.chunk_mib:  # ShardClient's default: W servers on this host, one a namespace
        doc["client"]["chunk_mib_same_host"] = {
            str(w): default_chunk_bytes(w) / MiB for w in a.world_sizes
        }
        doc["client"]["chunk_mib_netns"] = default_chunk_bytes(1) / MiB
    doc["conventions"] = {
        "size": "S = all_reduce tensor = all_gather OUTPUT (each rank sends S/W) = reduce_scatter"
        " INPUT (each rank keeps S/W); mib = S / 2**20, float32",
        "time": "per repetition: barrier, then the op on every rank; the repetition's time is the"
        " max over ranks; *_ms = median over repetitions after warm-up",
        "gbps": "payload bytes of the tensor S / median time / 1e9 (algorithm bandwidth)",
        "ratio_vs_gloo": "ours_ms / gloo_ms (lower is better; 1.0 = as fast as gloo)",
        "cpu": "*_cpu_ms_per_rank: CPU seconds (user+sys, all threads, incl. a hosted server) of"
        " one rank process per op (over the timed loop, less the barriers' CPU measured"
        " alone), mean over ranks; cpu_ratio_vs_gloo = ours / gloo. On a"
        " 2-core machine both sides are CPU-bound, and CPU is less disturbed by other load"
        " than wall time",
        "rounds": "each world size runs every variant --rounds times in alternating order; the"
        " repetitions of all rounds are pooled before the median",
        "ours": "each rank process hosts its ShardServer (in-process server threads); chunk"
        f" {f'{a.chunk_mib:g} MiB' if a.chunk_mib else 'client.chunk_mib_same_host / _netns'},"
        f" {a.in_flight} calls in flight per rank",
        "ours_sep": "same ranks, servers as W separate processes (ours_sep*_cpu_ms_per_rank ="
        " a rank's own CPU + 1/W of all servers' CPU); the variants are in 'variants'",
        "malloc_env": MALLOC_ENV,
        "gloo_env": "allocator-tuned (MALLOC_ENV), as ours"
        if a.gloo_env == "tuned"
        else "default environment (as torch users usually run it)",
    }
    log(f"sizes {a.sizes} MiB, world sizes {a.world_sizes}, quick={a.quick}, parts {a.parts}")
    if a.wait_quiet > 0:
        log(f"waiting up to {a.wait_quiet:.0f} s for a quiet machine")
        doc["machine"]["busy_before_start"] = wait_quiet(a.wait_quiet, 0.2)
    if "transport" in a.parts:
        section_transport(doc, a)
    if "collectives" in a.parts or "training" in a.parts:
        section_collectives(doc, a)
    doc["machine"]["loadavg_at_end"] = list(os.getloadavg())
    doc["seconds"] = round(time.monotonic() - t_start, 1)
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    sys.stdout.flush()
    log(f"done in {doc['seconds']} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "mode",
        nargs="?",
        default="bench",
        choices=["bench", "_rank", "_server", "_gloo", "_tcp_recv", "_tcp_send", "_pushpull"],
        help=argparse.SUPPRESS,
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one size (16 MiB), 5 repetitions, no separate-server variant (< 2 min)",
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help="tensor sizes in MiB, or in bytes with a B suffix (default 4B,1,16,64)",
    )
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per cell (default by size)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--tcp-mib",
        type=float,
        default=64.0,
        help="payload of the raw TCP and push/pull measurements",
    )
    ap.add_argument(
        "--gloo-env",
        choices=["default", "tuned"],
        default="tuned",
        help="tuned (default): gloo ranks get MALLOC_ENV too, like ours; default: the plain"
        " environment (gloo then page-faults on its per-call buffers: slower all_gather and"
        " reduce_scatter)",
    )
    ap.add_argument("--no-separate", action="store_true", help="skip the separate-servers variants")
    ap.add_argument(
        "--no-inband",
        action="store_true",
        help="skip the separate servers with PARAMSHARD_SHM=0 (payloads in-band)",
    )
    ap.add_argument(
        "--no-netns",
        action="store_true",
        help="skip the cross-namespace variants (ours and gloo, one namespace per rank; they"
        " need root and iproute2, and are skipped with the reason otherwise)",
    )
    ap.add_argument(
        "--no-ns-shm",
        action="store_true",
        help="skip the cross-namespace variant whose ranks reach their own servers through"
        " shared memory (ours_ns_shm)",
    )
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument(
        "--chunk-mib",
        type=float,
        default=0.0,
        help="ShardClient chunk_bytes, MiB (default: the client's own for the cell's servers"
        " a host, client/chunk_size.py)",
    )
    ap.add_argument(
        "--in-flight", type=int, default=MAX_IN_FLIGHT, help="ShardClient max_in_flight"
    )
    ap.add_argument(
        "--parts",
        default="transport,collectives",
        help="what to run: transport (raw TCP, push/pull, codec), collectives, training (a"
        " training step across the namespaces, ours against gloo's, at each of --rates)",
    )
    ap.add_argument(
        "--rates",
        default="10,25,0",
        help="the namespaces' link rates in Gbit/s, 0 = unlimited (benchmarks/_netns.py"
        " Namespaces.shape); the cross-namespace variants run at each (default %(default)s)",
    )
    ap.add_argument(
        "--train-model",
        default="small",
        help="the GPT of the training part (benchmarks.strategies' models; --quick: tiny)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="times each variant runs per world size, alternating order (default 2, --quick 1)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each phase wait up to this many seconds for other processes to"
        " use < 20%% of the CPUs and the hypervisor to steal < 10%% from hand-offs between"
        " processes (default: do not wait)",
    )
    ap.add_argument(
        "--max-seconds", type=float, default=0, help="global watchdog (default 2400, --quick 300)"
    )
    # child options
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--host-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--to", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=float, default=64.0, help=argparse.SUPPRESS)
    ap.add_argument("--lifetime", type=float, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.sizes = (
        parse_list(a.sizes, parse_size)
        if a.sizes
        else ([16.0] if a.quick else [4 / MiB, 1.0, 16.0, 64.0])
    )
    a.world_sizes = parse_list(a.world_sizes, int)
    a.parts = parse_list(a.parts, str)
    a.chunk_bytes = max(4096, int(a.chunk_mib * MiB)) if a.chunk_mib else None
    if not a.parts or set(a.parts) - {"transport", "collectives", "training"}:
        ap.error("--parts takes transport, collectives and/or training")
    a.rates = [float(r) or None for r in parse_list(a.rates, str)]
    if a.quick:
        a.train_model = "tiny"
    if a.quick:
        a.no_separate = a.no_netns = True
    a.rounds = a.rounds or (1 if a.quick else 2)
    waits = (1 + len(a.world_sizes) * a.rounds * 6) * max(0.0, a.wait_quiet)
    a.max_seconds = a.max_seconds or (300.0 if a.quick else 2400.0) + waits

    if a.mode != "bench":
        child_guard(a.lifetime or 1800.0)
        child = {
            "_rank": rank_main,
            "_server": server_main,
            "_gloo": gloo_main,
            "_tcp_recv": tcp_recv_main,
            "_tcp_send": tcp_send_main,
            "_pushpull": pushpull_main,
        }[a.mode]
        run_child(lambda: child(a))

    if any(w < 1 for w in a.world_sizes) or any(s <= 0 for s in a.sizes):
        ap.error("sizes and world sizes must be positive")
    a.lifetime = a.max_seconds + 60  # children outlive no parent: they also watch getppid()

    install_cleanup()

    def on_timeout() -> None:
        log(f"global watchdog: {a.max_seconds:.0f} s exceeded; stopping children")
        stop_all(timeout=3)
        os._exit(4)

    wd = threading.Timer(a.max_seconds, on_timeout)
    wd.daemon = True
    wd.start()
    try:
        return bench_main(a)
    except ChildError as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        wd.cancel()
        stop_all(timeout=5)


if __name__ == "__main__":
    sys.exit(main())
