"""compiler/schemes.py's table agrees with what the code does: each row's dequantisation reference
inverts a quantisation of a random weight in the storage the row declares, the IR verifier and the
reference op accept that storage, each kernel family the row names has a kernel for it (and a family
it does not name refuses it), and every scheme a compile or an import can produce has a row."""

import pytest
import torch
import torch.nn.functional as F

from llmc.codegen.kernel_select import KERNEL_OPS
from llmc.codegen.native import cpu_native
from llmc.codegen.ort.ort_lowering import ort_refusal
from llmc.codegen.torch_cpu import cpu_kernels, cpu_qlinear, cpu_qlinear_a8
from llmc.codegen.torch_cpu.cpu_qlinear_native import native_gemv_weights
from llmc.compiler import quant
from llmc.compiler.frontends import load_model
from llmc.compiler.frontends.gguf_dequant import BLOCK_LAYOUTS
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.ops import OPS, qlinear_ref
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.recipes import KV_CACHE_CHOICES, QUANT_CHOICES, SOURCE_QUANT, quant_passes
from llmc.compiler.schemes import (
    FAMILIES,
    FP8_STATIC,
    INT_ZERO,
    KV_CACHE_FORMATS,
    NATIVE,
    ORT,
    SCHEMES,
    TORCH,
    TRITON,
)
from llmc.compiler.targets import get_target
from llmc.errors import IRError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import build_pipeline
from llmc.runtime.kv_quant import dequantize_kv, quantize_kv

N, K, GROUP = 48, 128, 32


def random_weight(seed: int) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.05


