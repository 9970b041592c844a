"""How this machine's ONNX Runtime rounds a MatMulNBits row by the number of rows in the call. MLAS
multiplies one row through its GEMV path and more through its GEMM path; measured with ORT 1.32 on a
Zen 3 (AVX2, no VNNI), a row alone differs in its last bits from the same row among others, at accuracy
levels 1 and 4, while every call of 2 to 600 rows gives it the same bits (on an AVX-512 Xeon level 4 gave
the same bits at 1 to 40 rows). Batch-invariant runs therefore give a one-row call a second row where
`row_rounding` says "single" (runtime/ort_segment.py). As with ort_int8, the answer comes from running the
kernel: MLAS picks its path by its own dispatch, which is what has to be measured."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SAME = "same"        # a row gets the same bits at any row count
SINGLE = "single"    # a one-row call rounds apart; calls of 2+ rows agree with each other
VARIES = "varies"    # calls of 2+ rows disagree too


@lru_cache(maxsize=None)
def row_rounding(level: int, k: int = 256, n: int = 64, block: int = 32) -> str:
    """SAME, SINGLE or VARIES for 4-bit MatMulNBits at `level` (accuracy_level) on this machine, from
    random codes and activations: every row alone, and row windows of several sizes, against one call
    of all the rows."""
    import onnxruntime  # onnxruntime: `llmc --help` and the engine import this module
    from onnx import TensorProto, helper, numpy_helper  # onnx: the same

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    scales = ((rng.random(n * k // block) + 0.5) / 64).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], domain="com.microsoft", K=k, N=n,
                            bits=4, block_size=block, accuracy_level=level)
    graph = helper.make_graph([node], "nbits_rows_probe", [helper.make_tensor_value_info("a", TensorProto.FLOAT,
                                                                                         ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(codes, "b"), numpy_helper.from_array(scales, "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    a = rng.standard_normal((48, k)).astype(np.float32)
    (together,) = session.run(None, {"a": a})
    windows = [(start, rows) for rows in (2, 3, 7, 16, 33) for start in (0, 5, 48 - rows)]
    if any(not np.array_equal(session.run(None, {"a": a[s:s + r]})[0], together[s:s + r]) for s, r in windows):
        return VARIES
    alone = all(np.array_equal(session.run(None, {"a": a[i:i + 1]})[0], together[i:i + 1]) for i in range(8))
    return SAME if alone else SINGLE


def nbits_levels(model: bytes) -> frozenset[int]:
    """The accuracy levels of an ONNX model's MatMulNBits nodes (0 where unset, as ORT reads it)."""
    import onnx  # onnx: only plans with ORT segments reach this

    return frozenset(next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
                     for node in onnx.load_from_string(model).graph.node if node.op_type == "MatMulNBits")


__all__ = ["SAME", "SINGLE", "VARIES", "row_rounding", "nbits_levels"]
