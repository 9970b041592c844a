"""Tile shapes and launch settings of llmc's Triton GEMM kernels for each GPU family, the constants
a kernel template is rendered with for one target; the caller records the chosen config."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
    family = target.split("-", 1)[0]
    if family not in TILE_CONFIGS:
        raise TargetError(f"no Triton tile config for target {target!r}; "
                          f"known GPU families: {', '.join(TILE_CONFIGS)}")
    return TILE_CONFIGS[family]


__all__ = ["TileConfig", "TILE_CONFIGS", "tile_config"]
