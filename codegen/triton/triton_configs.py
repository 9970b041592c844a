"""Tile shapes and launch settings of llmc's Triton GEMM kernels for each GPU family, the constants
a kernel template is rendered with for one target; the caller records the chosen config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from llmc.errors import TargetError


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot_precision: str = "tf32"   # tl.dot input_precision for fp32 operands: "tf32" or "ieee"

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            # tl.dot needs power-of-two tiles of at least 16 along every dimension
            assert size >= 16 and size & (size - 1) == 0, f"{name}={size}"
        assert self.dot_precision in ("tf32", "ieee"), self.dot_precision

    def to_dict(self) -> dict:
        return asdict(self)


# Starting points from common Triton GEMM autotune spaces for each architecture (not yet tuned
# on the hardware): big tiles and deep pipelines where shared memory allows (sm_90, sm_80),
# smaller ones on sm_89's 100 KB and on Orin.
TILE_CONFIGS: dict[str, TileConfig] = {
    "h100": TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
    "a100": TileConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=4),
    "rtx4090": TileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3),
    "orin": TileConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2),
}


def tile_config(target: str) -> TileConfig:
    """The config for a GPU family ("h100") or a target named after one ("h100-fp8")."""
    return _for_family(TILE_CONFIGS, target, "tile")


@dataclass(frozen=True)
class RowConfig:
    """Launch settings of the row-wise kernels (RMSNorm, SwiGLU, rotary, per-token int8
    quantisation), which touch each element once and are bound by memory bandwidth."""
    warp_elements: int        # a program gets one warp per this many elements it holds ...
    max_warps: int            # ... up to this many
    swiglu_block: int         # intermediate columns one SwiGLU program covers
    rotary_heads: int         # heads one rotary program rotates
    max_row: int = 65536      # the longest row RMSNorm and the int8 quantiser hold in one program

    def __post_init__(self):
        for name in ("warp_elements", "max_warps", "swiglu_block", "rotary_heads", "max_row"):
            size = getattr(self, name)
            assert size >= 1 and size & (size - 1) == 0, f"{name}={size}"  # tl.arange needs powers of two

    def num_warps(self, elements: int) -> int:
        """Warps for a program holding `elements` values: a power of two in 1..max_warps."""
        warps = max(1, min(self.max_warps, elements // self.warp_elements))
        return 1 << (warps.bit_length() - 1)

    def to_dict(self) -> dict:
        return asdict(self)


# Starting points (not yet tuned on the hardware): eight elements a thread, as fused-norm kernels
# commonly take; fewer warps a program on sm_89 and Orin, whose SMs hold fewer threads.
ROW_CONFIGS: dict[str, RowConfig] = {
    "h100": RowConfig(warp_elements=256, max_warps=16, swiglu_block=1024, rotary_heads=4),
    "a100": RowConfig(warp_elements=256, max_warps=16, swiglu_block=1024, rotary_heads=4),
    "rtx4090": RowConfig(warp_elements=256, max_warps=8, swiglu_block=1024, rotary_heads=4),
    "orin": RowConfig(warp_elements=256, max_warps=4, swiglu_block=512, rotary_heads=2),
}


def row_config(target: str) -> RowConfig:
    """The row-kernel config for a GPU family or a target named after one, as tile_config."""
    return _for_family(ROW_CONFIGS, target, "row-kernel")


@dataclass(frozen=True)
class AttentionConfig:
    """Launch settings of the attention kernels (codegen/triton/triton_attention.py) for one GPU family."""
    block_m: int           # prefill: query rows per program
    block_n: int           # prefill: keys per inner step
    num_warps: int
    num_stages: int
    decode_block_n: int    # decode: keys per inner step
    decode_num_warps: int
    decode_num_stages: int
    split_keys: int        # decode: a split-K partition covers at least this many keys
    max_splits: int
    num_sms: int           # decode stops splitting once batch * kv_heads * splits programs fill the SMs

    def __post_init__(self):
        for name in ("block_m", "block_n", "decode_block_n"):
            size = getattr(self, name)
            assert size >= 16 and size & (size - 1) == 0, f"{name}={size}"  # tl.dot tiles
        assert self.split_keys >= self.decode_block_n and self.max_splits >= 1, self

    def to_dict(self) -> dict:
        return asdict(self)


# Starting points after FlashAttention-2 / flash-decoding practice (not yet tuned on the hardware):
# 128-row query tiles with 8 warps where registers and shared memory allow (sm_90, sm_80), 64-row
# ones on sm_89 and Orin; decode is memory bound, so small key tiles and splits of a few hundred keys.
ATTENTION_CONFIGS: dict[str, AttentionConfig] = {
    "h100": AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, decode_block_n=64,
                            decode_num_warps=4, decode_num_stages=2, split_keys=256, max_splits=16, num_sms=132),
    "a100": AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, decode_block_n=64,
                            decode_num_warps=4, decode_num_stages=2, split_keys=256, max_splits=16, num_sms=108),
    "rtx4090": AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, decode_block_n=32,
                               decode_num_warps=4, decode_num_stages=2, split_keys=256, max_splits=16, num_sms=128),
    "orin": AttentionConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, decode_block_n=32,
                            decode_num_warps=4, decode_num_stages=2, split_keys=512, max_splits=8, num_sms=16),
}


def attention_config(target: str) -> AttentionConfig:
    """The attention config for a GPU family or a target named after one, as tile_config."""
    return _for_family(ATTENTION_CONFIGS, target, "attention")


def block_size(n: int) -> int:
    """The smallest power of two >= n: the tl.arange that covers n elements."""
    return 1 << max(n - 1, 0).bit_length()


def _for_family(configs: dict, target: str, what: str):
    family = target.split("-", 1)[0]
    if family not in configs:
        raise TargetError(f"no Triton {what} config for target {target!r}; "
                          f"known GPU families: {', '.join(configs)}")
    return configs[family]


# --autotune's candidates (codegen/autotune.py), each family's default first: smaller tiles for
# decode-sized M, larger ones with more warps for prefill-sized M, shallower or deeper pipelines.
GEMM_CANDIDATES: dict[str, list[TileConfig]] = {
    "h100": [TILE_CONFIGS["h100"], TileConfig(128, 128, 64, 8, 3), TileConfig(32, 64, 128, 4, 4),
             TileConfig(64, 64, 64, 4, 3)],
    "a100": [TILE_CONFIGS["a100"], TileConfig(128, 128, 32, 8, 3), TileConfig(32, 64, 64, 4, 4),
             TileConfig(64, 64, 64, 4, 3)],
    "rtx4090": [TILE_CONFIGS["rtx4090"], TileConfig(64, 64, 32, 4, 3), TileConfig(16, 64, 128, 4, 3),
                TileConfig(64, 128, 32, 4, 2)],
    "orin": [TILE_CONFIGS["orin"], TileConfig(16, 64, 64, 4, 2), TileConfig(64, 64, 32, 4, 2)],
}
ATTENTION_CANDIDATES: dict[str, list[AttentionConfig]] = {
    family: list(dict.fromkeys([config, replace(config, block_m=64, num_warps=4),
                                replace(config, block_n=32, num_stages=2),
                                replace(config, decode_block_n=32, decode_num_warps=2)]))  # drop repeats
    for family, config in ATTENTION_CONFIGS.items()
}


def gemm_candidates(target: str) -> list[TileConfig]:
    return _for_family(GEMM_CANDIDATES, target, "GEMM candidate")


def attention_candidates(target: str) -> list[AttentionConfig]:
    return _for_family(ATTENTION_CANDIDATES, target, "attention candidate")


__all__ = ["TileConfig", "TILE_CONFIGS", "tile_config", "RowConfig", "ROW_CONFIGS", "row_config",
           "AttentionConfig", "ATTENTION_CONFIGS", "attention_config", "block_size", "GEMM_CANDIDATES",
           "ATTENTION_CANDIDATES", "gemm_candidates", "attention_candidates"]
