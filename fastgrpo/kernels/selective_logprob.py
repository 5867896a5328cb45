"""lm-head + log-softmax + gather: log-probabilities of the target tokens (and optionally the
entropy of each row) straight from the last hidden states, never holding the [N, V] logits.

    z       = (hidden @ weight.T) * logit_scale          accumulated and kept in fp32
    z       = softcap * tanh(z / softcap)                if softcap > 0 (Gemma2 final-logit soft-capping)
    z       = z / temperature
    lse     = logsumexp(z)
    logp    = z[target] - lse                            0 where target == -100 (ignore_index)
    entropy = lse - sum(softmax(z) * z)                  computed for ignored rows too

Deliberate numerical change: HF transformers computes `log_softmax` in the model dtype (bf16
for bf16 models) on bf16 logits. Here the logits are never rounded to bf16: the matmul
accumulates in fp32 and every later step stays in fp32, so results differ from HF's bf16
numbers by bf16 rounding (up to ~0.1 nat on large logits) and are closer to the exact value.

Chunk invariance: each row's result is computed by the same sequence of fp32 operations
whatever N is and wherever the row sits in the batch (fixed-size row tiles, the last one
padded with zero rows, so every GEMM has the same shape; fixed vocab order; no autotuning by
N), so calling the op on any split of the rows gives bitwise the same log-probs, entropies
and d(hidden) as one call on all rows.

How (CUDA): rows go in tiles of R (copied into one padded [R, H] buffer), vocab in tiles of C.
Forward: cuBLAS writes one fp32 [R, C] logits tile, a Triton row kernel folds it into running
per-row max / sum-exp / entropy sums / target logit (online log-sum-exp).

Backward, two ways:
- Frozen weight, gradient enabled (the common case: LoRA or a frozen lm_head): the forward
  also computes d logp / d hidden = (1 - p_t) W_t - sum_{v != t} p_v W_v (with the scale /
  soft-cap chain factors), flash-attention style: the row kernel turns each logits tile in
  place into exp(z - running max) in the input dtype (target column zeroed), and cuBLAS adds
  it times W into an fp32 [R, H] accumulator that the row kernel rescales when a row's max
  grows. The target's own term comes from the sum over the other columns, so it does not
  cancel when p_t is near 1. The backward only scales that [N, H] gradient by d loss / d logp,
  in place: two matmuls in all, not three. Saved: the gradient [N, H] in hidden's dtype (the
  memory d(hidden) then takes) besides the inputs and lse.
- Otherwise (trainable weight, or a gradient reaching the entropy): cuBLAS recomputes each
  tile, a Triton row kernel turns it in place into d(logits) in the input dtype, cuBLAS adds
  d(logits) @ W into an fp32 [R, H] d(hidden) accumulator (and d(logits).T @ hidden into an fp32
  [V, H] d(weight) accumulator, only when the weight requires grad). Saved: hidden, weight (by
  reference), targets, lse fp32 [N] and, with entropy, the entropy fp32 [N].
Never logits: at most one logits tile exists at a time (32 MiB); the extra memory beyond
inputs, outputs and d(hidden) stays under 64 MiB.
On CPU a torch implementation follows the same contract.
"""
import dataclasses
import math

import torch
import triton
import triton.language as tl

from fastgrpo.kernels._dispatch import check_dtype, launch_like_cuda, use_triton

IGNORE_INDEX = -100
_OP = "selective_logprob"
# Finite stand-in for -inf on masked vocab columns: exp() of it is exactly 0 and, unlike
# -inf, 0 * (it - max) is 0 rather than NaN in the entropy sum.
_MASKED_LOGIT = tl.constexpr(-1.0e30)
_STATS_INIT = tl.constexpr(-1.0e38)  # finite "-inf" start of the running max


# --------------------------------------------------------------------------------------
# Tile sizes. Fixed per device kind (the CUDA backward's also by hidden size): never chosen
# from N, so results do not depend on how the caller splits the rows.
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TileConfig:
    rows: int  # rows per GEMM; the last row tile is padded with zero rows to this size
    vocab: int  # vocab columns per logits tile (a power of 2: one row-kernel block)
    block_rows: int  # rows per row-kernel program
    num_warps: int
    block_h: int = 1024  # hidden columns per step where a row kernel walks [R, H] rows


