"""ONNX initializer transforms (codegen/ort/onnx_weights.py) against their arithmetic definition, and a
segment builder's initializers made only when read."""

import pytest
import torch

from llmc.codegen.ort.onnx_ops import LazyInitializers
from llmc.codegen.ort.onnx_weights import initializer
from llmc.compiler.quant import unpack_int4


def test_nibble_halves_rebuild_every_int8_code():
    """q = 16 (h - 8) + l for every code -128..127 at every column parity, as MatMulNBits reads the
    high half (zero point 8, scales x16) and the low half (zero point 0)."""
    g = torch.Generator().manual_seed(0)
    q = torch.cat([torch.arange(-128, 128, dtype=torch.int8).reshape(2, 128),
                   torch.randint(-128, 128, (5, 128), generator=g, dtype=torch.int8)])
    high, low = unpack_int4(initializer(q, "high_nibbles")), unpack_int4(initializer(q, "low_nibbles"))
    assert high.max() <= 15 and low.max() <= 15
    assert torch.equal(16 * (high.to(torch.int16) - 8) + low.to(torch.int16), q.to(torch.int16))
    assert initializer(q, "high_nibbles", (7, 2, 32)).shape == (7, 2, 32)


def test_nibble_halves_refuse_what_they_cannot_split():
    with pytest.raises(ValueError, match="even number of columns"):
        initializer(torch.zeros(2, 5, dtype=torch.int8), "high_nibbles")
    with pytest.raises(ValueError, match="int8 codes"):
        initializer(torch.zeros(2, 4, dtype=torch.int16), "low_nibbles")


def test_lazy_initializers_make_each_tensor_once_when_read():
    made = []
    values = LazyInitializers()
    values.add("a", lambda: made.append("a") or torch.ones(2))
    values.add("b", lambda: made.append("b") or torch.zeros(3))
    assert sorted(values) == ["a", "b"] and len(values) == 2 and made == []
    assert torch.equal(values["b"], torch.zeros(3)) and values["b"] is values["b"]
    assert made == ["b"]
