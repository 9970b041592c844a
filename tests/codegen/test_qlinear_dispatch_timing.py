"""How the CPU qlinear's switch to the dense GEMM is timed (codegen/torch_cpu/cpu_qlinear_dense.measure_shape):
on one thread, whatever the caller's thread count (restored after), up to the largest probe; a
packed kernel that is faster at every probe is never switched away from, and one that is slower
everywhere gives way from the first row."""

import time

import torch

from llmc.codegen.torch_cpu import cpu_qlinear_dense as dense
from llmc.compiler.quant import quantize_int8


def int8_source(n=64, k=128):
    q, s = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(0)))
    return dense.dense_source("int8", q, s, None, None)


def test_a_packed_kernel_faster_everywhere_is_never_left():
    threads_seen = []
    record = dense.measure_shape(lambda x: threads_seen.append(torch.get_num_threads()), int8_source(), repeats=1)
    assert record["dense_from"] == dense.NEVER_DENSE
    assert list(record["us"]["packed"]) == [str(r) for r in dense.PROBE_ROWS]
    assert set(threads_seen) == {1}


def test_a_packed_kernel_slower_everywhere_gives_way_from_one_row():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        record = dense.measure_shape(lambda x: time.sleep(0.005), int8_source(), repeats=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    assert record["dense_from"] == 1 and list(record["us"]["dense"]) == ["1", "2"]
