"""The native C kernel family: kernels in C (decode attention, norms, int8/int4/fp32 GEMVs, the
whole-layer decode program) built for this machine at first use and cached (cpu_native.py, codegen/native_cache.py);
the torch CPU family and the runtime's native decode program call them where they run."""
