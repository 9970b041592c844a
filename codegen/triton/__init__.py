"""The Triton kernel family (GPU targets, and Triton's interpreter on the CPU): jinja2 templates under
templates/ rendered with one target's constants (triton_render.py) into the kernels of plan steps named
`triton.<op>` (triton_kernels.py: GEMMs, attention, elementwise, MoE), launched with the configs of
triton_configs.py."""
