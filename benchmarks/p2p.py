"""What one point-to-point message costs: ours against gloo's ``send``/``recv``.

    python -m benchmarks.p2p [--quick] [--sizes 4,16384,1048576] [--messages N] [--rounds R]
                             [--wait-quiet S]

Two rank processes play ping-pong: rank 0 sends a tensor of the given size in bytes (float32)
to rank 1 and waits for rank 1's tensor back, ``--messages`` times after 20 of warm-up. This
is a pipeline's traffic with nothing to hide it behind (a stage's activation forward, its
gradient back: ``strategies/pipeline/communications.py``). Sides, in alternating order each
round:

- **ours**: each rank hosts its own in-process ``ShardServer`` (as the pipeline benchmark's
  ranks do, ``benchmarks.hybrid``) and calls ``ShardClient.send`` and ``recv``: a message is a
  contribution to the receiver's server (over the client's session) and the receiver's read
  from its own server (in-process);
- **ours-unary**: the same with ``PARAMSHARD_SESSIONS=0`` (each contribution its own call);
- **gloo**: ``torch.distributed.send`` / ``recv`` on a gloo group.

Per cell: ``roundtrip_ms`` (wall time of the loop over the messages), ``cpu_per_message_ms``
(both processes' CPU, every thread, over the loop, divided by the messages both sent), and for
ours ``cpu_by_thread_ms``: the same CPU split by the thread that spent it (Python thread names,
grpc's own threads by their target, native threads by name), per message. Every received
tensor of the last round trip is checked against what its sender sent (``received_ok``).
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any

from benchmarks._cpu import Load, wait_quiet
from benchmarks._processes import free_port

SIDES = ("ours", "ours-unary", "gloo")
WARMUP = 20
TIMEOUT_S = 300.0


def _thread_cpu() -> dict[str, int]:
    """Clock ticks each of this process's threads used so far, by label."""
    py = {t.native_id: t for t in threading.enumerate()}
    ticks: Counter[str] = Counter()
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(task + "/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # utime and stime: fields 14 and 15
        thread = py.get(int(task.rsplit("/", 1)[1]))
        ticks[_label(thread, comm)] += int(fields[11]) + int(fields[12])
    return dict(ticks)


def _label(thread: threading.Thread | None, comm: str) -> str:
    if thread is None:
        return f"native:{comm}"
    target = getattr(thread, "_target", None)
    module = getattr(target, "__module__", "") or ""
    if thread.name.startswith("Thread-") and target is not None:
        return f"{module.split('.')[0]}:{target.__qualname__.rsplit('.', 1)[-1]}"
    return thread.name.rstrip("0123456789_")


def _rank(side: str, size: int, messages: int, rank: int, ports: list[int], out: Any) -> None:
    closers: list[Any] = []
    try:
        import torch

        torch.set_num_threads(1)
        if side == "ours-unary":
            os.environ["PARAMSHARD_SESSIONS"] = "0"
        numel, peer = max(1, size // 4), 1 - rank
        x = torch.arange(numel, dtype=torch.float32) + 1000 * rank
        if side == "gloo":
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{ports[2]}", rank=rank, world_size=2
            )
            closers.append(dist.destroy_process_group)
            y = torch.empty(numel)

            def send() -> None:
                dist.send(x, peer)

            def recv() -> torch.Tensor:
                dist.recv(y, peer)
                return y

            sync = dist.barrier
        else:
            from paramshard.client import ClusterSpec, ShardClient
            from paramshard.server import ShardServer

            server = ShardServer("127.0.0.1", ports[rank]).start()
            closers.append(lambda: server.stop(0))
            _wait_listening(ports[peer])  # no first call before the peer's server is up
            spec = ClusterSpec([f"127.0.0.1:{p}" for p in ports[:2]])
            client = ShardClient(spec, rank=rank, world_size=2, run_id="p2p", timeout_s=60)
            closers.insert(0, client.close)
            like = torch.empty(0)

            def send() -> None:
                client.send(x, peer, "pp")

            def recv() -> torch.Tensor:
                return client.recv(peer, like, "pp")

            sync = client.barrier

        def loop(count: int) -> torch.Tensor:
            got = x
            for _ in range(count):
                if rank == 0:  # ping
                    send()
                    got = recv()
                else:  # pong
                    got = recv()
                    send()
            return got

        loop(WARMUP)
        sync()
        threads, cpu, t0 = _thread_cpu(), time.process_time(), time.perf_counter()
        got = loop(messages)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
        after = _thread_cpu()
        sync()
        expected = torch.arange(numel, dtype=torch.float32) + 1000 * peer
        ticks = {k: v - threads.get(k, 0) for k, v in after.items() if v - threads.get(k, 0)}
        out.put((rank, wall, cpu, ticks, bool(torch.equal(got.reshape(-1), expected)), None))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        out.put((rank, 0.0, 0.0, {}, False, f"{type(exc).__name__}: {exc}"))
    finally:
        for close in closers:
            close()


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def cell(side: str, size: int, a: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port() for _ in range(3)]  # the ranks' servers, gloo's store
    args = [(side, size, a.messages, r, ports, out) for r in (0, 1)]
    procs = [ctx.Process(target=_rank, args=arg) for arg in args]
    for p in procs:
        p.start()
    got: list[Any] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) < len(procs) and time.monotonic() < deadline:
            try:
                got.append(out.get(timeout=1.0))
            except queue.Empty:
                if len(got) + sum(p.exitcode not in (None, 0) for p in procs) >= len(procs):
                    break  # a rank died without a word: its peer waits for it in vain
    finally:
        for p in procs:
            p.join(0 if len(got) < len(procs) else 30)
            if p.is_alive():
                p.kill()
    got.sort(key=lambda g: g[0])
    errors = [e for *_, e in got if e]
    if len(got) < len(procs):
        errors.append(
            f"{len(procs) - len(got)} rank(s) died or hung (exit codes"
            f" {[p.exitcode for p in procs]})"
        )
    row: dict[str, Any] = {"side": side, "size_bytes": size, "messages": a.messages}
    if errors:
        return {**row, "error": "; ".join(errors)}
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    by_thread: Counter[str] = Counter()
    for _, _, _, ticks, _, _ in got:
        by_thread.update(ticks)
    per_message = 2 * a.messages  # both ranks send a.messages each
    row.update(
        roundtrip_ms=round(max(w for _, w, *_ in got) / a.messages * 1e3, 4),
        cpu_per_message_ms=round(sum(c for _, _, c, *_ in got) / per_message * 1e3, 4),
        received_ok=all(ok for *_, ok, _ in got),
    )
    if side != "gloo":
        row["cpu_by_thread_ms"] = {
            k: round(v * tick_ms / per_message, 4) for k, v in by_thread.most_common()
        }
    return row


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size: each side's median over the rounds, and ours' ratios to gloo's."""
    out = []
    for size in sorted({r["size_bytes"] for r in rows}):
        med = {}
        for side in SIDES:
            ok = [
                r
                for r in rows
                if r["size_bytes"] == size and r["side"] == side and "error" not in r
            ]
            if ok:
                med[side] = {
                    k: _median([r[k] for r in ok]) for k in ("roundtrip_ms", "cpu_per_message_ms")
                }
        row: dict[str, Any] = {"size_bytes": size, "medians": med}
        for side in ("ours", "ours-unary"):
            if side in med and "gloo" in med:
                row[f"{side}_over_gloo"] = {
                    k: round(med[side][k] / med["gloo"][k], 3) for k in med[side]
                }
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.p2p", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="one small size, few messages, 1 round")
    ap.add_argument("--sizes", default="4,16384,1048576", help="bytes a message (float32)")
    ap.add_argument("--messages", type=int, default=0, help="round trips a cell (default 1000)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds of every side (default 3)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="wait for other load (s)")
    a = ap.parse_args(argv)
    sizes = [4096] if a.quick else [int(s) for s in a.sizes.split(",")]
    a.messages = a.messages or (200 if a.quick else 1000)
    rounds = a.rounds or (1 if a.quick else 3)
    if a.wait_quiet:
        wait_quiet(a.wait_quiet)
    load, t0 = Load().start(), time.time()
    rows = []
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for size in sizes:
            for side in order:
                rows.append({**cell(side, size, a), "round": r})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    import torch

    out = {
        "benchmark": "p2p",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "torch": torch.__version__,
        "rows": rows,
        "summary": summary(rows),
        "wall_s": round(time.time() - t0, 1),
        "foreign_cpu_frac": load.stop(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            out["host"]["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
    except (OSError, StopIteration):
        pass
    print(json.dumps(out, indent=1))
    return 1 if any("error" in r or not r.get("received_ok") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
