"""AWQ (Lin et al. 2023, arXiv:2306.00978): scale the salient input channels of a linear up
before int4 rounding and fold the inverse scale into the op that produces its input; the scale
exponent and a per-group clipping range are searched on calibration inputs. Pure torch, no
pass registered; the int4 pass calls it."""

from __future__ import annotations

import torch

from llmc.compiler.quant import compute_dtype, fast_bf16, int4_grid, quantize_to_grid
from llmc.errors import PassError
from llmc.passes.gptq import resolve_group_size


def awq_scales(x_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-input-channel scales s = mean|x|^alpha [K], normalised so max·min = 1 (AWQ's choice,
    which keeps W·s near W's magnitude); alpha = 0 gives exactly 1."""
    s = x_mean_abs.clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def awq_search_shared(weights: list[torch.Tensor], x_mean_abs: torch.Tensor,
                      x_sample: torch.Tensor, *, bits: int = 4, group_size: int = 128,
                      grid: int = 20) -> torch.Tensor:
    """One scale vector s [K] for linears that read the same input (q/k/v, gate/up): the
    alpha in {0, 1/grid, ..., (grid-1)/grid} minimising Σ ||X Wᵀ - (X/s) Q(W·s)ᵀ||² over
    all of `weights` [N_i, K], X = x_sample [tokens, K]."""
    _check_inputs(weights, x_mean_abs, x_sample, grid)
    dtype = compute_dtype(weights[0])
    g = resolve_group_size(x_mean_abs.numel(), group_size, "awq_search_shared")
    x = x_sample.reshape(-1, x_mean_abs.numel()).to(weights[0].device, dtype)
    weights = [w.to(x.device, dtype) for w in weights]
    x = x.to(_product_dtype(dtype))
    best_loss, best_s = None, None
    for step in range(grid):
        s = awq_scales(x_mean_abs.to(x.device, dtype), step / grid)
        loss = sum(_scaled_output_error(w, s, x, bits, g) for w in weights)
        if best_loss is None or loss < best_loss:
            best_loss, best_s = loss, s
    return best_s


def awq_clip_ratios(weight: torch.Tensor, x: torch.Tensor, *, bits: int = 4,
                    group_size: int = 128, grid: int = 20, max_shrink: float = 0.5
                    ) -> torch.Tensor:
    """AWQ's auto-clip: per (output row, group) the factor r in {1, 1 - 1/grid, ...} (down to
    1 - max_shrink, exclusive) by which to shrink the group's [min, max] before building its
    grid, minimising the group's share of the output error on inputs x [tokens, K]. (AWQ
    shrinks a symmetric ±max|w|; on our asymmetric grid shrinking both ends is the analogue.)
    Returns r [N, K/g]."""
    n, k = weight.shape
    g = resolve_group_size(k, group_size, "awq_clip_ratios")
    groups = weight.reshape(n, k // g, g)
    xg = x.reshape(-1, k // g, g).to(weight.device, weight.dtype)
    gram = torch.einsum("tgi,tgj->gij", xg, xg)     # [K/g, g, g]
    best_err = torch.full((n, k // g), float("inf"), dtype=weight.dtype, device=weight.device)
    best = torch.ones_like(best_err)
    for step in range(int(max_shrink * grid)):
        ratio = 1 - step / grid
        diff = groups - _fake_quantize_groups(groups, bits, ratio)
        err = ((diff.transpose(0, 1) @ gram) * diff.transpose(0, 1)).sum(-1).T   # [N, K/g]
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, ratio, best)
    return best


def awq_quantize_with_scales(weight: torch.Tensor, channel_scales: torch.Tensor,
                             x_sample: torch.Tensor, *, bits: int = 4, group_size: int = 128,
                             clip: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise W·s group-wise (with auto-clip when `clip`): (q uint8 [N, K], scales, zeros
    fp32 [N, K/g]). The caller divides this linear's input by s (see awq_quantize_weight)."""
    _check_inputs([weight], channel_scales, x_sample, 1)
    dtype = compute_dtype(weight)
    n, k = weight.shape
    g = resolve_group_size(k, group_size, "awq_quantize_with_scales")
    s = channel_scales.to(weight.device, dtype)
    scaled = weight.to(dtype) * s
    groups = scaled.reshape(n, k // g, g)
    ratio = torch.ones(n, k // g, dtype=dtype, device=weight.device)
    if clip:
        x = x_sample.reshape(-1, k).to(weight.device, dtype) / s
        ratio = awq_clip_ratios(scaled, x, bits=bits, group_size=g)
    scales, zeros = int4_grid(groups * ratio[..., None], bits)
    q = quantize_to_grid(groups, scales, zeros, bits)
    return q.reshape(n, k).to(torch.uint8), scales, zeros


def awq_quantize_weight(weight: torch.Tensor, x_mean_abs: torch.Tensor, x_sample: torch.Tensor,
                        *, bits: int = 4, group_size: int = 128, grid: int = 20, clip: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], x_mean_abs [K] (mean |x| per input channel over calibration), x_sample
    [tokens, K] -> (q, scales, zeros) of W·s and s [K]. y = (x / s) · dequant(q)ᵀ ≈ x Wᵀ: the
    caller folds 1/s into the producer of x (an rms_norm's weight times 1/s; a preceding
    linear's output rows divided by s). Linears sharing an input must share s: use
    awq_search_shared, then awq_quantize_with_scales for each."""
    s = awq_search_shared([weight], x_mean_abs, x_sample, bits=bits, group_size=group_size,
                          grid=grid)
    q, scales, zeros = awq_quantize_with_scales(weight, s, x_sample, bits=bits,
                                                group_size=group_size, clip=clip)
    return q, scales, zeros, s.float()


def _fake_quantize_groups(groups: torch.Tensor, bits: int, ratio=1.0) -> torch.Tensor:
    """groups [N, K/g, g] rounded onto their min/max grid (range shrunk by `ratio`)."""
    scales, zeros = int4_grid(groups if isinstance(ratio, float) and ratio == 1.0 else groups * ratio, bits)
    s, z = scales.to(groups.dtype)[..., None], zeros.to(groups.dtype)[..., None]
    # quantize_to_grid's codes, dequantised: the same operations in place on one temporary
    return torch.div(groups, s).round_().add_(z).clamp_(0, 2 ** bits - 1).sub_(z).mul_(s)


def _product_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the search multiplies in: bf16 (AMX on CPUs that have it: ~4x fp32's GEMM) for fp32 weights where
    the CPU multiplies bf16 in hardware (fast_bf16; fp32 elsewhere), float64 for float64 ones. The
    products are of the rounding error itself (x Dᵀ, D = Q(w·s)/s - w), not a difference of two outputs,
    so bf16's 2^-9 per factor perturbs each error term by about that share, and the sum over tokens x
    outputs far less: the grid's choice stands."""
    return torch.bfloat16 if dtype == torch.float32 and fast_bf16() else dtype


def _scaled_output_error(w, s, x, bits, g) -> float:
    """||x wᵀ - (x/s) Q(w·s)ᵀ||², computed as ||x Dᵀ||², D = Q(w·s)/s - w, in x's dtype (_product_dtype)."""
    n, k = w.shape
    d = _fake_quantize_groups((w * s).reshape(n, k // g, g), bits).reshape(n, k).div_(s).sub_(w)
    return (x @ d.to(x.dtype).T).float().pow(2).sum().item()


def _check_inputs(weights, x_mean_abs, x_sample, grid) -> None:
    k = x_mean_abs.numel()
    if x_mean_abs.dim() != 1 or x_sample.shape[-1] != k:
        raise PassError(f"awq: x_mean_abs (or channel scales) {tuple(x_mean_abs.shape)} and x_sample "
                        f"{tuple(x_sample.shape)} disagree; expected [K] and [tokens, K] from "
                        f"the same linear input")
    bad = [tuple(w.shape) for w in weights if w.dim() != 2 or w.shape[1] != k]
    if not weights or bad:
        raise PassError(f"awq: weights {bad or '[]'} do not read an input of {k} features; "
                        f"pass the [N, {k}] weights of the linears fed by this activation")
    if grid < 1:
        raise PassError(f"awq: grid={grid}; use a positive number of alpha steps (e.g. 20)")