# CUDA: one fp32 logits tile is 1024 x 8192 x 4 B = 32 MiB. The recomputing backward, and the forward that computes
# the gradient, add the padded hidden tile (R x H x 2 B) and an fp32 [R, H] accumulator (R x H x 4 B): 56 MiB at
# H = 4096. For H <= 2048 both take 2048-row tiles (50 MiB at H = 1536): the [R, H] GEMM then fills the GPU (1024 x 1536
# outputs are under one wave of 128 x 128 tiles on 132 SMs), and d(weight)'s fp32 read-modify-write per row tile
# halves. `python bench/bench_selective_logprob.py --sweep` (H200, N = 32768, bf16): at (1536, 151936) the
# recomputing backward 60.9 ms against 63.9 with 1024-row tiles, the forward with the gradient + its backward 61.4
# against 63.1 (2048 x 8192: 59.4, but it holds 82 MiB); at (4096, 128256) 118.3 ms with 1024 x 8192 (2048 x 4096:
# 117.7 ms, 80 MiB). The forward with and without the gradient takes the same tiles, so its log-probs are bitwise
# the same either way (TRL's ratio exp(logp - old_logp) is exactly 1 on unchanged weights).
CUDA_FORWARD = TileConfig(1024, 8192, 1, 8)
CUDA_FORWARD_NARROW = TileConfig(2048, 4096, 1, 8)
CUDA_BACKWARD = TileConfig(1024, 8192, 1, 8)
CUDA_BACKWARD_NARROW = TileConfig(2048, 4096, 1, 8)
# Triton interpreter (tests on CPU): one program per tile, 2-D blocks.
INTERPRETER_TILES = TileConfig(32, 128, 32, 4, 16)
# Torch path (CPU). Rows x vocab tiles stay under ATen's 32768-element grain so each
# elementwise op runs single-threaded over one fixed-size buffer: every element takes the
# same (vectorized) code path wherever its row sits, which keeps results chunk-invariant.
TORCH_ROWS = 16
TORCH_VOCAB = 512


def _tile_configs(hidden: torch.Tensor) -> tuple[TileConfig, TileConfig]:
    if not launch_like_cuda(hidden):
        return INTERPRETER_TILES, INTERPRETER_TILES
    if hidden.shape[1] <= 2048:
        return CUDA_FORWARD_NARROW, CUDA_BACKWARD_NARROW
    return CUDA_FORWARD, CUDA_BACKWARD


