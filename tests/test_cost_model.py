"""benchmarks/cost_model.py on a run whose costs are known: the fit recovers them, the check
predicts a shaped link's cells from the rate measured across it (not the nominal one), and the
prediction reaches 1,024 hosts. The benchmark's own JSON is made here from chosen costs, so
every expected number follows from the model's formulas, not from a machine."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import _cost_check as ck
from benchmarks import cost_model as cm

MiB = 2**20
COSTS = {  # seconds a message, seconds a byte: the lab's time and a host's CPU
    "ours": {"s_per_message": 7e-4, "s_per_byte": 1.0e-9,
             "cpu_s_per_message": 6e-4, "cpu_s_per_byte": 0.8e-9},
    "gloo": {"s_per_message": 4e-4, "s_per_byte": 1.2e-9,
             "cpu_s_per_message": 2e-4, "cpu_s_per_byte": 0.9e-9},
}  # fmt: skip
SIZES_MIB = (4 / MiB, 1.0, 16.0, 64.0)
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def row(op: str, w: int, mib: float, rate: float | None, link: float | None) -> dict:
    """One cross-namespace row as benchmarks.collectives writes it, timed by the model itself
    with links that move ``link`` Gbit/s."""
    out = {"op": op, "world_size": w, "mib": mib, "rate_gbit": rate}
    nbytes = ck.tensor_bytes(out)  # the tensor the benchmark ran ("4B": one float32 a rank)
    for side, c in COSTS.items():
        msgs, handled, _ = cm.cc.op_counts(side, op, nbytes, w)
        cpu = c["cpu_s_per_message"] * msgs + c["cpu_s_per_byte"] * handled
        out[f"{side}_ns_ms"] = ck.lab_time(side, c, op, nbytes, w, link) * 1e3
        out[f"{side}_ns_cpu_ms_per_rank"] = cpu * 1e3
    return out


def run(shaped_moved: float | None) -> dict:
    """W = 2 and 4 unlimited, and W = 2 and 4 on links shaped to 10 Gbit/s that really moved
    1 Gbit/s (slow enough that the link, not the CPU, decides the large cells);
    ``shaped_moved``: what the JSON says a raw stream moved (None: not measured)."""
    rows = [row(op, w, mib, None, None) for op in OPS for w in (2, 4) for mib in SIZES_MIB]
    rows += [row(op, w, mib, 10.0, 1.0) for op in OPS for w in (2, 4) for mib in SIZES_MIB]
    shaping = [{"rate_gbit": None, "qdisc": "none"}, {"rate_gbit": 10.0, "qdisc": "tbf"}]
    if shaped_moved is not None:
        shaping[1]["raw_tcp_gbit"] = [shaped_moved - 0.5, shaped_moved + 0.5]
    # the chunk op_counts counted the rows with: a client's default, one server a host
    client = {"chunk_mib": None, "chunk_mib_netns": cm.cc.chunk_for(1, None) / MiB}
    client["contribute_read"] = True  # counted as op_counts counts today's clients
    return {"netns": {"results": rows, "shaping": shaping}, "machine": {"cpu": "test"},
            "client": client}  # fmt: skip


def test_fit_recovers_the_costs_the_cells_were_made_with() -> None:
    fitted = cm.fit([run(1.0)])
    for side, c in COSTS.items():
        for key, want in c.items():
            assert fitted[side][key] == pytest.approx(want, rel=1e-6), (side, key)
        assert fitted[side]["fitted_on"] == len(OPS) * len(SIZES_MIB)


def test_the_fit_takes_each_cells_median_over_runs(tmp_path, capsys) -> None:
    """Three runs, one of whose fit phases ran 1.5x slow (a slow phase, the hypervisor's
    steal): alone it fits costs 1.5x; with the two others the median of each cell is theirs
    and the costs come back. The check counts every run's held-out cells, by run too."""
    slow = run(1.0)
    for r in slow["netns"]["results"]:
        if ck.is_fitted(r):
            for key in [k for k in r if k.endswith(("_ms", "_ms_per_rank"))]:
                r[key] *= 1.5
    alone = cm.fit([slow])
    assert alone["ours"]["cpu_s_per_byte"] == pytest.approx(1.5 * COSTS["ours"]["cpu_s_per_byte"])
    fitted = cm.fit([run(1.0), slow, run(1.0)])
    for side, c in COSTS.items():
        for key, want in c.items():
            assert fitted[side][key] == pytest.approx(want, rel=1e-6), (side, key)
        assert fitted[side]["fitted_on"] == len(OPS) * len(SIZES_MIB)
        assert fitted[side]["runs"] == 3
    chk = ck.check([run(1.0), slow, run(1.0)], fitted)
    cells = 3 * len(OPS) * len(SIZES_MIB)  # held out a side and run: W = 4, and 10 Gbit/s
    assert chk["held_out_cells"] == chk["held_out_within_20pct"] == 3 * 2 * cells
    assert chk["by_run"]["gloo, run 2"] == f"time {cells}, CPU {cells} of {cells}"
    assert {r["run"] for r in chk["rows"]} == {1, 2, 3}
    # runs counted with another chunk are other cells, not medians of unlike counts
    other = run(1.0)
    other["client"]["chunk_mib_netns"] /= 4
    assert cm.fit([run(1.0), other])["ours"]["fitted_on"] > len(OPS) * len(SIZES_MIB)
    paths = []
    for i, doc in enumerate((run(1.0), slow, run(1.0))):
        paths.append(tmp_path / f"coll{i}.json")
        paths[-1].write_text(json.dumps(doc))
    assert cm.main(["--collectives", *map(str, paths), "--markdown"]) == 0
    text = capsys.readouterr().out
    assert f"| ours, run 3 | time {cells}, CPU {cells} of {cells} |" in text
    assert "One raw TCP stream (run 2) across links shaped to 10 Gbit/s moved 1.00." in text


