"""What a copy of a payload into a shared segment or an in-band message leaves to the process's
other threads.

    python -m benchmarks.segment_copies [--quick] [--mb 24] [--copies 100] [--reps 3]

A shared segment is written by a copy of a payload's bytes: a server's reply into a reader's
or a rank's segment, a rank's push into its own (``protos.codec.copy_into``). One thread
copies ``--mb`` MB into an anonymous map ``--copies`` times in a row, while another runs small
NumPy operations in place (two on 100,000 floats, as an optimizer step's, each needing the GIL
to start), three ways:

- ``alone``: the other thread only (the reference);
- ``memoryview``: the copy by a memoryview's slice assignment, which holds the GIL throughout;
- ``copy_into``: the copy through NumPy, which releases it;
- ``encode``: no segment: the payload joined with its header into the ``bytes`` a gRPC
  message needs (``protos.codec.encode``, an in-band reply's or push's one copy), which holds
  the GIL too; the map is not written.

Per repetition: each copy's median seconds, and the other thread's operations a second during
the copies, with its ratio to ``alone`` in the same repetition. ``--quick``: 4 MB, 5 copies,
one repetition. JSON to stdout.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._scale_memory import loadavg, machine, write_report
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb


def _other_thread_rate(copy: Callable[[], None] | None, copies: int) -> tuple[float, float]:
    """(the other thread's operations a second while ``copy`` runs ``copies`` times, or for
    a second without it; each copy's median seconds, 0 without)."""
    a = np.random.default_rng(0).random(100_000, dtype=np.float32)
    b = a.copy()
    done, count = threading.Event(), [0]

    def work() -> None:
        while not done.is_set():
            np.multiply(a, 0.5, out=a)
            np.add(a, b, out=a)
            count[0] += 1

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    time.sleep(0.2)  # the worker runs before the measurement starts
    times = []
    try:
        start, t0 = count[0], time.perf_counter()
        if copy is None:
            time.sleep(1.0)
        for _ in range(copies if copy is not None else 0):
            c0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - c0)
        rate = (count[0] - start) / (time.perf_counter() - t0)
    finally:
        done.set()
        worker.join(10)
    return rate, statistics.median(times) if times else 0.0


COPIES = ("memoryview", "copy_into", "encode")


def _encoded(data: memoryview) -> None:
    """An in-band message of ``data``, made and dropped (its memory freed, as a sent one's)."""
    codec.encode(pb.PullParamsHeader(), data)


def repetition(nbytes: int, copies: int) -> dict[str, Any]:
    segment = mmap.mmap(-1, nbytes)
    view = memoryview(segment)
    data = codec.byte_view(np.random.default_rng(1).random(nbytes // 4, dtype=np.float32))
    ways: dict[str, Callable[[], None] | None] = {
        "alone": None,
        "memoryview": lambda: view.__setitem__(slice(0, data.nbytes), data),
        "copy_into": lambda: codec.copy_into(view, data),
        "encode": lambda: _encoded(data),
    }
    out: dict[str, Any] = {}
    try:
        for name, copy in ways.items():
            rate, copy_s = _other_thread_rate(copy, copies)
            out[name] = {"other_ops_per_s": round(rate), "copy_s": round(copy_s, 5)}
        for name in COPIES:
            out[name]["other_ratio_to_alone"] = round(
                out[name]["other_ops_per_s"] / out["alone"]["other_ops_per_s"], 4
            )
    finally:
        view.release()
        segment.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=float, default=24.0, help="MB a copy (6M float32: 24 MB)")
    p.add_argument("--copies", type=int, default=100, help="copies in a row, each way")
    p.add_argument("--reps", type=int, default=3, help="repetitions")
    p.add_argument("--quick", action="store_true", help="4 MB, 5 copies, one repetition")
    a = p.parse_args(argv)
    if a.quick:
        a.mb, a.copies, a.reps = 4.0, 5, 1
    if a.mb <= 0 or min(a.copies, a.reps) < 1:
        raise SystemExit("--mb must be positive; --copies and --reps at least 1")
    out: dict[str, Any] = {"benchmark": "segment_copies", "command": " ".join(sys.argv)}
    out["machine"] = machine()
    out["machine"]["loadavg_at_start"] = loadavg()
    out["reps"] = reps = [repetition(int(a.mb * 1e6) // 4 * 4, a.copies) for _ in range(a.reps)]
    out["cells"] = {
        name: {
            key: statistics.median(r[name][key] for r in reps)
            for key in ("copy_s", "other_ops_per_s", "other_ratio_to_alone")
        }
        for name in COPIES
    }
    write_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
