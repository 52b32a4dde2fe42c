"""Elementwise functions for the kernels that spare the special-function unit (MUFU).

An H100/H200 SM issues 16 MUFU ops per clock (ex2, rcp, tanh, ...) against 128 fp32 FMAs and
4096 bf16 tensor-core flops: a kernel that spends two MUFU ops per attention score (D = 128) keeps
the MUFU as busy as the tensor cores. Two ways to spend one instead, each replacing one MUFU op by
FMA-pipe arithmetic (plain tl code: both run in the interpreter):

`exp2_poly` computes 2^x on the FMA pipes (the trick FlashAttention-4 uses for exp2):

    x = n + f, n = round(x) (by adding 1.5 * 2^23, whose float holds n in its low mantissa bits),
    f in [-1/2, 1/2];  2^x = p(f) * 2^n, p a minimax polynomial, 2^n built from n's bits.

Plain tl arithmetic (runs in the interpreter too). Ranges: 2^x for x in [-125, 127.5); +inf from
127.5 on (2^128 as a float is inf); 2^-125 for every x <= -125 (so 1 + 2^x == 1 there in fp32);
NaN for NaN. The relative error is the polynomial's, uniform over the range (2^n is exact):

    degree 3: 1.0e-4    degree 4: 2.9e-6    degree 6: 1.0e-7 (fp32 Horner, coefficients in fp32)

`rcp_newton` computes 1/d for d in [1, 2^126]: a seed read off the bits (0x7F000000 - bits(d): exact
at powers of two, relative error <= 1/8) and Newton steps y += y (1 - d y), two FMAs each, each
squaring the error: 2 steps 2.4e-4, 3 steps 1.3e-7. Near d = 1 the seed's error is about (d - 1) / 2,
so 1 - 1/d keeps its relative accuracy too.

`rcp` and `ex2` are the MUFU forms (rcp.approx.ftz, ex2.approx.ftz: one SASS instruction each, CUDA
only, inline PTX) or, with FAST off, a division and tl.exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2^23: x + this, for |x| < 2^22, is a float in [2^23, 2^24) (spacing 1) whose low mantissa
# bits hold round(x) (two's complement, offset by 2^22)
ROUNDING_SHIFT = tl.constexpr(12582912.0)


@triton.jit
def _poly_2f(f, DEGREE: tl.constexpr):
    """2^f for f in [-1/2, 1/2], Horner: p(f) = 1 + f q(f), minimax in relative error with p(0) = 1
    exactly (so 2^x is exact at integers and 2^128 comes out as inf)."""
    if DEGREE == 3:
        p = 0.05500869080424309 * f + 0.24221062660217285
        p = p * f + 0.6932829022407532
    elif DEGREE == 4:
        p = 0.009582829661667347 * f + 0.055906400084495544
        p = p * f + 0.24024099111557007
        p = p * f + 0.6931241750717163
    else:
        tl.static_assert(DEGREE == 6, "exp2_poly: DEGREE must be 3, 4 or 6")
        p = 0.00015353350318036973 * f + 0.0013398875016719103
        p = p * f + 0.009618437848985195
        p = p * f + 0.055503323674201965
        p = p * f + 0.24022647738456726
        p = p * f + 0.6931471824645996
    return p * f + 1.0


@triton.jit
def exp2_parts(x, DEGREE: tl.constexpr):
    """(p, s) with 2^x = p * s: p = 2^f by the polynomial, s = 2^n a power of two (inf for n = 128).
    A caller forming 1 + 2^x writes p * s + 1.0, one FMA."""
    # x in [-125, 128]: n + 127 in [2, 255] is a valid exponent field; NaN stays NaN
    xc = tl.clamp(x, -125.0, 128.0, propagate_nan=tl.PropagateNan.ALL)
    r = xc + ROUNDING_SHIFT
    f = xc - (r - ROUNDING_SHIFT)
    # the bits of r are 0x4B400000 + n: shifted by 23, only n << 23 remains (mod 2^32)
    s = ((r.to(tl.int32, bitcast=True) << 23) + 0x3F800000).to(tl.float32, bitcast=True)
    return _poly_2f(f, DEGREE), s


@triton.jit
def exp2_poly(x, DEGREE: tl.constexpr):
    """2^x (fp32) without a MUFU op: see the module docstring for ranges and errors."""
    p, s = exp2_parts(x, DEGREE)
    return p * s


@triton.jit
def rcp_newton(d, ITERATIONS: tl.constexpr):
    """1/d (fp32) for d in [1, 2^126] without a MUFU op; NaN for NaN (module docstring: errors)."""
    y = (0x7F000000 - d.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    for _ in tl.static_range(ITERATIONS):
        y = y * (1.0 - d * y) + y
    return y


@triton.jit
def ex2(x, FAST: tl.constexpr):
    """2^x: FAST, MUFU ex2.approx.ftz (one MUFU op, relative error ~2^-22, results below 2^-126
    flushed to 0; CUDA only); otherwise tl.exp2."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def rcp(x, FAST: tl.constexpr):
    """1/x: FAST, MUFU rcp.approx.ftz (one MUFU op, relative error ~2^-23, results below 2^-126
    flushed to 0; CUDA only); otherwise an IEEE-style division."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x
