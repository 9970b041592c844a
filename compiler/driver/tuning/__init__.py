"""Compile-time measurement: `--kernels auto` times candidate plans and their segments on the compiling
machine (running them through the runtime's executor), checks the accuracy of kernel choices on the
calibration text, and chooses. Codegen offers the candidates; nothing under codegen/ runs the runtime."""
