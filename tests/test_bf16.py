"""protos/codec.py's dtype tables and bfloat16: every conversion rounds and widens as torch's
own ``bfloat16`` does, bit for bit (ties to even, subnormals, infinities, NaN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb


def test_dtype_tables() -> None:
    for code, (name, np_dtype) in codec.WIRE_DTYPES.items():
        assert codec.wire_dtype(name) == code
        assert codec.dtype_name(code) == name
        assert codec.numpy_dtype(code) == np_dtype
        assert np_dtype.byteorder in ("<", "=", "|") or np_dtype.itemsize == 1
    assert codec.numpy_dtype(pb.BFLOAT16) == np.dtype("<u2")
    with pytest.raises(ValueError, match="bogus"):
        codec.wire_dtype("bogus")
    with pytest.raises(ValueError, match="99"):
        codec.dtype_name(99)
    with pytest.raises(ValueError, match="unknown wire dtype 0"):
        codec.numpy_dtype(pb.DTYPE_UNSPECIFIED)


def torch_bf16_bits(values: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def assert_bf16_like_torch(bits_f32: np.ndarray) -> None:
    values = bits_f32.astype(np.uint32).view(np.float32)
    ours = codec.f32_to_bf16_bits(values)
    assert ours.dtype == np.uint16 and ours.shape == values.shape
    theirs = torch_bf16_bits(values)
    nan = np.isnan(values)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    # NaN stays NaN (exponent all ones, mantissa non-zero) and keeps its sign
    assert np.all((ours[nan] & 0x7F80) == 0x7F80) and np.all((ours[nan] & 0x7F) != 0)
    np.testing.assert_array_equal(ours[nan] >> 15, bits_f32[nan].astype(np.uint32) >> 31)


def test_bf16_every_upper_half_with_critical_lower_halves() -> None:
    """All 65536 bf16 patterns x the lower halves that decide rounding (ties, just off ties)."""
    upper = np.arange(2**16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], dtype=np.uint32)
    assert_bf16_like_torch((upper[:, None] | lows[None, :]).reshape(-1))


def test_bf16_ties_to_even() -> None:
    cases = {
        0x3F808000: 0x3F80,  # 1 + 2^-8: halfway, lower neighbour is even -> down
        0x3F818000: 0x3F82,  # halfway, lower neighbour odd -> up to even
        0x3F808001: 0x3F81,  # just above halfway -> up
        0x3F807FFF: 0x3F80,  # just below halfway -> down
        0xBF818000: 0xBF82,  # negative, same rule on the magnitude
        0x7F7FFFFF: 0x7F80,  # the largest float32 rounds to +inf, as torch does
        0x00008000: 0x0000,  # subnormal tie rounds to even (zero)
        0x00018000: 0x0002,
    }
    bits = np.array(list(cases), dtype=np.uint32)
    got = codec.f32_to_bf16_bits(bits.view(np.float32))
    assert [hex(v) for v in got] == [hex(v) for v in cases.values()]
    assert_bf16_like_torch(bits)


def test_bf16_special_values() -> None:
    values = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, 3.4e38], dtype=np.float32
    )
    bits = codec.f32_to_bf16_bits(values)
    back = codec.bf16_bits_to_f32(bits)
    assert back.dtype == np.float32
    assert bits[0] == 0x0000 and bits[1] == 0x8000
    assert back[2] == np.inf and back[3] == -np.inf
    assert np.isnan(back[4]) and np.isnan(back[5])
    assert_bf16_like_torch(values.view(np.uint32))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_hypothesis_bf16_rounding_matches_torch(raw_bits: list[int]) -> None:
    assert_bf16_like_torch(np.array(raw_bits, dtype=np.uint32))


def test_bf16_bits_to_f32_is_exact_for_every_pattern() -> None:
    bits = np.arange(2**16, dtype=np.uint16)
    ours = codec.bf16_bits_to_f32(bits)
    theirs = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    # and converting back is the identity except for NaN payloads
    again = codec.f32_to_bf16_bits(ours)
    finite = ~np.isnan(ours)
    np.testing.assert_array_equal(again[finite], bits[finite])


def test_bf16_accepts_non_contiguous_and_float64_input() -> None:
    values = np.linspace(-3, 3, 40, dtype=np.float64)[::3]
    np.testing.assert_array_equal(
        codec.f32_to_bf16_bits(values), torch_bf16_bits(values.astype(np.float32))
    )