def test_check_uses_the_rate_measured_across_the_shaped_link() -> None:
    doc = run(1.0)
    chk = ck.check([doc], cm.fit([doc]))
    assert chk["link_gbit_measured"] == [{10.0: 1.0}]
    assert chk["held_out_cells"] == 2 * len(OPS) * len(SIZES_MIB) * 3  # two sides, 3 groups
    assert chk["held_out_within_20pct"] == chk["held_out_cells"]
    assert all(abs(r["error"]) < 1e-6 for r in chk["rows"])
    # the nominal rate under-predicts the 64 MiB cells, whose time is the link's
    nominal = ck.check([run(None)], cm.fit([doc]))
    big = [r for r in nominal["rows"] if r["rate_gbit"] and r["bytes"] == 64 * MiB]
    assert big and all(r["link_gbit"] == 10.0 for r in big)
    assert any(r["error"] < -0.2 for r in big)
    assert nominal["held_out_within_20pct"] < chk["held_out_within_20pct"]


def test_more_hosts_than_cores_take_their_cpu_over_the_cores() -> None:
    """``lab_time``: with a core a host (W = 2) a cell takes the lab's time a message and a
    byte, waits for the peer included; with four hosts on two cores, their CPU over the cores
    (a host's waits are the others' turns), not twice the W = 2 time with its waits, unless
    its messages one after another take longer (the lab's time a message, twice)."""
    c = COSTS["gloo"]
    for op, mib in ((op, mib) for op in OPS for mib in SIZES_MIB):
        msgs, handled, _ = cm.cc.op_counts("gloo", op, mib * MiB, 2)
        want = c["s_per_message"] * msgs + c["s_per_byte"] * handled
        assert ck.lab_time("gloo", c, op, mib * MiB, 2, None) == pytest.approx(want)
        msgs, handled, _ = cm.cc.op_counts("gloo", op, mib * MiB, 4)
        work, waits = 2 * cm.cc.cpu_s(c, msgs, handled), 2 * c["s_per_message"] * msgs
        assert ck.lab_time("gloo", c, op, mib * MiB, 4, None) == pytest.approx(max(work, waits))
        wall = c["s_per_message"] * msgs + c["s_per_byte"] * handled
        assert max(work, waits) < 2 * wall  # COSTS: a message and a byte outlast their CPU
        if mib == 64:
            assert work > waits  # the bytes' CPU, not the messages' waits, decides


