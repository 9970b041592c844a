"""GPTQ (Frantar et al. 2022, arXiv:2210.17323): quantise a linear's weight column by column,
spreading each column's rounding error over the columns not yet quantised through the inverse
Hessian of its calibration inputs. Pure torch, no pass registered; the int4 pass calls it."""

from __future__ import annotations

import threading

import numpy as np
import torch

from llmc.compiler.quant import compute_dtype, int4_grid, int4_grid_of_range
from llmc.errors import PassError


class HessianAccumulator:
    """Streams a linear's inputs into H = XᵀX / n (the Hessian of GPTQ's layer-wise objective,
    up to a factor 2), summed in float64 so millions of calibration tokens lose nothing."""

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.in_features = in_features
        self.tokens = 0
        self._sum = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        """x: [..., in_features], the inputs of one calibration batch."""
        if x.shape[-1] != self.in_features:
            raise PassError(f"HessianAccumulator.add: activations have {x.shape[-1]} features, "
                            f"the linear has in_features={self.in_features}; capture the "
                            f"linear's input, not its output")
        x = x.reshape(-1, self.in_features).to(self._sum.device, torch.float64)
        self._sum.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """[in_features, in_features] float64."""
        if self.tokens == 0:
            raise PassError("HessianAccumulator.hessian: no calibration tokens were added; "
                            "run calibration text through the model before GPTQ")
        return self._sum / self.tokens


def resolve_group_size(in_features: int, group_size: int, where: str) -> int:
    """group_size -1 means one group per output channel; otherwise it must divide K."""
    if group_size == -1:
        return in_features
    if group_size <= 0 or in_features % group_size:
        raise PassError(f"{where}: group_size={group_size} does not divide in_features="
                        f"{in_features}; pick a divisor of {in_features} (e.g. 32, 64, 128) or -1")
    return group_size


def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, *, bits: int = 4,
                         group_size: int = 128, act_order: bool = False, damp: float = 0.01,
                         block_size: int = 128, tokens: int | None = None, clip: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] (XᵀX / n) -> (q uint8 [N, K], scales, zeros fp32 [N, K/g]).

    `tokens`, the n the Hessian was estimated from, adds K / n to the dampening: a K x K
    Hessian from few tokens (n near or below K) is noisy or singular, and GPTQ then fits the
    calibration text's noise. On SmolLM2 with 1,024 self-generated tokens, plain damp 0.01 gave
    each linear's output error on held-out text 2-40% above RTN's (down_proj, K=1536: 0.130 vs
    0.093) while 3x below it on the calibration text; damp 0.01 + K/n put every tested linear
    6-37% below RTN on held-out text. With many tokens K/n vanishes: standard GPTQ.

    Works in float64 when `weight` is float64, else float32, the inverse Hessian's factor
    included, as GPTQ's reference code does (the Hessian is accumulated in float64): on
    SmolLM2's int4-gptq compile float64 factors took 6 of its 22 s (30 of them at K = 1536: 0.19
    s each on one thread) for a calibration KL of 0.1703 against float32's 0.1669. With act_order
    the columns are visited in descending Hessian diagonal (the
    most-used inputs first, while many columns remain to absorb their error), but the groups
    stay the contiguous K-slices of the storage format ("static groups": there is no g_idx
    permutation in our format); a group's scale and zero are fixed when the first of its
    columns comes up, from the group's error-updated weights at that moment. With `clip` that
    grid's range is shrunk to the factor that minimises the group's rounding error weighted by
    the Hessian diagonal (see clipped_grid); without it, it is the min/max grid RTN uses."""
    _check_gptq_args(weight, hessian, bits, damp, block_size)
    n, k = weight.shape
    g = resolve_group_size(k, group_size, "gptq_quantize_weight")
    dtype = compute_dtype(weight)
    w = weight.to(dtype).clone()
    h = hessian.to(weight.device, torch.float64).clone()
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1.0      # an input that is always 0: any value works, quantise to 0
    w[:, dead] = 0.0
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order \
        else torch.arange(k, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_hessian_factor(h, damp + (k / tokens if tokens else 0.0), dtype).to(dtype)
    grid_of = (lambda cols, x: clipped_grid(x, h.diagonal()[cols].to(dtype), bits)) if clip \
        else (lambda cols, x: int4_grid(x, bits))
    codes, scales, zeros = _quantize_columns(w, hinv, perm, g, bits, block_size, grid_of)
    return codes[:, torch.argsort(perm)].to(torch.uint8), scales, zeros


def _check_gptq_args(weight, hessian, bits, damp, block_size) -> None:
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise PassError(f"gptq_quantize_weight: weight {tuple(weight.shape)} and hessian "
                        f"{tuple(hessian.shape)} do not match; expected weight [N, K] and "
                        f"hessian [K, K] from the linear's inputs")
    if not 2 <= bits <= 8:
        raise PassError(f"gptq_quantize_weight: bits={bits}; use 2..8 (int4: 4)")
    if damp < 0 or block_size < 1:
        raise PassError(f"gptq_quantize_weight: damp={damp}, block_size={block_size}; "
                        f"use damp >= 0 (typically 0.01) and block_size >= 1 (typically 128)")


def _inverse_hessian_factor(h: torch.Tensor, damp: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹, λ = damp · mean diag(H). Row i of U, scaled by
    1/U[i, i], is the OBS update of the not-yet-quantised columns when column i is fixed. Factored in
    `dtype` (the weights' compute dtype; float64 where float32's Cholesky fails)."""
    h = h.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    if dtype != torch.float64:
        chol, info = torch.linalg.cholesky_ex(h.to(dtype).flip(0, 1))
        if info.item() == 0:
            eye = torch.eye(h.shape[0], dtype=dtype, device=h.device)
            return torch.linalg.solve_triangular(chol, eye, upper=False).flip(0, 1)
    # With J the reversal, J H J = L Lᵀ (Cholesky), so H = R Rᵀ with R = J L J upper, and H⁻¹ = (R⁻¹)ᵀ R⁻¹:
    # U = R⁻¹ = J L⁻¹ J, one factorisation and one triangular solve. (Cholesky, its inverse and a second
    # Cholesky took 178 ms at K = 1536, this 137 ms; the same U to 5e-16.)
    chol, info = torch.linalg.cholesky_ex(h.flip(0, 1))
    if info.item() == 0:
        eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
        chol = torch.linalg.solve_triangular(chol, eye, upper=False).flip(0, 1)
    if info.item() != 0:
        raise PassError(f"gptq: the calibration Hessian is not positive definite after "
                        f"dampening with damp={damp}; raise the gptq damp option (e.g. 0.1) "
                        f"or calibrate on more tokens")
    return chol


