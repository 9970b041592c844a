"""The torch CPU kernel family: plan steps named `cpu.<op>` run as torch operators, with packed int8/int4,
w8a8/fp8 and native-GEMV paths for `qlinear`, MoE, and the collectives and point-to-point ops of ranks."""
