"""Whether this machine's ONNX Runtime multiplies uint8 x int8 MatMulInteger exactly. With VNNI
(AVX512-VNNI or AVX-VNNI) MLAS sums u8 x s8 products straight into int32; without it, its AVX2
kernel adds pairs of products in saturating int16 (255 * 127 * 2 > 32767), which is off by up to
10^5 for codes near the ends of their range. u8 x s8 runs 2.6x the u8 x u8 kernel (SmolLM2's
512 x 576 x 1536 on a 2-core Zen 4: 706 vs 273 GOP/s), so w8a8 segments take it where it is exact,
and a segment that takes it refuses to load where it is not. The answer comes from running the
kernel at the codes that would saturate, not from reading CPU flags: MLAS picks its kernel by
its own dispatch, which is what has to be right."""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=1)
def signed_int8_exact() -> bool:
    """True when uint8 x int8 MatMulInteger is exact here, at a GEMV and a GEMM shape."""
    import onnxruntime  # onnxruntime: `llmc --help` and the engine import this module
    from onnx import TensorProto, helper, numpy_helper  # onnx: the same

    k, n = 256, 16
    rng = np.random.default_rng(0)
    # the extremes (every pair sum saturates int16) beside random codes
    b = np.concatenate([np.full((k, n // 2), 127, np.int8), rng.integers(-127, 128, (k, n // 2), dtype=np.int8)], 1)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "u8s8_probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", n])], [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for m in (1, 64):
        a = np.concatenate([np.full((m, k // 2), 255, np.uint8), rng.integers(0, 256, (m, k // 2), dtype=np.uint8)], 1)
        (got,) = session.run(None, {"a": a})
        if not np.array_equal(got.astype(np.int64), a.astype(np.int64) @ b.astype(np.int64)):
            return False
    return True


__all__ = ["signed_int8_exact"]