def test_prediction_reaches_a_thousand_hosts_for_every_model(tmp_path, capsys) -> None:
    path = tmp_path / "coll.json"
    path.write_text(json.dumps(run(1.0)))
    assert cm.main(["--collectives", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    hosts = {(r["model"], r["gbit"]): [] for r in out["prediction"]}
    for r in out["prediction"]:
        hosts[(r["model"], r["gbit"])].append(r["hosts"])
        for kind in ("ddp", "zero2", "fsdp", "ring", "tree"):
            assert r[f"{kind}_comm_s"] > 0 and 0 < r[f"{kind}_share"] < 1
    assert set(hosts) == {(m, g) for m in cm.PARAMS for g in cm.RATES}
    assert all(v == list(cm.HOSTS) and max(v) == 1024 for v in hosts.values())
    # a ring's steps in sequence grow with W
    ring = {r["hosts"]: r["ring_comm_s"] for r in out["prediction"]
            if r["model"] == "gpt2-124m" and r["gbit"] == 100.0}  # fmt: skip
    assert ring[1024] > ring[8]
    assert math.isfinite(out["costs"]["ours"]["cpu_gb_per_s_per_core"])


def test_the_fit_counts_messages_with_the_chunk_the_run_used() -> None:
    """A run's JSON says its chunk, or its clients' default across the namespaces; one made
    before it said either was made with 16 MiB."""
    assert ck.chunk_of({"client": {"chunk_mib": 4.0}}) == 4 * MiB
    assert ck.chunk_of({"client": {"chunk_mib": None, "chunk_mib_netns": 8.0}}) == 8 * MiB
    assert ck.chunk_of({"machine": {}}) == 16 * MiB
    msgs_4, *_ = cm.cc.op_counts("ours", "all_gather", 64 * MiB, 2, 4 * MiB)
    msgs_16, *_ = cm.cc.op_counts("ours", "all_gather", 64 * MiB, 2, 16 * MiB)
    assert msgs_4 == 4 * msgs_16


def test_gloo_is_counted_as_torch_runs_it() -> None:
    """torch's ops on gloo (benchmarks/_cost_counts.py's docstring): the all-reduce's ring
    sends 1 MiB segments, at least 2 W of them, none past the tensor's end; the all-gather
    copies through a temporary; the reduce-scatter all-reduces a clone of the whole input."""
    count = cm.cc.op_counts
    assert cm.cc.gloo_segments(64 * MiB, 2) == (64, 64)
    assert cm.cc.gloo_segments(9 * MiB, 4) == (12, 12)  # 9 rounded up to a multiple of 4
    # gloo/allreduce.cc: 2 float32 at W = 2 are 4 segments of one float32, the last 2 past
    # the tensor's end (a length of 0 or less), which the ring neither sends nor receives
    assert cm.cc.gloo_segments(8, 2) == (4, 2) and cm.cc.gloo_segments(16, 4) == (8, 4)
    msgs, handled, wire = count("gloo", "all_reduce", 64 * MiB, 2)
    assert (msgs, handled, wire) == (2 * 64, 5 * 32 * MiB, 64 * MiB)  # 64 sends, received
    msgs, handled, wire = count("gloo", "all_reduce", 16, 4)  # 4 segments, each sent 2 x 3 / 4
    assert msgs == 2 * 2 * 4 * 3 / 4 and wire == 2 * 16 * 3 / 4
    msgs, handled, wire = count("gloo", "all_gather", 64 * MiB, 4)
    assert msgs == 2 * 6 and wire == 48 * MiB
    assert handled == 2 * 48 * MiB + 16 * MiB + 64 * MiB
    ar, rs = count("gloo", "all_reduce", 64 * MiB, 4), count("gloo", "reduce_scatter", 64 * MiB, 4)
    assert rs[0] == ar[0] and rs[2] == ar[2]  # the same ring, the whole tensor's bytes
    assert rs[1] == ar[1] + 64 * MiB + 16 * MiB  # and the clone and the slice
    with pytest.raises(ValueError):
        count("gloo", "broadcast", 4, 2)


def test_the_check_counts_cells_by_their_phase_steal() -> None:
    """A run that recorded each phase's steal (benchmarks/_cpu.py ``Load``) has its held-out
    cells counted apart by it: here the shaped phases lost 30% of the CPUs to the hypervisor
    and their cells were timed 1.5x the model's, the unlimited W = 4 phases lost none."""
    doc = run(1.0)
    for r in doc["netns"]["results"]:
        if r["rate_gbit"]:
            r["ours_ns_ms"] *= 1.5
            r["gloo_ns_ms"] *= 1.5
    doc["phases"] = [
        {"variant": f"{side}_ns", "world_size": w, "rate_gbit": rate, "steal_frac": steal}
        for side in ("ours", "gloo")
        for w in (2, 4)
        for rate, steal in ((None, 0.0), (10.0, 0.3))
    ]
    chk = ck.check([doc], cm.fit([doc]))
    assert chk["fit_phase_steal"] == {"ours": [0.0], "gloo": [0.0]}
    shaped = [r for r in chk["rows"] if r["rate_gbit"]]
    assert shaped and all(r["phase_steal"] == 0.3 for r in shaped)
    cells = len(OPS) * len(SIZES_MIB)
    for side in ("ours", "gloo"):
        quiet = chk["by_steal"][f"{side}, steal under 10%"]
        assert quiet == f"time {cells}, CPU {cells} of {cells}", quiet
        slow = chk["by_steal"][f"{side}, steal at or over 10%"]
        assert slow == f"time 0, CPU {2 * cells} of {2 * cells}", slow
    # a run from before steal was recorded: no rows' steal, nothing counted by it
    old = ck.check([run(1.0)], cm.fit([run(1.0)]))
    assert old["by_steal"] == {} and all(r["phase_steal"] is None for r in old["rows"])


def test_a_run_the_fit_did_not_see_is_checked_whole(tmp_path, capsys) -> None:
    """``--held-out``: a later run predicted from the costs of earlier ones, every cell of it,
    its W = 2 unlimited ones too; here that run's fit-shaped cells ran 1.5x slow (time and
    CPU), and they are the ones that miss."""
    slow = run(1.0)
    for r in slow["netns"]["results"]:
        if ck.is_fitted(r):
            for key in [k for k in r if k.endswith(("_ms", "_ms_per_rank"))]:
                r[key] *= 1.5
    paths = {name: tmp_path / f"{name}.json" for name in ("a", "b", "later")}
    for name, doc in (("a", run(1.0)), ("b", run(1.0)), ("later", slow)):
        paths[name].write_text(json.dumps(doc))
    argv = ["--collectives", str(paths["a"]), str(paths["b"]), "--held-out", str(paths["later"])]
    assert cm.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cells = len(OPS) * len(SIZES_MIB)
    chk = out["check"]
    assert out["costs"]["ours"]["runs"] == 2  # the later run is not in the fit
    assert chk["held_out_cells"] == 2 * (3 + 3 + 4) * cells  # its W = 2 unlimited too
    assert chk["by_group"]["ours W=2 unlimited"] == f"time 0, CPU 0 of {cells}"
    later = chk["by_run"]["gloo, run 3 (not fitted: every cell)"]
    assert later == f"time {3 * cells}, CPU {3 * cells} of {4 * cells}"
    assert chk["by_run"]["gloo, run 1"] == f"time {3 * cells}, CPU {3 * cells} of {3 * cells}"
    assert len(chk["fit_phase_steal"]["ours"]) == 2


def test_the_spread_of_each_sides_own_runs_is_counted() -> None:
    """``spread``: each cell measured in three runs or more, each run's time and CPU against
    the cell's own median over the runs, whatever the model says. Here gloo's cells ran 1.0x,
    1.1x, 1.5x and 1.1x the model's time in four runs (median 1.1x: the 1.5x run is 36% off),
    ours' 1.0x, 1.0x, 1.0x and 1.3x (median 1.0x: the last is 30% off); CPU the same in all."""
    docs = [run(1.0) for _ in range(4)]
    for doc, gloo, ours in zip(docs, (1.0, 1.1, 1.5, 1.1), (1.0, 1.0, 1.0, 1.3), strict=True):
        for r in doc["netns"]["results"]:
            for side, f in (("gloo", gloo), ("ours", ours)):
                r[f"{side}_ns_ms"] *= f
    cells = len(OPS) * len(SIZES_MIB) * 2  # a W's: every op and size, unlimited and shaped
    got = ck.check(docs, cm.fit(docs))["spread"]
    for group in ("gloo W=2", "gloo W=4", "ours W=2", "ours W=4"):
        assert got[group] == f"time {3 * cells}, CPU {4 * cells} of {4 * cells}", got
    # two runs are too few to say how a cell scatters
    assert ck.check(docs[:2], cm.fit(docs[:2]))["spread"] == {}
