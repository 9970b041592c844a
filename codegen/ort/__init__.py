"""The ONNX Runtime kernel family: runs of cpu plan steps exported as ONNX graphs (onnx_ops.py, onnx_weights.py;
contrib ops such as MatMulNBits, ort_int8.py) and run as `ort.segment` steps (ort_lowering.py), the decode-only
steps as one decode graph (ort_decode.py), and the `llmc export --format onnx` exporter (onnx_export.py)."""
