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


def test_the_dispatch_is_timed_on_the_plans_4bit_activations(monkeypatch):
    """A plan whose 4-bit GEMVs take int8 activations is timed on those (many rows then run the AMX GEMM on the
    stored codes), and the timing cache keeps them apart from int16 ones"""
    from llmc.codegen.native import cpu_native
    from llmc.compiler.driver.tuning import qlinear_dispatch
    from llmc.compiler.quant import pack_int4

    seen = []
    monkeypatch.setattr(qlinear_dispatch, "_recalled_measure",
                        lambda key, kind, threads, run, src, rows: seen.append((kind, run)) or {"dense_from": 1})
    g = torch.Generator().manual_seed(3)
    codes, scales = pack_int4(torch.randint(0, 16, (64, 256), generator=g, dtype=torch.uint8)), torch.rand(64, 8) + 0.1
    zeros = torch.full((64, 8), 8.0)
    weights = {"w": codes, "s": scales, "z": zeros}
    attrs = {"scheme": "int4", "group_size": 32, "has_zeros": True, "in_features": 256}
    step = ("cpu.qlinear", ["x", "w", "s", "z"], attrs)
    for q4 in ("int16", "int8"):
        qlinear_dispatch.dispatch_record([step], weights, 1, meta={"q4_activations": q4})
    assert [kind.split()[-1] for kind, _ in seen] == ["int16", "int8"]
    if cpu_native.int16_activations() and cpu_native.amx_ready():
        x = torch.randn(24, 256, generator=g)
        int8_run = seen[1][1]
        stored = cpu_native.gemm_q4_stored(x, cpu_native.q4_weights(codes, scales, zeros, True, "int8"))
        assert torch.equal(int8_run(x), stored)
