"""Rotary position embedding on q and k in one pass, saving only cos and sin for backward.

    torch.ops.fastgrpo.rope(q, k, cos, sin, rotary_dim, interleaved) -> (q_out, k_out)

q [..., D] and k [..., D] (HF: [B, Hq, S, D] and [B, Hkv, S, D], usually transposed views of
[B, S, H, D]); cos and sin as the HF graph holds them after `unsqueeze`, broadcastable to
q[..., :rotary_dim] and k[..., :rotary_dim] (e.g. [B, 1, S, rd] or [1, 1, S, rd]). Channels
>= rotary_dim pass through unchanged (partial rotary: Phi, GLM).

Layouts, with cos/sin used at every channel exactly as given (no assumption that the two
halves repeat; cos/sin of width rotary_dim / 2 in the half-rotation layout say that they do:
both halves of the channels use them, as with HF's `cat((freqs, freqs), -1)`, and the kernel
reads half the bytes of cos and sin):
  half-rotation (HF `rotate_half`):  out = x * cos + cat(-x2, x1) * sin  over the first rd channels
  interleaved (GPT-J, pairs 2i, 2i+1): out[2i]   = x[2i] * cos[2i]     - x[2i+1] * sin[2i]
                                      out[2i+1] = x[2i+1] * cos[2i+1] + x[2i] * sin[2i+1]
Maths in fp32; outputs are contiguous, of dtype promote(x, cos, sin) as torch would give.

Backward applies the transposed rotation (for half-rotation dx = dy*cos + cat(v2, -v1) with
v = dy*sin), so it needs cos and sin only: no copy of q or k is kept. cos and sin get no
gradient; they come from position ids, and an input cos/sin that requires grad is refused.
The ops are triton_ops: in a compiled training graph inductor launches the kernel itself (see
`_dispatch.traced` and rms_norm.py).
"""
import torch
import triton
import triton.language as tl

from fastgrpo.kernels import _dispatch


