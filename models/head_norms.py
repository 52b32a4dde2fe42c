"""RMSNorm over each head's D elements, many rows per program: the attention layer's per-head norms
(the l2 and rms QK-norms, each followed by RoPE in the same kernel (`head_norm_rope`), and the per-head
output norm (`head_rms_norm`) of models/gpt.py).

x (..., S, D) holds T tokens (the product of the leading dims) of S head slots of D elements each;
every row of D is normalized in fp32 arithmetic, times its slot's weight (none, one for every slot,
or two by a slot rule: the first `first_slots` of every `period` slots take `weight`, the rest
`second_weight`, i.e. q heads then k heads of each q/k view), times a constant `scale`, rounded once
to `out_dtype`. torch's fused rms_norm runs one thread block per row, which for rows of 64 elements
leaves the GPU mostly idle; these kernels give each program a block of rows of one slot (about 4096
elements), read x through its token and slot strides (the q/k heads are a slice of the qkv
projection), and save each row's rstd (T, S) fp32 for the backward, whose weight gradients are
per-program partial sums (n_t_blocks, S, D) that torch adds up (deterministic: no atomics).

`head_rms_norm` runs the kernels on CUDA in eager mode; under torch.compile (inductor fuses the plain
form itself), off CUDA, or for float64 it computes the same math with plain torch ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attn.kernels.env import interpreting
from attn.kernels.runtime import Kernel, TileConfig, direct_apply, once_differentiable

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# devices whose tensors take the kernels when not forced (tests add "cpu" to run the model's norms
# through them under the interpreter)
KERNEL_DEVICE_TYPES = ("cuda",)
MAX_KERNEL_HEAD_DIM = 1024  # rows longer than this take the plain form (one program holds BLOCK_M x BLOCK_N)
ELEMENTS_PER_PROGRAM = 4096  # BLOCK_M (rows) x BLOCK_N (D padded to a power of two) on a GPU
INTERPRET_ROWS = 16  # rows per program under the interpreter: small test shapes still span several row blocks


@triton.jit
def _slot_weight(W_A, W_B, s, first_slots, period, cols, col_ok, HAS_B: tl.constexpr):
    """The (BLOCK_N,) fp32 weight of slot s: W_A for the first `first_slots` of every `period` slots,
    W_B for the rest (W_A for all without W_B)."""
    W = W_A
    if HAS_B:
        W = tl.where(s % period < first_slots, W_A, W_B)
    return tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _row_block(T, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's block: (row block, slot, its BLOCK_M rows, BLOCK_N columns, which rows exist and which
    of the columns fall inside `width` (D, or D/2 for a RoPE half), their 2-d mask)."""
    pid_t = tl.program_id(0)
    s = tl.program_id(1)
    rows = (pid_t * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < width
    return pid_t, s, rows, cols, row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


@triton.jit
def _head_rms_norm_fwd(X, W_A, W_B, OUT, RSTD, T, S, D, stride_xt, stride_xs, first_slots, period, eps, scale,
                       HAS_WEIGHT: tl.constexpr, HAS_B: tl.constexpr, ROUND_W: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """out[t, s] = x[t, s] * rstd * w[s] * scale, rstd = 1 / sqrt(mean(x[t, s]^2) + eps), for BLOCK_M
    rows t of slot s (BLOCK_N: D padded to a power of two); ROUND_W: w rounded to OUT's dtype first. OUT
    is contiguous (T, S, D), RSTD (T, S) fp32."""
    pid_t, s, rows, cols, row_ok, col_ok, mask = _row_block(T, D, BLOCK_M, BLOCK_N)
    x = tl.load(X + rows[:, None] * stride_xt + s * stride_xs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = _slot_weight(W_A, W_B, s, first_slots, period, cols, col_ok, HAS_B)
        if ROUND_W:
            w = w.to(OUT.dtype.element_ty).to(tl.float32)
        y = y * w[None, :]
    y = y * scale
    tl.store(OUT + (rows[:, None] * S + s) * D + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows * S + s, rstd, mask=row_ok)


@triton.jit
def _head_rms_norm_bwd(X, W_A, W_B, DY, RSTD, DX, DW, T, S, D, stride_xt, stride_xs, stride_dyt, stride_dys,
                       first_slots, period, scale, HAS_WEIGHT: tl.constexpr, HAS_B: tl.constexpr,
                       ROUND_W: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """dx = rstd * (g - xhat * mean(g * xhat)) with xhat = x * rstd, g = dy * w[s] * scale (ROUND_W: w
    rounded to DY's dtype, the forward's output dtype, first); with
    WEIGHT_GRAD, DW[pid_t, s] = sum over the program's rows of dy * xhat * scale (DW (n_t_blocks, S, D)
    fp32). DX is contiguous (T, S, D)."""
    pid_t, s, rows, cols, row_ok, col_ok, mask = _row_block(T, D, BLOCK_M, BLOCK_N)
    x = tl.load(X + rows[:, None] * stride_xt + s * stride_xs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dyt + s * stride_dys + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows * S + s, mask=row_ok, other=0.0)
    xhat = x * rstd[:, None]
    g = dy * scale
    if HAS_WEIGHT:
        w = _slot_weight(W_A, W_B, s, first_slots, period, cols, col_ok, HAS_B)
        if ROUND_W:
            w = w.to(DY.dtype.element_ty).to(tl.float32)
        g = g * w[None, :]
    mean_gx = tl.sum(g * xhat, axis=1) / D
    dx = rstd[:, None] * (g - xhat * mean_gx[:, None])
    tl.store(DX + (rows[:, None] * S + s) * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        dw = tl.sum(dy * xhat, axis=0) * scale
        tl.store(DW + (pid_t * S + s) * D + cols, dw, mask=col_ok)


@triton.jit
def _rotary_tile(COS, SIN, n_pos, half, rows, halves, mask):
    """The (BLOCK_M, BLOCK_N) cos and sin of the rows' positions (row t sits at position t % n_pos), one
    per pair of columns (c, c + D/2); BLOCK_N is D/2 padded to a power of two."""
    pos = rows % n_pos
    cos = tl.load(COS + pos[:, None] * half + halves[None, :], mask=mask, other=0.0)
    sin = tl.load(SIN + pos[:, None] * half + halves[None, :], mask=mask, other=0.0)
    return cos, sin


@triton.jit
def _head_norm_rope_fwd(X, W_A, W_B, COS, SIN, OUT, RSTD, T, S, D, n_pos, stride_xt, stride_xs, first_slots,
                        period, eps, scale, HAS_WEIGHT: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """The norm of `_head_rms_norm_fwd` followed by RoPE: with y = x rstd w scale in halves (y1, y2) =
    (columns [0, D/2), [D/2, D)), out = (y1 cos - y2 sin, y1 sin + y2 cos) at the row's position
    (t % n_pos; COS, SIN (n_pos, D/2) fp32), rounded once to OUT's dtype."""
    half = D // 2
    pid_t, s, rows, halves, row_ok, col_ok, mask = _row_block(T, half, BLOCK_M, BLOCK_N)
    x_ptrs = X + rows[:, None] * stride_xt + s * stride_xs + halves[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    tl.store(RSTD + rows * S + s, rstd, mask=row_ok)
    y1 = x1 * rstd[:, None] * scale
    y2 = x2 * rstd[:, None] * scale
    if HAS_WEIGHT:
        y1 = y1 * _slot_weight(W_A, W_B, s, first_slots, period, halves, col_ok, HAS_B)[None, :]
        y2 = y2 * _slot_weight(W_A, W_B, s, first_slots, period, halves + half, col_ok, HAS_B)[None, :]
    cos, sin = _rotary_tile(COS, SIN, n_pos, half, rows, halves, mask)
    out_ptrs = OUT + (rows[:, None] * S + s) * D + halves[None, :]
    tl.store(out_ptrs, (y1 * cos - y2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + half, (y1 * sin + y2 * cos).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _head_norm_rope_bwd(X, W_A, W_B, COS, SIN, DY, RSTD, DX, DW, T, S, D, n_pos, stride_xt, stride_xs, stride_dyt,
                        stride_dys, first_slots, period, scale, HAS_WEIGHT: tl.constexpr, HAS_B: tl.constexpr,
                        WEIGHT_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gradient of `_head_norm_rope_fwd`: the rotation's transpose turns dout's halves (g1, g2) into
    the norm's output gradient (g1 cos + g2 sin, g2 cos - g1 sin), then `_head_rms_norm_bwd`'s formulas."""
    half = D // 2
    pid_t, s, rows, halves, row_ok, col_ok, mask = _row_block(T, half, BLOCK_M, BLOCK_N)
    dy_ptrs = DY + rows[:, None] * stride_dyt + s * stride_dys + halves[None, :]
    g1 = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
    g2 = tl.load(dy_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    cos, sin = _rotary_tile(COS, SIN, n_pos, half, rows, halves, mask)
    dy1 = g1 * cos + g2 * sin
    dy2 = g2 * cos - g1 * sin
    gw1 = dy1 * scale
    gw2 = dy2 * scale
    if HAS_WEIGHT:
        gw1 = gw1 * _slot_weight(W_A, W_B, s, first_slots, period, halves, col_ok, HAS_B)[None, :]
        gw2 = gw2 * _slot_weight(W_A, W_B, s, first_slots, period, halves + half, col_ok, HAS_B)[None, :]
    x_ptrs = X + rows[:, None] * stride_xt + s * stride_xs + halves[None, :]
    rstd = tl.load(RSTD + rows * S + s, mask=row_ok, other=0.0)
    xhat1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
    xhat2 = tl.load(x_ptrs + half, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
    mean_gx = (tl.sum(gw1 * xhat1, axis=1) + tl.sum(gw2 * xhat2, axis=1)) / D
    dx_ptrs = DX + (rows[:, None] * S + s) * D + halves[None, :]
    tl.store(dx_ptrs, (rstd[:, None] * (gw1 - xhat1 * mean_gx[:, None])).to(DX.dtype.element_ty), mask=mask)
    tl.store(dx_ptrs + half, (rstd[:, None] * (gw2 - xhat2 * mean_gx[:, None])).to(DX.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(DW + (pid_t * S + s) * D + halves, tl.sum(dy1 * xhat1, axis=0) * scale, mask=col_ok)
        tl.store(DW + (pid_t * S + s) * D + halves + half, tl.sum(dy2 * xhat2, axis=0) * scale, mask=col_ok)


_FWD = Kernel(_head_rms_norm_fwd, "head_rms_norm_fwd")
_BWD = Kernel(_head_rms_norm_bwd, "head_rms_norm_bwd")
_ROPE_FWD = Kernel(_head_norm_rope_fwd, "head_norm_rope_fwd")
_ROPE_BWD = Kernel(_head_norm_rope_bwd, "head_norm_rope_bwd")


def _config(d: int) -> TileConfig:
    """The one launch config for rows of d elements: block_m rows per program, block_n = d padded."""
    return _config_for(d, interpreting())


@functools.cache
def _config_for(d: int, interpreter: bool) -> TileConfig:
    # built once per row length: a call's host time counts (the eager step is host-bound)
    block_n = 1 << (d - 1).bit_length()
    block_m = INTERPRET_ROWS if interpreter else max(1, ELEMENTS_PER_PROGRAM // block_n)
    return TileConfig(block_m, block_n, num_warps=4, num_stages=1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_stride(x: torch.Tensor) -> int | None:
    """The stride of x's tokens, its dims before the last two (S, D) taken as one, where they merge into
    one dim (as a view would), else None; 0 for a single token."""
    token, expected = 0, None
    for size, stride in zip(reversed(x.shape[:-2]), reversed(x.stride()[:-2])):
        if size == 1:
            continue
        if expected is None:
            token = stride
        elif stride != expected:
            return None
        expected = stride * size
    return token


def _token_layout(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, its token stride) with a unit D stride and tokens of one stride (a contiguous copy if need be):
    the layout the kernels read, x's shape kept (no view, so no view node in the autograd graph)."""
    token = _token_stride(x) if x.stride(-1) == 1 else None
    if token is None:
        x = x.contiguous()
        token = _token_stride(x)
    return x, token


class _HeadRMSNorm(torch.autograd.Function):
    """The kernels over x (..., S, D) with a unit D stride and tokens (the leading dims) of one stride
    `token_stride`; returns a contiguous tensor of x's shape."""

    @staticmethod
    def forward(ctx, x, token_stride, weight, second_weight, first_slots, period, eps, scale, out_dtype, round_weight):
        s, d = x.shape[-2], x.shape[-1]
        t = x.numel() // (s * d)
        cfg = _config(d)
        out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
        rstd = torch.empty((t, s), device=x.device, dtype=torch.float32)
        w_a = x if weight is None else weight
        w_b = w_a if second_weight is None else second_weight
        _FWD.run(cfg, (_cdiv(t, cfg.block_m), s), (x, w_a, w_b, out, rstd),
                 (t, s, d, token_stride, x.stride(-2), first_slots, period, eps, scale),
                 {"HAS_WEIGHT": weight is not None, "HAS_B": second_weight is not None, "ROUND_W": round_weight})
        ctx.save_for_backward(x, weight, second_weight, rstd)
        ctx.token_stride, ctx.first_slots, ctx.period, ctx.scale = token_stride, first_slots, period, scale
        ctx.out_dtype, ctx.round_weight, ctx.cfg = out_dtype, round_weight, cfg
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, second_weight, rstd = ctx.saved_tensors
        t, s = rstd.shape
        d = x.shape[-1]
        cfg = ctx.cfg  # the forward's launch config
        dy, dy_token_stride = _token_layout(dy)
        weight_grad = weight is not None and (ctx.needs_input_grad[2] or ctx.needs_input_grad[3])
        n_t_blocks = _cdiv(t, cfg.block_m)
        dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        # without a weight gradient the kernel writes no partial sums: rstd stands in for them
        partial = torch.empty((n_t_blocks, s, d), device=x.device, dtype=torch.float32) if weight_grad else rstd
        w_a = x if weight is None else weight
        w_b = w_a if second_weight is None else second_weight
        _BWD.run(cfg, (n_t_blocks, s), (x, w_a, w_b, dy, rstd, dx, partial),
                 (t, s, d, ctx.token_stride, x.stride(-2), dy_token_stride, dy.stride(-2), ctx.first_slots,
                  ctx.period, ctx.scale),
                 {"HAS_WEIGHT": weight is not None, "HAS_B": second_weight is not None, "ROUND_W": ctx.round_weight,
                  "WEIGHT_GRAD": weight_grad})
        d_weight, d_second = _weight_grads(partial, weight, second_weight, ctx.first_slots, ctx.period, weight_grad,
                                           ctx.out_dtype if ctx.round_weight else None)
        return dx, None, d_weight, d_second, None, None, None, None, None, None


def _weight_grads(partial, weight, second_weight, first_slots, period, weight_grad, rounded_to=None):
    """(d weight, d second_weight) from the per-program partial sums (n_t_blocks, S, D): one reduction
    per weight (the eager step pays per op on the host), cast to the weight's dtype where it is not
    fp32; None each without a weight gradient. rounded_to: the dtype the forward rounded the weight to
    (the gradient of weight.to(rounded_to), in the weight's dtype); one weight only."""
    if not weight_grad:
        return None, None
    if second_weight is None:
        d_weight = partial.sum((0, 1))
        if rounded_to is not None:
            d_weight = _as_dtype(d_weight, rounded_to)
        return _as_dtype(d_weight, weight.dtype), None
    n_t_blocks, s, d = partial.shape
    per_kind = partial.view(n_t_blocks, s // period, period, d)
    return (_as_dtype(per_kind[:, :, :first_slots].sum((0, 1, 2)), weight.dtype),
            _as_dtype(per_kind[:, :, first_slots:].sum((0, 1, 2)), second_weight.dtype))


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype) without the dispatcher's no-op call where t has that dtype already."""
    return t if t.dtype == dtype else t.to(dtype)


class _HeadNormRope(torch.autograd.Function):
    """`_HeadRMSNorm` followed by RoPE, in one kernel each way, over x (..., S, D) with a unit D stride and
    tokens of one stride `token_stride`, at positions t % n_pos (cos, sin (n_pos, D/2) fp32 tables);
    returns a contiguous tensor of x's shape."""

    @staticmethod
    def forward(ctx, x, token_stride, weight, second_weight, cos, sin, first_slots, period, eps, scale, out_dtype):
        s, d = x.shape[-2], x.shape[-1]
        t = x.numel() // (s * d)
        cfg = _config(d // 2)
        out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
        rstd = torch.empty((t, s), device=x.device, dtype=torch.float32)
        w_a = x if weight is None else weight
        w_b = w_a if second_weight is None else second_weight
        meta = {"HAS_WEIGHT": weight is not None, "HAS_B": second_weight is not None}
        _ROPE_FWD.run(cfg, (_cdiv(t, cfg.block_m), s), (x, w_a, w_b, cos, sin, out, rstd),
                      (t, s, d, cos.shape[0], token_stride, x.stride(-2), first_slots, period, eps, scale), meta)
        ctx.save_for_backward(x, weight, second_weight, cos, sin, rstd)
        ctx.meta, ctx.token_stride, ctx.first_slots, ctx.period, ctx.scale = meta, token_stride, first_slots, period, scale
        ctx.cfg = cfg
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, second_weight, cos, sin, rstd = ctx.saved_tensors
        t, s = rstd.shape
        d = x.shape[-1]
        cfg = ctx.cfg  # the forward's launch config
        dy, dy_token_stride = _token_layout(dy)
        weight_grad = weight is not None and (ctx.needs_input_grad[2] or ctx.needs_input_grad[3])
        n_t_blocks = _cdiv(t, cfg.block_m)
        dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        # without a weight gradient the kernel writes no partial sums: rstd stands in for them
        partial = torch.empty((n_t_blocks, s, d), device=x.device, dtype=torch.float32) if weight_grad else rstd
        w_a = x if weight is None else weight
        w_b = w_a if second_weight is None else second_weight
        _ROPE_BWD.run(cfg, (n_t_blocks, s), (x, w_a, w_b, cos, sin, dy, rstd, dx, partial),
                      (t, s, d, cos.shape[0], ctx.token_stride, x.stride(-2), dy_token_stride, dy.stride(-2),
                       ctx.first_slots, ctx.period, ctx.scale), {**ctx.meta, "WEIGHT_GRAD": weight_grad})
        d_weight, d_second = _weight_grads(partial, weight, second_weight, ctx.first_slots, ctx.period, weight_grad)
        return dx, None, d_weight, d_second, None, None, None, None, None, None, None


# the Functions' apply, without torch's Python layer where no functorch transform is active
_HEAD_RMS_NORM = direct_apply(_HeadRMSNorm)
_HEAD_NORM_ROPE = direct_apply(_HeadNormRope)


def _plain(x, weight, second_weight, first_slots, period, eps, scale, out_dtype):
    """The same norm in plain torch ops, which inductor fuses: one F.rms_norm of x's dtype with the
    weight inside when the output keeps x's dtype and one weight serves all slots, else F.rms_norm of
    x in out_dtype times the slots' weights."""
    d = x.shape[-1]
    with torch.autocast(x.device.type, enabled=False):
        if second_weight is None and out_dtype == x.dtype:
            if weight is None:
                w = x.new_full((d,), scale)
            else:
                w = (weight if scale == 1.0 else weight * scale).to(x.dtype)
            return F.rms_norm(x, (d,), w, eps)
        y = F.rms_norm(x.to(out_dtype), (d,), None, eps)
        if weight is not None:
            w = weight
            if second_weight is not None:
                w = torch.cat([weight.expand(first_slots, d), second_weight.expand(period - first_slots, d)])
                w = w.repeat(x.shape[-2] // period, 1)
            y = y * w.to(out_dtype)
        return y if scale == 1.0 else y * scale


def _kernel_runs(x: torch.Tensor, weights, out_dtype: torch.dtype) -> bool:
    """Whether the kernels serve this call when not forced: eager CUDA tensors of 16/32-bit types
    (plain tensors: fake and other subclass tensors are traced)."""
    if x.device.type not in KERNEL_DEVICE_TYPES or torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        return False
    if x.dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES or x.numel() == 0:
        return False
    if x.shape[-1] > MAX_KERNEL_HEAD_DIM:
        return False
    for w in weights:  # a loop, not all(generator): this runs on every eager call
        if w is not None and w.dtype not in KERNEL_DTYPES:
            return False
    return True


def _checked(x, weight, second_weight, first_slots, period, out_dtype, kernel):
    """(out_dtype, whether the kernels run) after the argument checks every entry shares."""
    if x.dim() < 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating tensor (..., S, D), got {x.dtype} of shape {tuple(x.shape)}")
    s, d = x.shape[-2], x.shape[-1]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating dtype, got {out_dtype}")
    for name, w in (("weight", weight), ("second_weight", second_weight)):
        if w is not None and w.shape != (d,):
            raise ValueError(f"{name} must have shape ({d},) (x's last dim), got {tuple(w.shape)}")
    if second_weight is not None:
        if weight is None:
            raise ValueError("second_weight needs weight (the first slots' weight)")
        if period <= 0 or s % period:
            raise ValueError(f"period must be > 0 and divide x's slot count {s}, got {period}")
        if not 0 <= first_slots <= period:
            raise ValueError(f"first_slots must be in [0, period={period}], got {first_slots}")
    if kernel is None:
        kernel = _kernel_runs(x, (weight, second_weight), out_dtype)
    elif kernel:
        if x.device.type != "cuda" and not interpreting():
            raise ValueError(f"kernel=True needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU); x is on {x.device}")
        if x.dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES:
            raise ValueError(f"kernel=True takes x and out_dtype in {KERNEL_DTYPES}, got {x.dtype} and {out_dtype}")
        if d > MAX_KERNEL_HEAD_DIM:
            raise ValueError(f"kernel=True takes rows of at most {MAX_KERNEL_HEAD_DIM} elements; x's last dim is {d}")
    return out_dtype, kernel


def _kernel_operands(x, weight, second_weight, first_slots, period, eps, out_dtype):
    """x in the kernels' layout (`_token_layout`) and its token stride, the weights in one dtype, the slot
    rule and eps as the kernels take them."""
    if eps is None:
        eps = torch.finfo(x.dtype if second_weight is None and out_dtype == x.dtype else out_dtype).eps
    x, token_stride = _token_layout(x)
    if second_weight is None:
        first_slots, period = 0, 1
    elif second_weight.dtype != weight.dtype:
        second_weight = second_weight.to(weight.dtype)  # the kernels read both through one pointer type
    return x, token_stride, second_weight, first_slots, period, float(eps)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float | None = None,
                  scale: float = 1.0, out_dtype: torch.dtype | None = None,
                  second_weight: torch.Tensor | None = None, first_slots: int = 0, period: int = 0,
                  round_weight: bool = False, kernel: bool | None = None) -> torch.Tensor:
    """RMSNorm of every row of D of x (..., S, D), times its slot's weight and `scale`, in `out_dtype`
    (default x's dtype), autocast off.

    weight: (D,) for every slot, or with `second_weight` (D,) the weight of the first `first_slots` of
    every `period` slots (S a multiple of period), the rest taking second_weight. eps: added to the
    mean square; None is the machine epsilon of the dtype the plain form normalizes in (x's dtype when
    out_dtype is x's and there is no second weight, else out_dtype), as F.rms_norm's None.
    round_weight: the weight (one for every slot, no second_weight) rounded to out_dtype first, as
    `weight.to(out_dtype)` passed in its place gives (autocast rounds linear weights so), its gradient
    too; the kernels round it as they read it, without a cast op and its autograd node.
    kernel: None runs the Triton kernels for eager CUDA tensors of fp16 / bf16 / fp32 (rows of at most
    MAX_KERNEL_HEAD_DIM) and the plain torch form otherwise (under torch.compile inductor fuses it); True
    forces the kernels (tests: on CPU under TRITON_INTERPRET=1); False forces the plain form.
    Gradients flow to x and the weights (not twice: the kernels' backward is not differentiable)."""
    out_dtype, kernel = _checked(x, weight, second_weight, first_slots, period, out_dtype, kernel)
    if round_weight and second_weight is not None:
        raise ValueError("round_weight serves one weight for every slot (no second_weight)")
    round_weight = bool(round_weight) and weight is not None and weight.dtype != out_dtype
    if not kernel:
        if round_weight:
            weight = weight.to(out_dtype)
        return _plain(x, weight, second_weight, first_slots, period, eps, scale, out_dtype)
    x, token_stride, second_weight, first_slots, period, eps = _kernel_operands(x, weight, second_weight,
                                                                              first_slots, period, eps, out_dtype)
    return _HEAD_RMS_NORM(x, token_stride, weight, second_weight, first_slots, period, eps, float(scale), out_dtype,
                          round_weight)


@functools.cache
def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in plain torch ops: x (..., N, S, D) in fp32 arithmetic, pairs (c, c + D/2) rotated by the
    angle of each token's position (cos, sin (N, D/2)), in x's dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def head_norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None, *,
                   eps: float | None = None, scale: float = 1.0, out_dtype: torch.dtype | None = None,
                   second_weight: torch.Tensor | None = None, first_slots: int = 0, period: int = 0,
                   kernel: bool | None = None) -> torch.Tensor:
    """`head_rms_norm` followed by RoPE, one kernel each way on the kernels' path, rounded once to
    `out_dtype`: x (..., N, S, D) holds N positions (dim -3) of S head slots, cos and sin (N, D/2) are
    the rotation's tables at those positions (the kernels read them in fp32), and each row's pairs of
    columns (c, c + D/2) are rotated as (y1 cos - y2 sin, y1 sin + y2 cos). The plain form:
    `head_rms_norm`'s in fp32 (or wider), then `rotate_pairs`, then out_dtype. eps None is that
    normalizing dtype's machine epsilon."""
    out_dtype, kernel = _checked(x, weight, second_weight, first_slots, period, out_dtype, kernel)
    if x.dim() < 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be (..., N, S, D) with an even D, got shape {tuple(x.shape)}")
    n, d = x.shape[-3], x.shape[-1]
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (n, d // 2) or not table.dtype.is_floating_point or table.device != x.device:
            raise ValueError(f"{name} must be a floating ({n}, {d // 2}) tensor on {x.device} (x's positions, "
                             f"D / 2), got {table.dtype} {tuple(table.shape)} on {table.device}")
    wide = _at_least_fp32(out_dtype)
    if eps is None:
        eps = torch.finfo(wide).eps
    if not kernel:
        y = _plain(x, weight, second_weight, first_slots, period, eps, scale, wide)
        return rotate_pairs(y, cos, sin).to(out_dtype)
    x, token_stride, second_weight, first_slots, period, eps = _kernel_operands(x, weight, second_weight,
                                                                              first_slots, period, eps, out_dtype)
    return _HEAD_NORM_ROPE(x, token_stride, weight, second_weight, _fp32_contiguous(cos), _fp32_contiguous(sin),
                           first_slots, period, eps, float(scale), out_dtype)


def _fp32_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous fp32, itself where it is (the RoPE tables' rows): no dispatcher calls then."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
