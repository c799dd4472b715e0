"""The one parameter record (``protos.manifest.ParamEntry``) and the one placement module
(``protos.placement``): torch-free, so these tests need no servers."""

from __future__ import annotations

import json

import pytest

from paramshard.client import ParamInfo
from paramshard.client.jobs import LiveParam, ParamRef
from paramshard.client.tensor_parts import PartParam, WholeParam
from paramshard.protos import placement
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.manifest import ParamEntry, ParamSplit
from paramshard.strategies import layout

SPLIT = ParamSplit(dim=0, parts=2, index=1, packed=3, unit=4)


def test_every_parameter_class_is_the_one_record():
    assert ParamInfo is ParamEntry and layout.ParamEntry is ParamEntry
    for cls in (ParamRef, PartParam, WholeParam, LiveParam):
        assert issubclass(cls, ParamEntry), cls


def test_an_entry_round_trips_through_json_and_the_wire():
    entry = ParamEntry("attn.w", (24, 8), 40, "bfloat16", ("tied.w",), SPLIT)
    assert entry.numel == 192
    described = json.loads(json.dumps(entry.to_manifest()))
    assert described == {
        "name": "attn.w",
        "shape": [24, 8],
        "dtype": "bfloat16",
        "offset": 40,
        "numel": 192,
        "aliases": ["tied.w"],
        **SPLIT.fields(),
    }
    assert ParamEntry.from_manifest(described) == entry
    wire = entry.to_pb()
    assert (wire.numel, wire.split_parts, wire.split_unit) == (192, 2, 4)
    assert ParamEntry.from_pb(pb.ParamEntry.FromString(wire.SerializeToString())) == entry


def test_a_whole_tensor_has_no_split_and_writes_no_split_fields():
    entry = ParamInfo("w", (3,), 0)  # README's spelling: name, shape, offset
    assert entry.split is None and entry.dtype == "float32"
    assert not any(k.startswith("split_") for k in entry.to_manifest())
    assert ParamSplit.from_fields(pb.ParamEntry(split_parts=1)) is None  # 0 or 1: whole
    # packed and unit 0 mean 1 on the wire
    assert ParamSplit.from_fields({"split_parts": 2, "split_index": 1}) == ParamSplit(0, 2, 1)


def test_an_unknown_manifest_field_is_named():
    with pytest.raises(ValueError, match=r"'w' has unknown field\(s\) \['nom'\]"):
        ParamEntry.from_manifest({"name": "w", "shape": [2], "nom": 1})


def test_a_shape_too_large_for_the_wire_still_reaches_the_server_to_be_refused():
    wire = ParamEntry("w", (2**32, 2**32)).to_pb()
    assert wire.numel == 2**64 - 1 and list(wire.shape) == [2**32, 2**32]


def test_extensions_keep_the_record_and_add_their_own_fields():
    ref = ParamRef.from_pb(
        ParamEntry("w", (2, 3), 6, aliases=("v",)).to_pb(),
        buffer="root#g0",
        buffer_numel=12,
        version=7,
    )
    assert (ref.name, ref.offset, ref.aliases, ref.buffer, ref.version) == (
        "w",
        6,
        ("v",),
        "root#g0",
        7,
    )
    whole = WholeParam.of(
        PartParam("w", (1, 3), 6, split=SPLIT, read=list), shape=(2, 3), produce=list, source=("a",)
    )
    assert (whole.shape, whole.offset, whole.split, whole.source) == ((2, 3), 0, None, ("a",))


def test_the_server_of_a_rank_and_of_a_replica():
    assert [placement.rank_server(r, 3) for r in range(5)] == [0, 1, 2, 0, 1]
    assert placement.rank_server(1, 2, rank_servers=[1, 0]) == 0
    assert [placement.replica_holder(i, 3) for i in range(3)] == [1, 2, 0]


def test_part_job_names_round_trip():
    assert placement.part_job("gpt.v2", 3, 1) == "gpt.v2.pp3.tp1"
    assert placement.parse_part_job("gpt.v2.pp3.tp1") == ("gpt.v2", 3, 1)
    assert placement.parse_part_job("gpt.pp3") is None


def test_a_restore_puts_slices_back_home_only_in_a_cluster_of_the_same_size():
    manifest = {"num_servers": 2, "servers": [3, 1], "cluster_servers": 4}
    assert placement.restore_servers(manifest, 4) == [3, 1]
    assert placement.restore_slice(manifest, 4, 1) == (1, 2)
    assert placement.restore_slice(manifest, 4, 0) is None  # held no slice: nothing to restore
    assert placement.restore_servers(manifest, 3) == [0, 1, 2]  # resharded over every server
    assert placement.restore_slice(manifest, 3, 2) == (2, 3)
    # entries that make no sense read as slice i on server i
    assert placement.recorded_placement({"num_servers": 2, "servers": [5, 5]}) == ([0, 1], 2)