def affine_blocks(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w ≈ q * s + m in groups of GROUP along K, as a GGUF block with minimums stores it (float64 math)."""
    g = w.reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    levels = 2 ** bits - 1
    scales = ((hi - lo) / levels).float()
    low_code = 0 if bits == 4 else -128     # affine4 codes 0..15, affine8 -128..127
    mins = (lo - low_code * scales.double()).float()
    codes = ((g - mins.double()[..., None]) / scales.double()[..., None]).round().clamp(low_code, low_code + levels)
    codes = codes.reshape(N, K)
    stored = quant.pack_int4(codes.to(torch.uint8)) if bits == 4 else codes.to(torch.int8)
    return stored, scales, mins


def quantise(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight, scales, zeros) of w in scheme `name`, by the quantiser that makes that scheme."""
    row = SCHEMES[name]
    if row.gguf:
        return affine_blocks(w, row.bits)
    if row.zero_point == INT_ZERO:
        codes, scales, zeros = quant.quantize_int4(w, GROUP)
        return quant.pack_int4(codes), scales, zeros
    if row.code_dtype == "float8_e4m3fn":
        return quant.quantize_fp8(w) + (None,)
    return quant.quantize_int8(w) + (None,)


def qlinear_attrs(name: str, zeros) -> dict:
    row = SCHEMES[name]
    attrs = {"scheme": name, "in_features": K, "out_features": N, "has_zeros": zeros is not None}
    return attrs | ({"group_size": GROUP} if row.grouped else {})


@pytest.mark.parametrize("name", list(SCHEMES))
def test_dequantisation_reference_inverts_a_quantised_random_weight(name):
    row, w = SCHEMES[name], random_weight(1)
    qweight, scales, zeros = quantise(name, w)
    assert str(qweight.dtype).removeprefix("torch.") == row.code_dtype
    assert tuple(qweight.shape) == (N, K // row.codes_per_element)
    assert tuple(scales.shape) == ((N, K // GROUP) if row.grouped else (N,))
    assert (zeros is not None) == (row.zero_point != "none")
    back = row.dequantize(qweight, scales, zeros, torch.float64)
    step = scales.double().repeat_interleave(GROUP, 1) if row.grouped else scales.double()[:, None]
    # a code's rounding costs half a step; fp8's 3 mantissa bits cost 1/16 of the value
    bound = step * 0.5 + 1e-6 if name != "fp8" else w.abs() / 16 + step * 2 ** -9
    assert ((back - w).abs() <= bound).all()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_ir_takes_each_scheme_as_its_row_stores_it(name):
    row, w = SCHEMES[name], random_weight(2)
    qweight, scales, zeros = quantise(name, w)
    act_scale = torch.tensor([0.01]) if row.activations == FP8_STATIC else None
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    inputs = [x, qweight, scales] + [t for t in (zeros, act_scale) if t is not None]
    attrs = qlinear_attrs(name, zeros) | {"has_act_scale": act_scale is not None}
    types = [TensorType(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in inputs]
    assert OPS["qlinear"].infer(types, attrs)[0].shape == (3, N)
    y = qlinear_ref(*inputs, **attrs)[0]
    assert y.shape == (3, N)
    if row.activations == "float":
        torch.testing.assert_close(y, F.linear(x, row.dequantize(qweight, scales, zeros)), rtol=1e-5, atol=1e-5)
    assert OPS["qembedding"].attrs.required["scheme"].test(name) == row.qembedding
    assert OPS["qmoe"].attrs.required["scheme"].test(name) == row.qmoe


@pytest.mark.parametrize("name", [n for n, s in SCHEMES.items() if not s.grouped])
def test_one_scale_for_the_whole_weight_only_where_the_row_allows_it(name):
    qweight, scales, _ = quantise(name, random_weight(8))
    types = [TensorType((3, K), "float32"), TensorType(tuple(qweight.shape), SCHEMES[name].code_dtype),
             TensorType((1,), "float32")]
    attrs = qlinear_attrs(name, None)
    if SCHEMES[name].per_tensor:
        assert OPS["qlinear"].infer(types, attrs)[0].shape == (3, N)
    else:
        with pytest.raises(IRError):
            OPS["qlinear"].infer(types, attrs)


def qlinear_graph(name: str) -> tuple[Graph, object]:
    """One qlinear over random codes of `name` on [tokens, K] activations."""
    qweight, scales, zeros = quantise(name, random_weight(4))
    graph = Graph()
    graph.add_input("x", TensorType(("tokens", K), "float32"))
    inputs = ["x"]
    for part, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t is not None:
            graph.add_param(f"w.{part}", TensorType(tuple(t.shape), str(t.dtype).removeprefix("torch.")), t)
            inputs.append(f"w.{part}")
    attrs = qlinear_attrs(name, zeros)
    node = graph.make_node("qlinear", inputs, [TensorType(("tokens", N), "float32")], attrs)
    graph.nodes.append(node)
    graph.outputs = [node.outputs[0].name]
    graph.verify()
    return graph, node


def torch_serves(name: str) -> bool:
    """The torch family runs the qlinear kernel, and agrees with the reference, on this scheme."""
    graph, node = qlinear_graph(name)
    inputs = [graph.weights[i] if i in graph.params else None for i in node.inputs]
    fn = cpu_kernels.resolve_kernel("cpu.qlinear")
    prepared = fn.prepare(inputs, node.attrs)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    y = fn(x, *inputs[1:], **node.attrs, **prepared)[0]
    want = qlinear_ref(x, *inputs[1:], **node.attrs)[0]
    torch.testing.assert_close(y, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    return name in {**cpu_qlinear.PACKERS, **cpu_qlinear_a8.PACKERS}


def native_serves(name: str) -> bool:
    if not cpu_native.available():
        pytest.skip("the native kernels are not built on this machine")
    qweight, scales, zeros = quantise(name, random_weight(6))
    # a GGUF block may come without minimums (affine8's GEMV reads only those: Q8_0, Q5_0, Q6_K)
    forms = (zeros, None) if SCHEMES[name].gguf else (zeros,)
    return any(native_gemv_weights(name, qweight, scales, z) is not None for z in forms)


def ort_serves(name: str) -> bool:
    graph, node = qlinear_graph(name)
    return ort_refusal(node, graph) is None


def triton_serves(name: str) -> bool:
    graph, node = qlinear_graph(name)
    ins = [graph.type_of(i) for i in node.inputs]
    return bool(KERNEL_OPS["qlinear"](node.attrs, ins, [node.outputs[0].type], "h100", {}, None))


SERVES = {TORCH: torch_serves, NATIVE: native_serves, ORT: ort_serves, TRITON: triton_serves}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_family_has_a_kernel_for_exactly_the_schemes_its_rows_name(name, family):
    claimed = family in SCHEMES[name].families
    try:
        served = SERVES[family](name)
    except (ValueError, KeyError, AssertionError):      # a family without the scheme may refuse it so
        if claimed:
            raise
        served = False
    assert served == claimed


@pytest.fixture(scope="module")
def lowered():
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


@pytest.mark.parametrize("choice", [q for q in QUANT_CHOICES if q not in (SOURCE_QUANT, "none")])
def test_every_quant_choice_makes_schemes_with_a_row(lowered, choice):
    graph = lowered.copy()
    configs = quant_passes(choice, 64 if choice.startswith("int4") else None)
    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, 512, (16,), generator=g) for _ in range(2)]
    target = get_target("cpu")
    PassManager(build_pipeline(configs), PassContext(target=target, calibration=calibration, quiet=True)).run(graph)
    made = {n.attrs["scheme"] for n in graph.nodes if "scheme" in n.attrs}
    assert made and made <= set(SCHEMES)
    graph.verify()


def test_every_imported_block_format_has_a_gguf_row():
    assert {scheme for scheme, _, _ in BLOCK_LAYOUTS.values()} == {s.name for s in SCHEMES.values() if s.gguf}


@pytest.mark.parametrize("name", [n for n, f in KV_CACHE_FORMATS.items() if f.static])   # int4: test_kv_int4.py
def test_kv_cache_formats_round_trip_as_the_runtime_stores_them(name):
    fmt = KV_CACHE_FORMATS[name]
    assert name in KV_CACHE_CHOICES
    x = torch.randn(7, 2, 16, generator=torch.Generator().manual_seed(7))
    scale = x.abs().amax(dim=(0, 2)) / fmt.qmax
    codes = quantize_kv(x, scale, fmt.torch_dtype)
    assert codes.dtype == fmt.torch_dtype and str(codes.dtype).removeprefix("torch.") == fmt.storage
    back = dequantize_kv(codes, scale)
    torch.testing.assert_close(back, quant.fake_quant_kv(x, scale, fmt.storage), rtol=0, atol=0)
    assert ((back - x).abs() <= x.abs() / 8 + scale[:, None] * 0.5 + 1e-6).all()