def _group_starts(perm: torch.Tensor, g: int) -> dict[int, tuple[int, torch.Tensor]]:
    """Visiting position of each group's first column -> (group, positions of its columns)."""
    position = torch.argsort(perm)
    starts = {}
    for grp in range(perm.numel() // g):
        cols = position[grp * g:(grp + 1) * g]
        starts[int(cols.min())] = (grp, cols)
    return starts


def clipped_grid(x: torch.Tensor, importance: torch.Tensor, bits: int = 4, steps: int = 100,
                 max_shrink: float = 0.8, coarse: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) [N] of the min/max grid of x [N, g] shrunk, per row, by the factor
    1 - step/steps (0 <= step < max_shrink·steps) minimising Σ_j importance_j (x_j - x̂_j)²:
    a weight's rounding error costs the layer output in proportion to its input's energy
    H_jj, and clipping a rare outlier buys every other weight of the group a finer step.

    Coarse to fine: every `coarse`-th step first, then the steps within coarse - 1 of each
    row's best (first best on ties, the largest range, in each round): 20 + 6 grids instead of
    80 (the search was 29% of an int4-gptq compile of SmolLM2); it returns the exhaustive
    search's factor wherever that lies within coarse - 1 steps of the best coarse one. Each
    round makes its grids in one go ([factors, N]; rounding is monotonic, so the shrunk rows'
    extremes are the shrunk extremes, bit for bit) and scores them all with one pass of
    in-place operations over [factors, N, g] and one product with the importances."""
    lo, hi = x.amin(1), x.amax(1)
    last = int(max_shrink * steps) - 1
    step = torch.arange(0, last + 1, coarse, device=x.device)[:, None].expand(-1, x.shape[0])
    best, err = _best_steps(x, importance, lo, hi, step, steps, bits)
    if coarse > 1:
        offsets = torch.tensor([o for o in range(-coarse + 1, coarse) if o], device=x.device)
        fine = (best[None] + offsets[:, None]).clamp(0, last)
        fine_best, fine_err = _best_steps(x, importance, lo, hi, fine, steps, bits)
        # a tie goes to the smaller step (the larger range), as in one exhaustive pass
        take = (fine_err < err) | ((fine_err == err) & (fine_best < best))
        best = torch.where(take, fine_best, best)
    factors = _factors(best[None], steps, x.dtype)[0]
    return int4_grid_of_range(lo * factors, hi * factors, bits)


def _factors(step: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """1 - step/steps made in float64 and then cast, as Python's float arithmetic gives it."""
    return (1 - step.double() / steps).to(dtype)


def _best_steps(x, importance, lo, hi, step, steps, bits):
    """Per row of x [N, g], the step of `step` [F, N] (rows' candidates, in order) with the
    least weighted error, the first on ties, and that error: (best [N], err [N])."""
    factors = _factors(step, steps, x.dtype)
    scales, zeros = int4_grid_of_range(lo * factors, hi * factors, bits)
    # every candidate at once, [F, N, g]: one factor at a time made F times the operator calls (3-6x the
    # time on SmolLM2's groups), and each row's dot product is the same one torch.mv took (the same bits)
    t = _scratch("search", step.shape[0] * x.numel(), x.dtype).view(step.shape[0], *x.shape)
    err = _grid_residual(x, scales.to(x.dtype)[:, :, None], zeros.to(x.dtype)[:, :, None], bits, t).square_() \
        @ importance
    at = err.argmin(0)
    rows = torch.arange(x.shape[0], device=x.device)
    return step[at, rows], err[at, rows]


_SCRATCH = threading.local()


def _scratch(use: str, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`count` elements of this thread's reused scratch memory for `use`. The search's and the column loop's
    temporaries are megabytes each, made thousands of times a compile: fresh ones came from mmap and
    paid a page fault per 4 KiB at first touch (a [20, 3072, 64] quotient: 14.6 ms, 0.6 ms reused)."""
    buf = getattr(_SCRATCH, use, None)
    if buf is None or buf.dtype != dtype or buf.numel() < count:
        buf = torch.empty(count, dtype=dtype)
        setattr(_SCRATCH, use, buf)
    return buf[:count]


def _grid_residual(x, s, z, bits, out):
    """x̂ - x into `out`, x̂ = x on the grid (s, z) [..., N, 1]: the same operations (and bits) as
    quantize_to_grid's codes dequantised, in place on one temporary."""
    return torch.div(x, s, out=out).round_().add_(z).clamp_(0, 2 ** bits - 1).sub_(z).mul_(s).sub_(x)


def _quantize_columns(w, hinv, perm, g, bits, block_size, grid_of):
    """The GPTQ loop over columns in visiting order, with lazy batch updates: inside a block
    only the block's columns are updated, the rest once per block with one matmul.
    w [N, K] (visiting order) -> codes [N, K] (visiting order), scales, zeros [N, K/g].

    The block is worked on transposed, [columns, N], so that each column's handful of
    operations reads contiguous memory: on w's own row-major layout every element of a column
    sat in its own cache line, which made the loop ~3x slower than its arithmetic. Each
    group's grid is cast to w's dtype once."""
    n, k = w.shape
    maxq = 2 ** bits - 1
    codes = torch.zeros_like(w)
    scales = torch.zeros(n, k // g, dtype=torch.float32, device=w.device)
    zeros = torch.zeros_like(scales)
    starts, group_of = _group_starts(perm, g), (perm // g).tolist()
    grid = {}       # group -> its (scale, zero) [N] in w's dtype, as stored (fp32) then cast
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1, u1 = w[:, i1:i2].T.contiguous(), hinv[i1:i2, i1:i2]
        pivots = u1.diagonal().tolist()
        err, q1 = torch.zeros_like(w1), torch.empty_like(w1)
        # the column loop's vector ops in numpy on the same memory: the same IEEE operations (each
        # rounded once, round half to even), at a third of torch's per-call cost on these short rows
        w1n, u1n, q1n, errn = (t.numpy() for t in (w1, u1.contiguous(), q1, err))
        update = _scratch("update", (i2 - i1) * n).numpy()
        for i in range(i2 - i1):
            if i1 + i in starts:
                grp, cols = starts[i1 + i]
                current = _current_columns(w, w1, err[:i], hinv, i1, cols)
                scales[:, grp], zeros[:, grp] = grid_of(cols, current)
                # the grid as stored (fp32 scales), so compensation sees the error actually made
                grid[grp] = tuple(t[:, grp].to(w.dtype).contiguous().numpy() for t in (scales, zeros))
            s, z = grid[group_of[i1 + i]]
            x, q, e = w1n[i], q1n[i], errn[i]
            np.rint(np.divide(x, s, out=q), out=q)
            np.clip(np.add(q, z, out=q), 0, maxq, out=q)
            np.multiply(np.subtract(q, z, out=e), s, out=e)
            np.divide(np.subtract(x, e, out=e), pivots[i], out=e)
            rank1 = update[:(i2 - i1 - i) * n].reshape(-1, n)
            w1n[i:] -= np.multiply(u1n[i, i:, None], e, out=rank1)
        codes[:, i1:i2] = q1.T
        w[:, i2:] -= err.T @ hinv[i1:i2, i2:]
    return codes, scales, zeros


def _current_columns(w, w1, err, hinv, i1, cols):
    """Up-to-date values [N, len(cols)] of not-yet-quantised columns (visiting positions
    `cols`, in that order): those in the block live in w1 (the block transposed, [b, N]);
    those after it still lack the pending update from the block's quantised columns (their
    errors err [i, N]), which is applied here for just these columns."""
    i2 = i1 + w1.shape[0]
    inside = cols < i2
    current = w.new_empty(w.shape[0], cols.numel())
    current[:, inside] = w1[cols[inside] - i1].T
    current[:, ~inside] = w[:, cols[~inside]] - err.T @ hinv[i1:i1 + err.shape[0]][:, cols[~inside]]
    return current


__all__ = ["HessianAccumulator", "gptq_quantize_weight", "clipped_grid", "resolve_group_size"]
