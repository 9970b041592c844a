"""Code generation: static execution plans, memory planning, kernels."""
