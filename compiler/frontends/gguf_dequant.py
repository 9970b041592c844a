"""Dequantise one GGUF tensor to float32 with whole-tensor torch ops: the formulas and the float32
operation order of gguf.quants.dequantize (the reference), so the result is bit-identical to it;
types without a torch version here go through the reference itself."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize as reference_dequantize

Q = GGMLQuantizationType


def dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """`tensor` as float32, in torch dimension order (GGUF lists dimensions innermost first)."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    block_fn = BLOCK_DEQUANTIZERS.get(tensor.tensor_type)
    if block_fn is None and tensor.tensor_type not in (Q.F32, Q.F16):
        values = np.array(reference_dequantize(tensor.data, tensor.tensor_type))
        return torch.from_numpy(values).reshape(shape)
    raw = torch.from_numpy(np.array(tensor.data).reshape(-1).view(np.uint8))  # a copy: the map is read-only
    if tensor.tensor_type == Q.F32:
        return raw.view(torch.float32).reshape(shape)
    if tensor.tensor_type == Q.F16:
        return raw.view(torch.float16).float().reshape(shape)
    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    return block_fn(raw.reshape(-1, type_size)).reshape(shape)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """One fp16 field per block, as float32 of shape (blocks, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's bytes split into low then high nibbles, `width` bytes at a time: (n, -1, width) uint8."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return ((packed.reshape(packed.shape[0], -1, 1, width) >> shifts) & 0x0F).reshape(packed.shape[0], -1, width)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 per block), as (n, 32) uint8."""
    word = qh.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((word >> torch.arange(32)) & 1).to(torch.uint8)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:], 16).reshape(blocks.shape[0], -1).to(torch.int8) - 8
    return _half(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:], 16).reshape(blocks.shape[0], -1).float()
    return (_half(blocks, 0) * q) + _half(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 6:], 16).reshape(blocks.shape[0], -1)
    q = (low | (_high_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return _half(blocks, 0) * q.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 8:], 16).reshape(blocks.shape[0], -1)
    q = (low | (_high_bits(blocks[:, 4:8]) << 4)).float()
    return (_half(blocks, 0) * q) + _half(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's eight 6-bit scales and mins per block, packed in 12 bytes (gguf's Q4_K.get_scale_min)."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    scale = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, minimum


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale, minimum = _k_scale_min(blocks[:, 4:16])
    d = (_half(blocks, 0) * scale.float()).reshape(n, -1, 1)
    dm = (_half(blocks, 2) * minimum.float()).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 32).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_half(blocks, 208) * scales).reshape(n, 16, 1)
    low = _nibbles(blocks[:, :128], 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, -1).float()).reshape(n, 256)


BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.BF16: _bf16, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k, Q.Q6_K: _q6_k,
}