@triton.jit
def _rope_rotate(
    x_ptr, cos_ptr, sin_ptr, b, offs_s, seq_len, h0, n_heads, half,
    x_sb, x_sh, x_ss, x_sd,
    c_sb, c_sh, c_ss, c_sd,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    COS_PER_HEAD: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, COS_HALF: tl.constexpr,
):
    """Loads heads h0 .. h0 + BLOCK_H of x at positions offs_s of batch row b, with their cos/sin, and
    returns the two rotated halves in fp32 as [BLOCK_H, BLOCK_S, BLOCK_HALF] tiles. Half-rotation pairs
    channel j with j + half (two contiguous loads); interleaved pairs 2j with 2j + 1 (one contiguous
    load split into even/odd lanes, so memory access stays coalesced). COS_HALF: cos/sin hold only
    the first half of the channels, the second being the same (HF's `cat((freqs, freqs), -1)`)."""
    s = offs_s[None, :, None]
    h = h0 + tl.arange(0, BLOCK_H)[:, None, None]
    if INTERLEAVED:
        c = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        c_ok = c < 2 * half
    else:
        c = tl.arange(0, BLOCK_HALF)[None, None, :]
        c_ok = c < half
    mask = (h < n_heads) & (s < seq_len) & c_ok
    # cos/sin that do not vary over heads are one [1, BLOCK_S, channels] tile for every head.
    cs = b * c_sb + s * c_ss + c * c_sd + (h * c_sh if COS_PER_HEAD else 0)
    cs_mask = mask if COS_PER_HEAD else (s < seq_len) & c_ok
    xs = x_ptr + b * x_sb + h * x_sh + s * x_ss + c * x_sd
    if INTERLEAVED:
        cos = tl.load(cos_ptr + cs, mask=cs_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs, mask=cs_mask, other=0.0).to(tl.float32)
        x = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
        c1, c2 = tl.split(tl.reshape(cos, (cos.shape[0], cos.shape[1], BLOCK_HALF, 2)))
        s1, s2 = tl.split(tl.reshape(sin, (sin.shape[0], sin.shape[1], BLOCK_HALF, 2)))
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, x.shape[1], BLOCK_HALF, 2)))
    else:
        c1 = tl.load(cos_ptr + cs, mask=cs_mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=cs_mask, other=0.0).to(tl.float32)
        if COS_HALF:
            c2, s2 = c1, s1
        else:
            c2 = tl.load(cos_ptr + cs + half * c_sd, mask=cs_mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + cs + half * c_sd, mask=cs_mask, other=0.0).to(tl.float32)
        x1 = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xs + half * x_sd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # Transpose of the forward matrix [[c1, -s1], [s2, c2]].
        return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_store(
    o_ptr, y1, y2, b, offs_s, seq_len, h0, n_heads, half,
    o_sb, o_sh, o_ss, o_sd,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    s = offs_s[None, :, None]
    h = h0 + tl.arange(0, BLOCK_H)[:, None, None]
    os = o_ptr + b * o_sb + h * o_sh + s * o_ss
    if INTERLEAVED:
        c = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        y = tl.reshape(tl.join(y1, y2), (BLOCK_H, y1.shape[1], 2 * BLOCK_HALF))
        tl.store(os + c * o_sd, y.to(o_ptr.dtype.element_ty), mask=(h < n_heads) & (s < seq_len) & (c < 2 * half))
    else:
        c = tl.arange(0, BLOCK_HALF)[None, None, :]
        mask = (h < n_heads) & (s < seq_len) & (c < half)
        tl.store(os + c * o_sd, y1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(os + (c + half) * o_sd, y2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_pass_through(
    x_ptr, o_ptr, b, offs_s, seq_len, n_heads, rotary_dim, n_pass,
    x_sb, x_sh, x_ss, x_sd,
    o_sb, o_sh, o_ss, o_sd,
    BLOCK_H: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Copies channels >= rotary_dim (partial rotary) of every head."""
    s = offs_s[None, :, None]
    p = rotary_dim + tl.arange(0, BLOCK_PASS)[None, None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None, None]
        mask = (h < n_heads) & (s < seq_len) & (p < rotary_dim + n_pass)
        v = tl.load(x_ptr + b * x_sb + h * x_sh + s * x_ss + p * x_sd, mask=mask, other=0.0)
        tl.store(o_ptr + b * o_sb + h * o_sh + s * o_ss + p * o_sd, v.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_heads(
    x_ptr, o_ptr, cos_ptr, sin_ptr, b, offs_s, seq_len, n_heads, half,
    x_sb, x_sh, x_ss, x_sd,
    o_sb, o_sh, o_ss, o_sd,
    c_sb, c_sh, c_ss, c_sd,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    COS_PER_HEAD: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, COS_HALF: tl.constexpr,
):
    """Rotates every head of x, BLOCK_H heads at a time."""
    for h0 in range(0, n_heads, BLOCK_H):
        y1, y2 = _rope_rotate(x_ptr, cos_ptr, sin_ptr, b, offs_s, seq_len, h0, n_heads, half,
                              x_sb, x_sh, x_ss, x_sd, c_sb, c_sh, c_ss, c_sd,
                              BLOCK_H, BLOCK_HALF, COS_PER_HEAD, INTERLEAVED, BACKWARD, COS_HALF)
        _rope_store(o_ptr, y1, y2, b, offs_s, seq_len, h0, n_heads, half, o_sb, o_sh, o_ss, o_sd,
                    BLOCK_H, BLOCK_HALF, INTERLEAVED)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    seq_len, n_heads_q, n_heads_k, half, n_pass,
    q_sb, q_sh, q_ss, q_sd,
    k_sb, k_sh, k_ss, k_sd,
    qo_sb, qo_sh, qo_ss, qo_sd,
    ko_sb, ko_sh, ko_ss, ko_sd,
    cq_sb, cq_sh, cq_ss, cq_sd,
    ck_sb, ck_sh, ck_ss, ck_sd,
    BLOCK_S: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    COS_PER_HEAD: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, COS_HALF: tl.constexpr,
    HAS_K: tl.constexpr, ONE_BLOCK: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()  # launched as a programmatic dependent: the kernel before has finished
    # Each program owns BLOCK_S positions of one batch row and rotates every q and k head there,
    # so cos/sin for those positions are read from memory once.
    pid = tl.program_id(0)
    n_s_blocks = tl.cdiv(seq_len, BLOCK_S)
    b = (pid // n_s_blocks).to(tl.int64)
    offs_s = ((pid % n_s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    if ONE_BLOCK:
        # All q heads and all k heads fit one block each: every load is issued before the first
        # store. A program's work is small (one position: 3.5 KB at Qwen2.5-1.5B), so loading k only
        # after q's stores (which may alias it, as far as the compiler knows) cost a second memory
        # round trip per program: 83 % of copy bandwidth against Liger's 93 % (`python bench/bench_rope.py`, H200).
        yq1, yq2 = _rope_rotate(q_ptr, cos_ptr, sin_ptr, b, offs_s, seq_len, 0, n_heads_q, half,
                                q_sb, q_sh, q_ss, q_sd, cq_sb, cq_sh, cq_ss, cq_sd,
                                BLOCK_HQ, BLOCK_HALF, COS_PER_HEAD, INTERLEAVED, BACKWARD, COS_HALF)
        yk1, yk2 = _rope_rotate(k_ptr, cos_ptr, sin_ptr, b, offs_s, seq_len, 0, n_heads_k, half,
                                k_sb, k_sh, k_ss, k_sd, ck_sb, ck_sh, ck_ss, ck_sd,
                                BLOCK_HK, BLOCK_HALF, COS_PER_HEAD, INTERLEAVED, BACKWARD, COS_HALF)
        _rope_store(qo_ptr, yq1, yq2, b, offs_s, seq_len, 0, n_heads_q, half, qo_sb, qo_sh, qo_ss, qo_sd,
                    BLOCK_HQ, BLOCK_HALF, INTERLEAVED)
        _rope_store(ko_ptr, yk1, yk2, b, offs_s, seq_len, 0, n_heads_k, half, ko_sb, ko_sh, ko_ss, ko_sd,
                    BLOCK_HK, BLOCK_HALF, INTERLEAVED)
    else:
        _rope_heads(q_ptr, qo_ptr, cos_ptr, sin_ptr, b, offs_s, seq_len, n_heads_q, half,
                    q_sb, q_sh, q_ss, q_sd, qo_sb, qo_sh, qo_ss, qo_sd, cq_sb, cq_sh, cq_ss, cq_sd,
                    BLOCK_HQ, BLOCK_HALF, COS_PER_HEAD, INTERLEAVED, BACKWARD, COS_HALF)
        if HAS_K:
            _rope_heads(k_ptr, ko_ptr, cos_ptr, sin_ptr, b, offs_s, seq_len, n_heads_k, half,
                        k_sb, k_sh, k_ss, k_sd, ko_sb, ko_sh, ko_ss, ko_sd, ck_sb, ck_sh, ck_ss, ck_sd,
                        BLOCK_HK, BLOCK_HALF, COS_PER_HEAD, INTERLEAVED, BACKWARD, COS_HALF)
    if BLOCK_PASS > 0:
        _rope_pass_through(q_ptr, qo_ptr, b, offs_s, seq_len, n_heads_q, 2 * half, n_pass,
                           q_sb, q_sh, q_ss, q_sd, qo_sb, qo_sh, qo_ss, qo_sd, BLOCK_HQ, BLOCK_PASS)
        if HAS_K:
            _rope_pass_through(k_ptr, ko_ptr, b, offs_s, seq_len, n_heads_k, 2 * half, n_pass,
                               k_sb, k_sh, k_ss, k_sd, ko_sb, ko_sh, ko_ss, ko_sd, BLOCK_HK, BLOCK_PASS)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """View as [batch, heads, positions, channels]: pad leading dims with 1, merge extra ones."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    if t.dim() > 4:
        t = t.flatten(0, t.dim() - 4)  # copies only if the leading dims cannot be merged
    return t


def _cos_half(cos, rotary_dim: int, interleaved: bool) -> bool:
    """Whether cos/sin give only the first half of the rotated channels (the second repeats it)."""
    return not interleaved and 2 * cos.shape[-1] == rotary_dim


def _launch(x_pairs, cos, sin, rotary_dim, interleaved, backward):
    """Rotate each (input, output) pair; q and k go through one launch when they share batch and
    position sizes (always, for HF attention)."""
    x_pairs = [(x, out) for x, out in x_pairs if x.numel() > 0]
    if not x_pairs:
        return
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        cos, sin = (t.contiguous() for t in torch.broadcast_tensors(cos, sin))
    cos_half = _cos_half(cos, rotary_dim, interleaved)
    views = []
    for x, out in x_pairs:
        rot_shape = x.shape[:-1] + (rotary_dim // 2 if cos_half else rotary_dim,)
        cx, sx = _as_4d(cos.expand(rot_shape)), _as_4d(sin.expand(rot_shape))
        if cx.stride() != sx.stride():  # only when merging >4 leading dims copied one of them
            cx, sx = cx.contiguous(), sx.contiguous()
        views.append((_as_4d(x), _as_4d(out), cx, sx))
    if len(views) == 2:
        (q4, _, _, _), (k4, _, _, _) = views
        # One launch reads k's cos/sin through q's pointers: they must be views of the same memory, which they are
        # unless merging more than 4 leading dims copied them.
        if (k4.shape[0], k4.shape[2]) != (q4.shape[0], q4.shape[2]) or any(x.dim() > 4 for x, _ in x_pairs):
            for view in views:
                _launch_views([view], rotary_dim, interleaved, backward, cos_half)
            return
    _launch_views(views, rotary_dim, interleaved, backward, cos_half)


def _cuda_config(n_heads_q: int, n_heads_k: int, block_half: int) -> tuple[int, int, int, int]:
    """(q heads, k heads, positions per program, num_warps): the fastest of `python bench/bench_rope.py --sweep`
    (H200). One position and all heads per program keeps the most bytes in flight (more positions per program
    only for few heads), with the fewest warps that hold the program's q and k tiles at up to ~80 elements a
    thread: 1 warp at Qwen2.5-1.5B's 12 + 2 heads (62.5 us against 64.8 with 2 warps, 94 % of copy bandwidth),
    2 at Llama-8B's 32 + 8. Not a function of the sequence length, which a compiled graph holds as a symbol
    (masks cover short sequences)."""
    block_hq = min(_dispatch.next_power_of_2(n_heads_q), 32)
    block_hk = min(_dispatch.next_power_of_2(max(n_heads_k, 1)), 32)
    block_s = max(1, 2048 // (block_hq * 2 * block_half))
    elements = (block_hq + block_hk) * 2 * block_half * block_s
    return block_hq, block_hk, block_s, min(8, _dispatch.next_power_of_2(_dispatch.cdiv(elements, 2560)))


def _launch_views(views, rotary_dim, interleaved, backward, cos_half):
    q4, qo4, cq4, sq4 = views[0]
    k4, ko4, ck4, _ = views[-1]
    has_k = len(views) == 2
    batch, n_heads_q, seq_len, head_dim = q4.shape
    n_heads_k = k4.shape[1] if has_k else 0
    half = rotary_dim // 2
    n_pass = head_dim - rotary_dim
    block_half = _dispatch.next_power_of_2(half)
    block_pass = _dispatch.next_power_of_2(n_pass) if n_pass > 0 else 0
    if _dispatch.launch_like_cuda(q4):
        block_hq, block_hk, block_s, num_warps = _cuda_config(n_heads_q, n_heads_k, block_half)
    else:
        # Triton interpreter: few, large programs (interpretation cost is per program).
        # Head blocks capped at 4 so that tests with more heads also run the kernel's loop over blocks.
        block_hq = min(_dispatch.next_power_of_2(n_heads_q), 4)
        block_hk = min(_dispatch.next_power_of_2(max(n_heads_k, 1)), 4)
        block_s = min(_dispatch.next_power_of_2(seq_len), 64)
        num_warps = 4
    grid = (batch * _dispatch.cdiv(seq_len, block_s),)
    _dispatch.launcher(_rope_kernel)[grid](
        q4, k4, qo4, ko4, cq4, sq4,
        seq_len, n_heads_q, n_heads_k, half, n_pass,
        *q4.stride(), *k4.stride(), *qo4.stride(), *ko4.stride(), *cq4.stride(), *ck4.stride(),
        BLOCK_S=block_s, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        COS_PER_HEAD=cq4.stride(1) != 0 or (has_k and ck4.stride(1) != 0),
        INTERLEAVED=interleaved, BACKWARD=backward, COS_HALF=cos_half, HAS_K=has_k,
        ONE_BLOCK=has_k and n_heads_q <= block_hq and n_heads_k <= block_hk,
        # Its launch overlaps the end of the kernel before it (sm_90+); it waits for that kernel's writes.
        **_dispatch.dependent_launch_args(q4), num_warps=num_warps,
    )


def _rope_torch(x, cos, sin, rotary_dim, interleaved, backward, out_dtype):
    """fp32 torch version of the kernel (CPU path), same layouts and same transposed backward."""
    rot = x[..., :rotary_dim].float()
    cos, sin = cos.float(), sin.float()
    if _cos_half(cos, rotary_dim, interleaved):
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    if interleaved:
        x1, x2, c1, c2, s1, s2 = rot[..., 0::2], rot[..., 1::2], cos[..., 0::2], cos[..., 1::2], sin[..., 0::2], sin[..., 1::2]
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if backward:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    out = _empty_out(x, out_dtype)
    if interleaved:
        out[..., :rotary_dim] = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        out[..., :rotary_dim] = torch.cat((y1, y2), dim=-1)
    out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def _check(q, k, cos, sin, rotary_dim, interleaved):
    for t in (q, k, cos, sin):
        _dispatch.check_dtype("rope", t)
    if not (q.device == k.device == cos.device == sin.device):
        raise ValueError(f"fastgrpo::rope: q, k, cos, sin must share a device, got {q.device}, {k.device}, "
                         f"{cos.device}, {sin.device}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"fastgrpo::rope: q and k head dims differ ({head_dim} vs {k.shape[-1]})")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"fastgrpo::rope: rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    for x in (q, k):
        target = (*x.shape[:-1], rotary_dim // 2 if _cos_half(cos, rotary_dim, interleaved) else rotary_dim)
        for name, t in (("cos", cos), ("sin", sin)):
            if len(t.shape) > len(target) or any(a != 1 and a != b for a, b in zip(reversed(t.shape), reversed(target))):
                raise ValueError(f"fastgrpo::rope: {name} of shape {tuple(t.shape)} does not broadcast to "
                                 f"{tuple(target)} (x[..., :rotary_dim], or its first half: see the module's doc)")


def _empty_out(x, dtype):
    # x's own layout (HF's q/k are [B, S, H, D] memory seen as [B, H, S, D]): writes stay contiguous,
    # the result matches what HF's elementwise RoPE returns, and the gradient SDPA sends back
    # (laid out like its input) transposes back to [B, S, H*D] as a view. Real and fake agree.
    return torch.empty_like(x, dtype=dtype)


def _out_dtype(x, cos, sin):
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


# triton_ops: a compiled graph launches the kernel itself (see _dispatch.traced); eagerly the body runs as written.
@torch.library.triton_op("fastgrpo::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, cos, sin, rotary_dim, interleaved)
    q_dtype, k_dtype = _out_dtype(q, cos, sin), _out_dtype(k, cos, sin)
    if not _dispatch.launches_triton(q):
        return (
            _rope_torch(q, cos, sin, rotary_dim, interleaved, False, q_dtype),
            _rope_torch(k, cos, sin, rotary_dim, interleaved, False, k_dtype),
        )
    q_out, k_out = _empty_out(q, q_dtype), _empty_out(k, k_dtype)
    _launch([(q, q_out), (k, k_out)], cos, sin, rotary_dim, interleaved, backward=False)
    return q_out, k_out


@torch.library.triton_op("fastgrpo::rope_backward", mutates_args=())
def _rope_backward_op(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    rotary_dim: int, interleaved: bool, q_dtype: torch.dtype, k_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _dispatch.launches_triton(dq_out):
        return (
            _rope_torch(dq_out, cos, sin, rotary_dim, interleaved, True, q_dtype),
            _rope_torch(dk_out, cos, sin, rotary_dim, interleaved, True, k_dtype),
        )
    dq, dk = _empty_out(dq_out, q_dtype), _empty_out(dk_out, k_dtype)
    _launch([(dq_out, dq), (dk_out, dk)], cos, sin, rotary_dim, interleaved, backward=True)
    return dq, dk


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, rotary_dim, interleaved = inputs
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "fastgrpo::rope gives no gradient for cos/sin (they come from position ids); "
            "got cos/sin that require grad: detach them or leave this site unfused"
        )
    ctx.save_for_backward(cos, sin)
    ctx.rotary_dim, ctx.interleaved = rotary_dim, interleaved
    ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype


def _backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    dq, dk = _rope_backward_op(dq_out, dk_out, cos, sin, ctx.rotary_dim, ctx.interleaved, ctx.q_dtype, ctx.k_dtype)
    return dq, dk, None, None, None, None


_rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding to q and k; returns new contiguous (q_out, k_out).

    q, k: [..., D] (any strides; GQA head counts may differ). cos, sin: broadcastable to
    q[..., :rotary_dim] and k[..., :rotary_dim], as HF has them after `unsqueeze`.
    rotary_dim: even number of leading channels to rotate (default: cos.shape[-1]); the rest
    pass through. interleaved: GPT-J pairs (2i, 2i+1) instead of HF's rotate_half halves.
    Half-rotation cos/sin of width rotary_dim / 2 stand for both halves (pass rotary_dim then).
    cos and sin receive no gradient and must not require one.
    """
    if rotary_dim is None:
        rotary_dim = cos.shape[-1]
    return torch.ops.fastgrpo.rope(q, k, cos, sin, rotary_dim, interleaved)