# --------------------------------------------------------------------------------------
# Triton row kernels (each program owns whole rows of one [R, C] logits tile)
# --------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    # sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|): never overflows.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_logits(z_ptr, local_rows, cols, n_cols, z_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Raw fp32 logits of one tile -> scaled (soft-capped) logits; masked columns get
    _MASKED_LOGIT. Also returns tanh(acc * cap_in) (soft-capping) for the backward."""
    col_ok = cols < n_cols
    acc = tl.load(z_ptr + local_rows[:, None].to(tl.int64) * n_cols + cols[None, :],
                  mask=col_ok[None, :], other=0.0)
    if SOFTCAP:
        th = _tanh(acc * cap_in)
        z = cap_out * th
    else:
        th = acc
        z = acc * z_scale
    return tl.where(col_ok[None, :], z, _MASKED_LOGIT), th


@triton.jit
def _stats_kernel(
    z_ptr, tgt_ptr, stats_ptr, logp_ptr, ent_ptr, lse_ptr, p_ptr, acc_ptr,
    row0, n_rows, col0, n_cols, p_row_stride, hidden_size,
    z_scale, cap_in, cap_out,
    SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, WRITE_PROBS: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr,
    IGNORE: tl.constexpr, TILE_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Fold one logits tile into the running per-row statistics (stats [5, TILE_ROWS]: max,
    sum exp(z - max), sum exp(z - max) * (z - max), target logit, sum exp(z - max) over the
    non-target columns); after the last vocab tile write lse, logp and entropy of the real rows
    (row0 + r, r < n_rows).

    WRITE_PROBS (the gradient computed in forward): also turn the tile, IN PLACE, into
    exp(z - max) * dz/dacc with the target column zeroed, in the input dtype (p_ptr aliases
    z_ptr, row stride p_row_stride), for the GEMM that adds it times W into acc [TILE_ROWS, H];
    when a row's max grows, its acc row is rescaled to the new max first."""
    local_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    z, th = _load_logits(z_ptr, local_rows, cols, n_cols, z_scale, cap_in, cap_out, SOFTCAP)
    row_ok = local_rows < n_rows
    tgt = tl.load(tgt_ptr + row0 + local_rows, mask=row_ok, other=IGNORE)

    tile_max = tl.max(z, axis=1)
    if FIRST:
        m_old = tl.full((BLOCK_R,), _STATS_INIT, tl.float32)
        l_old = tl.zeros((BLOCK_R,), tl.float32)
        s_old = tl.zeros((BLOCK_R,), tl.float32)
        t = tl.zeros((BLOCK_R,), tl.float32)
    else:
        m_old = tl.load(stats_ptr + local_rows)
        l_old = tl.load(stats_ptr + TILE_ROWS + local_rows)
        s_old = tl.load(stats_ptr + 2 * TILE_ROWS + local_rows)
        t = tl.load(stats_ptr + 3 * TILE_ROWS + local_rows)
    m = tl.maximum(m_old, tile_max)
    alpha = tl.exp(m_old - m)
    shifted = z - m[:, None]
    p = tl.exp(shifted)
    l = l_old * alpha + tl.sum(p, axis=1)
    s = s_old
    if WITH_ENTROPY:
        s = alpha * (s_old + (m_old - m) * l_old) + tl.sum(p * shifted, axis=1)
    # exactly one tile holds the target: the others add 0.0
    is_target = cols[None, :] + col0 == tgt[:, None]
    t += tl.sum(tl.where(is_target, z, 0.0), axis=1)

    if WRITE_PROBS:
        p_rest = tl.where(is_target, 0.0, p)
        rest = tl.sum(p_rest, axis=1)
        if SOFTCAP:
            p_rest = p_rest * (z_scale * (1.0 - th * th))
        else:
            p_rest = p_rest * z_scale
        if not FIRST:  # rest and acc hold the earlier tiles' sums relative to m_old
            rest += alpha * tl.load(stats_ptr + 4 * TILE_ROWS + local_rows)
            grown = alpha < 1.0
            for h0 in range(0, hidden_size, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                at = acc_ptr + local_rows[:, None].to(tl.int64) * hidden_size + hs[None, :]
                keep = grown[:, None] & (hs < hidden_size)[None, :]
                tl.store(at, tl.load(at, mask=keep, other=0.0) * alpha[:, None], mask=keep)
        tl.debug_barrier()  # every thread's loads of these rows are done before any store
        out = p_ptr + local_rows[:, None].to(tl.int64) * p_row_stride + cols[None, :]
        tl.store(out, p_rest.to(p_ptr.dtype.element_ty), mask=(cols < n_cols)[None, :])

    if LAST:
        log_l = tl.log(l)
        lse = m + log_l
        out = row0 + local_rows
        tl.store(lse_ptr + out, lse, mask=row_ok)
        tl.store(logp_ptr + out, tl.where(tgt == IGNORE, 0.0, t - lse), mask=row_ok)
        if WITH_ENTROPY:
            tl.store(ent_ptr + out, log_l - s / l, mask=row_ok)
    if WRITE_PROBS or not LAST:
        tl.store(stats_ptr + local_rows, m)
        tl.store(stats_ptr + TILE_ROWS + local_rows, l)
        tl.store(stats_ptr + 2 * TILE_ROWS + local_rows, s)
        tl.store(stats_ptr + 3 * TILE_ROWS + local_rows, t)
    if WRITE_PROBS:
        tl.store(stats_ptr + 4 * TILE_ROWS + local_rows, rest)


@triton.jit
def _grad_from_forward_kernel(
    acc_ptr, stats_ptr, w_ptr, tgt_ptr, out_ptr,
    row0, n_rows, hidden_size, w_row_stride, w_col_stride,
    z_scale, cap_out,
    SOFTCAP: tl.constexpr, IGNORE: tl.constexpr, TILE_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """d logp / d hidden of the real rows of one row tile, from the forward's sums:
    (1 - p_t) dz_t/dacc W_t - sum_{v != t} p_v dz_v/dacc W_v
      = (rest * dz_t/dacc * W_t - acc) / l
    with rest = sum over the non-target columns of exp(z - max) (so 1 - p_t never comes from
    a cancelling 1 - exp(...)) and acc = sum_{v != t} exp(z_v - max) dz_v/dacc W_v. Rows whose
    target is ignored get zeros."""
    local_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = local_rows < n_rows
    tgt = tl.load(tgt_ptr + row0 + local_rows, mask=row_ok, other=IGNORE)
    live = row_ok & (tgt != IGNORE)
    l = tl.load(stats_ptr + TILE_ROWS + local_rows)
    z_t = tl.load(stats_ptr + 3 * TILE_ROWS + local_rows)
    rest = tl.load(stats_ptr + 4 * TILE_ROWS + local_rows)
    if SOFTCAP:
        th_t = z_t / cap_out
        coef = rest * (z_scale * (1.0 - th_t * th_t)) / l
    else:
        coef = rest * z_scale / l
    coef = tl.where(live, coef, 0.0)
    inv_l = tl.where(live, 1.0 / l, 0.0)
    w_rows = tl.where(live, tgt, 0).to(tl.int64) * w_row_stride
    for h0 in range(0, hidden_size, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden_size
        acc = tl.load(acc_ptr + local_rows[:, None].to(tl.int64) * hidden_size + hs[None, :],
                      mask=h_ok[None, :], other=0.0)
        w_t = tl.load(w_ptr + w_rows[:, None] + hs[None, :] * w_col_stride,
                      mask=live[:, None] & h_ok[None, :], other=0.0)
        g = coef[:, None] * w_t.to(tl.float32) - acc * inv_l[:, None]
        out = out_ptr + (row0 + local_rows)[:, None].to(tl.int64) * hidden_size + hs[None, :]
        tl.store(out, g.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & h_ok[None, :])


@triton.jit
def _grad_logits_kernel(
    z_ptr, dz_ptr, tgt_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr,
    row0, n_rows, col0, n_cols, dz_row_stride,
    z_scale, cap_in, cap_out,
    SOFTCAP: tl.constexpr, ENTROPY_GRAD: tl.constexpr, IGNORE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Turn a raw fp32 logits tile into d(loss)/d(raw logits), IN PLACE: dz_ptr aliases z_ptr
    (as the input dtype, row stride dz_row_stride elements), so row r of d(logits) overwrites
    the front of row r of the logits. Each program owns whole rows and loads them completely
    before the barrier, after which it stores. Padding rows (r >= n_rows) get exact zeros."""
    local_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    z, th = _load_logits(z_ptr, local_rows, cols, n_cols, z_scale, cap_in, cap_out, SOFTCAP)
    row_ok = local_rows < n_rows
    rows = row0 + tl.minimum(local_rows, n_rows - 1)
    lse = tl.load(lse_ptr + rows)
    tgt = tl.load(tgt_ptr + rows)
    g = tl.where(row_ok & (tgt != IGNORE), tl.load(glogp_ptr + rows), 0.0)
    p = tl.exp(z - lse[:, None])
    if ENTROPY_GRAD:
        ge = tl.where(row_ok, tl.load(gent_ptr + rows), 0.0)
        ent = tl.load(ent_ptr + rows)
        # d entropy / dz_j = -p_j * (z_j - lse + entropy)
        coef = g[:, None] + ge[:, None] * (z - lse[:, None] + ent[:, None])
    else:
        coef = g[:, None]
    dz = tl.where(cols[None, :] + col0 == tgt[:, None], g[:, None], 0.0) - p * coef
    if SOFTCAP:
        dz = dz * (z_scale * (1.0 - th * th))
    else:
        dz = dz * z_scale
    tl.debug_barrier()  # every thread's loads of these rows are done before any store
    out = dz_ptr + local_rows[:, None].to(tl.int64) * dz_row_stride + cols[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=(cols < n_cols)[None, :])


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Scales:
    """z = acc * z_scale, or with soft-capping z = cap_out * tanh(acc * cap_in);
    dz/dacc = z_scale (times 1 - tanh^2 with soft-capping)."""
    z_scale: float
    cap_in: float
    cap_out: float
    softcap: bool

    @staticmethod
    def of(temperature: float, logit_scale: float, softcap: float) -> "_Scales":
        if softcap > 0:
            return _Scales(logit_scale / temperature, logit_scale / softcap, softcap / temperature, True)
        return _Scales(logit_scale / temperature, 0.0, 0.0, False)


def _check_inputs(hidden, weight, targets, temperature, logit_scale, softcap):
    check_dtype(_OP, hidden)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"fastgrpo::{_OP}: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if targets.dtype != torch.int64:
        raise TypeError(f"fastgrpo::{_OP}: targets must be int64 token ids, got {targets.dtype}")
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"fastgrpo::{_OP}: expected hidden [N, H], weight [V, H], targets [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fastgrpo::{_OP}: hidden size mismatch: hidden has H={hidden.shape[1]}, weight has H={weight.shape[1]}"
        )
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"fastgrpo::{_OP}: {targets.shape[0]} targets for {hidden.shape[0]} rows")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"fastgrpo::{_OP}: inputs on different devices")
    if not temperature > 0 or not softcap >= 0 or not math.isfinite(logit_scale):
        raise ValueError(
            f"fastgrpo::{_OP}: need temperature > 0, softcap >= 0, finite logit_scale; got "
            f"{temperature}, {softcap}, {logit_scale}"
        )


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (fp32) = [out +] a @ b, fp32 accumulation whatever the dtype of a and b."""
    beta = 1.0 if accumulate else 0.0
    if a.dtype == torch.float32:
        torch.addmm(out, a, b, beta=beta, out=out)
    elif a.is_cuda:
        torch.addmm(out, a, b, beta=beta, out_dtype=torch.float32, out=out)
    else:  # CPU has no 16-bit x 16-bit -> fp32 GEMM: widen (exactly) first
        torch.addmm(out, a.float(), b.float(), beta=beta, out=out)


def _weight_grad_update(dw_acc: torch.Tensor, dz: torch.Tensor, hidden_rows: torch.Tensor, accumulate: bool) -> None:
    """dW[cols] (+)= dz.T @ hidden[rows]: the only place d(weight) work happens."""
    _mm_into(dw_acc, dz.t(), hidden_rows, accumulate)


class _TileWalk:
    """Row tiles of a fixed size R (the last padded with zero rows, in one reused buffer) x
    vocab tiles of width <= C, each with its fp32 logits computed by one fixed-shape GEMM."""

    def __init__(self, hidden, weight, cfg: TileConfig):
        self.hidden, self.weight, self.cfg = hidden, weight, cfg
        dev = hidden.device
        self.h_tile = torch.empty((cfg.rows, hidden.shape[1]), device=dev, dtype=hidden.dtype)
        self.z_flat = torch.empty(cfg.rows * cfg.vocab, device=dev, dtype=torch.float32)

    def rows(self):
        n, r = self.hidden.shape[0], self.cfg.rows
        for r0 in range(0, n, r):
            rows = min(r, n - r0)
            self.h_tile[:rows].copy_(self.hidden[r0:r0 + rows])
            if rows < r:
                self.h_tile[rows:].zero_()
            yield r0, rows

    def vocab(self):
        v = self.weight.shape[0]
        for c0 in range(0, v, self.cfg.vocab):
            cols = min(self.cfg.vocab, v - c0)
            z = self.z_flat[: self.cfg.rows * cols].view(self.cfg.rows, cols)
            _mm_into(z, self.h_tile, self.weight[c0:c0 + cols].t(), accumulate=False)
            yield c0, cols, z


def _forward_triton(hidden, weight, targets, scales: _Scales, with_entropy: bool, grad_from_forward: bool):
    n, h = hidden.shape
    v = weight.shape[0]
    cfg, _ = _tile_configs(hidden)
    f32 = dict(device=hidden.device, dtype=torch.float32)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n if with_entropy else 0, **f32)
    grad = torch.empty((n, h) if grad_from_forward else (0,), device=hidden.device, dtype=hidden.dtype)
    if n == 0:
        return logp, entropy, lse, grad
    stats = torch.empty((5, cfg.rows), **f32)
    walk = _TileWalk(hidden, weight, cfg)
    acc = torch.empty((cfg.rows, h), **f32) if grad_from_forward else stats
    probs_flat = walk.z_flat.view(hidden.dtype)  # the probabilities overwrite the logits in place
    probs_per_z = probs_flat.numel() // walk.z_flat.numel()
    grid = (cfg.rows // cfg.block_rows,)
    for r0, rows in walk.rows():
        for c0, cols, z in walk.vocab():
            probs_stride = cols * probs_per_z  # row r of the probabilities starts where row r of z does
            _stats_kernel[grid](
                z, targets, stats, logp, entropy, lse, probs_flat, acc,
                r0, rows, c0, cols, probs_stride, h,
                scales.z_scale, scales.cap_in, scales.cap_out,
                SOFTCAP=scales.softcap, WITH_ENTROPY=with_entropy, WRITE_PROBS=grad_from_forward,
                FIRST=c0 == 0, LAST=c0 + cfg.vocab >= v, IGNORE=IGNORE_INDEX,
                TILE_ROWS=cfg.rows, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.vocab, BLOCK_H=cfg.block_h,
                num_warps=cfg.num_warps,
            )
            if grad_from_forward:
                probs = probs_flat.as_strided((cfg.rows, cols), (probs_stride, 1))
                _mm_into(acc, probs, weight[c0:c0 + cols], accumulate=c0 > 0)
        if grad_from_forward:
            _grad_from_forward_kernel[grid](
                acc, stats, weight, targets, grad,
                r0, rows, h, weight.stride(0), weight.stride(1),
                scales.z_scale, scales.cap_out,
                SOFTCAP=scales.softcap, IGNORE=IGNORE_INDEX, TILE_ROWS=cfg.rows,
                BLOCK_R=cfg.block_rows, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
            )
    return logp, entropy, lse, grad


def _backward_triton(g_logp, g_ent, hidden, weight, targets, lse, entropy, scales: _Scales, weight_grad: bool):
    n, h = hidden.shape
    v = weight.shape[0]
    _, cfg = _tile_configs(hidden)
    d_hidden = torch.empty((n, h), device=hidden.device, dtype=hidden.dtype)
    dw_acc = torch.empty((v, h), device=weight.device, dtype=torch.float32) if weight_grad else None
    if n == 0:
        if weight_grad:
            dw_acc.zero_()
        return d_hidden, dw_acc
    entropy_grad = g_ent.numel() > 0
    acc = torch.empty((cfg.rows, h), device=hidden.device, dtype=torch.float32)
    walk = _TileWalk(hidden, weight, cfg)
    dz_flat = walk.z_flat.view(hidden.dtype)  # d(logits) overwrite the logits in place
    dz_per_z = dz_flat.numel() // walk.z_flat.numel()
    for r0, rows in walk.rows():
        for c0, cols, z in walk.vocab():
            dz_stride = cols * dz_per_z  # row r of d(logits) starts where row r of z does
            _grad_logits_kernel[(cfg.rows // cfg.block_rows,)](
                z, dz_flat, targets, lse, entropy if entropy_grad else lse,
                g_logp, g_ent if entropy_grad else g_logp,
                r0, rows, c0, cols, dz_stride,
                scales.z_scale, scales.cap_in, scales.cap_out,
                SOFTCAP=scales.softcap, ENTROPY_GRAD=entropy_grad, IGNORE=IGNORE_INDEX,
                BLOCK_R=cfg.block_rows, BLOCK_C=cfg.vocab,
                num_warps=cfg.num_warps,
            )
            dz = dz_flat.as_strided((cfg.rows, cols), (dz_stride, 1))
            w_cols = weight[c0:c0 + cols]
            # The full fixed-size row tile every time (padding rows are zeros): the same GEMM
            # shape for every call, so d(hidden) rows do not depend on how the caller split N.
            _mm_into(acc, dz, w_cols, accumulate=c0 > 0)
            if weight_grad:
                _weight_grad_update(dw_acc[c0:c0 + cols], dz[:rows], walk.h_tile[:rows], accumulate=r0 > 0)
        d_hidden[r0:r0 + rows] = acc[:rows]
    return d_hidden, dw_acc


def _logits_tile_torch(h_tile, weight, c0, scales: _Scales, z_buf):
    """Fill z_buf [rows, TORCH_VOCAB] with the scaled fp32 logits of columns c0.. (masked
    columns = _MASKED_LOGIT); also return tanh(acc * cap_in) when soft-capping (for backward)."""
    cols = min(z_buf.shape[1], weight.shape[0] - c0)
    z_buf.fill_(_MASKED_LOGIT.value)
    z = z_buf[:, :cols]
    torch.mm(h_tile, weight[c0:c0 + cols].float().t(), out=z)
    th = None
    if scales.softcap:
        th = torch.tanh(z_buf.mul_(scales.cap_in))
        torch.mul(th, scales.cap_out, out=z_buf)
        z_buf[:, cols:] = _MASKED_LOGIT.value
    else:
        z.mul_(scales.z_scale)
    return cols, th


def _row_tiles(n: int):
    for r0 in range(0, n, TORCH_ROWS):
        yield r0, min(TORCH_ROWS, n - r0)


def _padded_rows(src: torch.Tensor, r0: int, rows: int, fill, dtype=None) -> torch.Tensor:
    out = torch.full((TORCH_ROWS, *src.shape[1:]), fill, dtype=dtype or src.dtype, device=src.device)
    out[:rows] = src[r0:r0 + rows]
    return out


def _forward_torch(hidden, weight, targets, scales: _Scales, with_entropy: bool, grad_from_forward: bool):
    """Same tiling contract on CPU: fixed TORCH_ROWS x TORCH_VOCAB tiles (rows padded), online
    log-sum-exp over vocab tiles in a fixed order, fp32 throughout; with grad_from_forward the
    same sums as the Triton path's (_stats_kernel, _grad_from_forward_kernel) give d logp / d hidden."""
    n, h = hidden.shape
    v = weight.shape[0]
    f32 = dict(device=hidden.device, dtype=torch.float32)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    entropy = torch.empty(n if with_entropy else 0, **f32)
    grad = torch.empty((n, h) if grad_from_forward else (0,), device=hidden.device, dtype=hidden.dtype)
    z_buf = torch.empty((TORCH_ROWS, TORCH_VOCAB), **f32)
    acc = torch.empty((TORCH_ROWS, h) if grad_from_forward else (0,), **f32)
    for r0, rows in _row_tiles(n):
        h_tile = _padded_rows(hidden, r0, rows, 0.0, torch.float32)
        tgt = _padded_rows(targets, r0, rows, IGNORE_INDEX)
        m = torch.full((TORCH_ROWS,), _STATS_INIT.value, **f32)
        l = torch.zeros(TORCH_ROWS, **f32)
        s = torch.zeros(TORCH_ROWS, **f32)
        t = torch.zeros(TORCH_ROWS, **f32)
        rest = torch.zeros(TORCH_ROWS, **f32)
        acc.zero_()  # empty without the gradient
        for c0 in range(0, v, TORCH_VOCAB):
            cols, th = _logits_tile_torch(h_tile, weight, c0, scales, z_buf)
            m_new = torch.maximum(m, z_buf.amax(dim=1))
            alpha = torch.exp(m - m_new)
            shifted = z_buf - m_new[:, None]
            p = torch.exp(shifted)
            if with_entropy:
                s = alpha * (s + (m - m_new) * l) + (p * shifted).sum(dim=1)
            l = l * alpha + p.sum(dim=1)
            local = tgt - c0
            here = (local >= 0) & (local < TORCH_VOCAB)
            t = t + torch.where(here, z_buf.gather(1, local.clamp(0, TORCH_VOCAB - 1)[:, None])[:, 0], 0.0)
            if grad_from_forward:
                p[here, local[here]] = 0.0
                rest = rest * alpha + p.sum(dim=1)
                p.mul_(scales.z_scale if th is None else scales.z_scale * (1.0 - th * th))
                acc.mul_(alpha[:, None]).addmm_(p[:, :cols], weight[c0:c0 + cols].float())
            m = m_new
        log_l = torch.log(l)
        row_lse = m + log_l
        lse[r0:r0 + rows] = row_lse[:rows]
        logp[r0:r0 + rows] = torch.where(tgt == IGNORE_INDEX, 0.0, t - row_lse)[:rows]
        if with_entropy:
            entropy[r0:r0 + rows] = (log_l - s / l)[:rows]
        if grad_from_forward:
            live = tgt != IGNORE_INDEX
            dz_t = scales.z_scale * (1.0 - (t / scales.cap_out) ** 2) if scales.softcap else scales.z_scale
            w_t = weight[tgt.clamp(min=0)].float()
            tile_grad = torch.where(live[:, None], ((rest * dz_t)[:, None] * w_t - acc) / l[:, None], 0.0)
            grad[r0:r0 + rows] = tile_grad[:rows]
    return logp, entropy, lse, grad


def _backward_torch(g_logp, g_ent, hidden, weight, targets, lse, entropy, scales: _Scales, weight_grad: bool):
    n, h = hidden.shape
    v = weight.shape[0]
    f32 = dict(device=hidden.device, dtype=torch.float32)
    d_hidden = torch.empty((n, h), device=hidden.device, dtype=hidden.dtype)
    dw_acc = torch.zeros((v, h), **f32) if weight_grad else None
    entropy_grad = g_ent.numel() > 0
    z_buf = torch.empty((TORCH_ROWS, TORCH_VOCAB), **f32)
    acc = torch.empty((TORCH_ROWS, h), **f32)
    for r0, rows in _row_tiles(n):
        h_tile = _padded_rows(hidden, r0, rows, 0.0, torch.float32)
        tgt = _padded_rows(targets, r0, rows, IGNORE_INDEX)
        row_lse = _padded_rows(lse, r0, rows, 0.0)[:, None]
        g = torch.where(tgt == IGNORE_INDEX, 0.0, _padded_rows(g_logp, r0, rows, 0.0, torch.float32))[:, None]
        if entropy_grad:
            ge = _padded_rows(g_ent, r0, rows, 0.0, torch.float32)[:, None]
            ent = _padded_rows(entropy, r0, rows, 0.0)[:, None]
        acc.zero_()
        for c0 in range(0, v, TORCH_VOCAB):
            cols, th = _logits_tile_torch(h_tile, weight, c0, scales, z_buf)
            p = torch.exp(z_buf - row_lse)
            coef = g + ge * (z_buf - row_lse + ent) if entropy_grad else g
            dz = -p * coef
            local = tgt - c0
            here = (local >= 0) & (local < cols)
            dz[here, local[here]] += g[here, 0]
            dz.mul_(scales.z_scale if th is None else scales.z_scale * (1.0 - th * th))
            w_cols = weight[c0:c0 + cols].float()
            acc.addmm_(dz[:, :cols], w_cols)
            if weight_grad:
                _weight_grad_update(dw_acc[c0:c0 + cols], dz[:rows, :cols], h_tile[:rows], accumulate=True)
        d_hidden[r0:r0 + rows] = acc[:rows]
    return d_hidden, dw_acc


# --------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------
@torch.library.custom_op("fastgrpo::selective_logprob_fwd", mutates_args=())
def selective_logprob_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    temperature: float, logit_scale: float, softcap: float, with_entropy: bool, grad_from_forward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp fp32 [N], entropy fp32 [N] or [0], lse fp32 [N], grad [N, H] in hidden.dtype or [0]);
    lse is kept for the backward; grad (with grad_from_forward) is d logp / d hidden."""
    _check_inputs(hidden, weight, targets, temperature, logit_scale, softcap)
    scales = _Scales.of(temperature, logit_scale, softcap)
    impl = _forward_triton if use_triton(hidden) else _forward_torch
    return impl(hidden, weight, targets, scales, with_entropy, grad_from_forward)


@selective_logprob_fwd.register_fake
def _(hidden, weight, targets, temperature, logit_scale, softcap, with_entropy, grad_from_forward):
    _check_inputs(hidden, weight, targets, temperature, logit_scale, softcap)
    n, h = hidden.shape
    f32 = dict(device=hidden.device, dtype=torch.float32)
    grad = hidden.new_empty((n, h) if grad_from_forward else (0,))
    return torch.empty(n, **f32), torch.empty(n if with_entropy else 0, **f32), torch.empty(n, **f32), grad


@torch.library.custom_op("fastgrpo::selective_logprob_scale_grad_", mutates_args=("grad",))
def selective_logprob_scale_grad_(grad: torch.Tensor, grad_logp: torch.Tensor) -> None:
    """grad [N, H] *= grad_logp [N] (fp32) row by row, in place: the forward's d logp / d hidden
    becomes d loss / d hidden in the same memory (one rounding, from fp32 to grad's dtype)."""
    grad.mul_(grad_logp.float()[:, None])


@selective_logprob_scale_grad_.register_fake
def _(grad, grad_logp):
    return None


@torch.library.custom_op("fastgrpo::selective_logprob_bwd", mutates_args=())
def selective_logprob_bwd(
    grad_logp: torch.Tensor, grad_entropy: torch.Tensor,
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    lse: torch.Tensor, entropy: torch.Tensor,
    temperature: float, logit_scale: float, softcap: float, weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_hidden [N, H] in hidden.dtype, d_weight [V, H] in weight.dtype, or [0] if not weight_grad).
    grad_entropy is empty when the entropy gets no gradient."""
    scales = _Scales.of(temperature, logit_scale, softcap)
    grad_logp = grad_logp.float().contiguous()
    grad_entropy = grad_entropy.float().contiguous()
    impl = _backward_triton if use_triton(hidden) else _backward_torch
    d_hidden, dw_acc = impl(grad_logp, grad_entropy, hidden, weight, targets, lse, entropy, scales, weight_grad)
    if not weight_grad:
        return d_hidden, weight.new_empty(0)
    return d_hidden, dw_acc if weight.dtype == torch.float32 else dw_acc.to(weight.dtype)


@selective_logprob_bwd.register_fake
def _(grad_logp, grad_entropy, hidden, weight, targets, lse, entropy, temperature, logit_scale, softcap, weight_grad):
    d_hidden = hidden.new_empty(hidden.shape[0], hidden.shape[1])
    return d_hidden, weight.new_empty(weight.shape[0], weight.shape[1]) if weight_grad else weight.new_empty(0)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, temperature, logit_scale, softcap, with_entropy, grad_from_forward = inputs
    _, entropy, lse, grad = output
    ctx.mark_non_differentiable(lse, grad)
    ctx.set_materialize_grads(False)  # an entropy nobody differentiates arrives as None, not zeros
    ctx.save_for_backward(hidden, weight, targets, lse, entropy, grad)
    ctx.args = (temperature, logit_scale, softcap)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse, _grad_grad):
    hidden, weight, targets, lse, entropy, grad = ctx.saved_tensors
    none = (None,) * 6
    if grad_logp is None:
        grad_logp = lse.new_zeros(lse.shape)
    if grad_entropy is None or entropy.numel() == 0:
        grad_entropy = lse.new_empty(0)
    weight_grad = ctx.needs_input_grad[1]
    if not (ctx.needs_input_grad[0] or weight_grad):
        return None, None, *none
    if grad.numel() > 0 and grad_entropy.numel() == 0 and not weight_grad:
        # The forward computed d logp / d hidden: scale it in place (its memory becomes d(hidden);
        # a second backward through this node is refused by autograd's saved-tensor version check).
        torch.ops.fastgrpo.selective_logprob_scale_grad_(grad, grad_logp)
        return grad, None, *none
    # Recompute the logits: d(weight), d(entropy), or no gradient from the forward.
    d_hidden, d_weight = torch.ops.fastgrpo.selective_logprob_bwd(
        grad_logp, grad_entropy, hidden, weight, targets, lse, entropy, *ctx.args, weight_grad
    )
    return (
        d_hidden if ctx.needs_input_grad[0] else None,
        d_weight if weight_grad else None,
        *none,
    )


selective_logprob_fwd.register_autograd(_backward, setup_context=_setup_context)

# The public op, with the schema callers (and the FX pass) use. It only drops lse, so it is
# a composite of the autograd-aware forward op: AOTAutograd sees selective_logprob_fwd and
# selective_logprob_bwd as single nodes.
_lib = torch.library.Library("fastgrpo", "FRAGMENT")
_lib.define(
    "selective_logprob(Tensor hidden, Tensor weight, Tensor targets, float temperature, "
    "float logit_scale, float softcap, bool with_entropy) -> (Tensor logp, Tensor entropy)"
)


def _selective_logprob_composite(hidden, weight, targets, temperature, logit_scale, softcap, with_entropy):
    logp, entropy, _, _ = torch.ops.fastgrpo.selective_logprob_fwd(
        hidden, weight, targets, temperature, logit_scale, softcap, with_entropy,
        _grad_from_forward(hidden, weight),
    )
    return logp, entropy


def _grad_from_forward(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the forward also computes d logp / d hidden. With a frozen weight the backward then
    needs no GEMM: two matmuls in all instead of three (the logits are not recomputed). The price
    is that [N, H] in hidden's dtype is held from forward to backward, where it becomes d(hidden)
    in place. When the weight is trainable, d(weight) needs the logits again anyway."""
    return torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad


_lib.impl("selective_logprob", _selective_logprob_composite, "CompositeImplicitAutograd")


def selective_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float = 0.0,
    with_entropy: bool = False,
):
    """Log-probabilities (fp32) of `targets` under softmax((hidden @ weight.T) * logit_scale
    [soft-capped] / temperature), without materializing the logits.

    hidden [..., H] (fp32/fp16/bf16, any strides), weight [V, H] (the lm_head or, for tied
    embeddings, the embedding matrix itself; not copied), targets [...] int64 in [0, V) or -100
    (ignored: log-prob 0, no gradient). softcap 0 means none, logit_scale 1 means none.
    Returns logp [...] fp32, or (logp, entropy) with `with_entropy` (entropy of each row, fp32).

    Logits are kept in fp32 (not rounded to bf16 as HF's bf16 `log_softmax` does): a
    deliberate, more exact change. Results do not depend on how the rows are batched or
    chunked (bitwise). Gradients flow to hidden, and to weight only when it requires grad.
    A hidden that cannot be viewed as [N, H] (e.g. a slice along the sequence) is copied.
    """
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(
            f"fastgrpo::{_OP}: targets shape {tuple(targets.shape)} must equal hidden's leading shape {tuple(lead)}"
        )
    logp, entropy = torch.ops.fastgrpo.selective_logprob(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
        float(temperature), float(logit_scale), float(softcap), bool(with_entropy),
    )
    if with_entropy:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead)
