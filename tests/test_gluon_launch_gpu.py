"""The Gluon kernels' direct launches (attn/kernels/runtime.py: `DirectLauncher`), natively on a Hopper GPU
(skipped elsewhere: Gluon has no interpreter; tests/test_gluon_launch.py checks the same launches' arguments
on the CPU).

Every Gluon entry point (softmax forward plain, with a binding tanh cap by the bound shift, with an ALSC cap
and with a temperature; threshold and sigmoid forwards; softmax backward plain, capped, and with
d-temperature; threshold and sigmoid backwards; differential threshold forward and backward): after a
specialization's first launch through Triton's JIT, calls with fresh values take the direct path (no
launcher compiles or binds again) and give bitwise what ATTNLAB_DIRECT_LAUNCH=0 gives on the same inputs;
then the same at a second specialization (odd lengths, the other head dim, fp16 for some, a query tensor
that is not 16-byte aligned, a temperature view whose address is not 16-byte aligned and a strided lambda).
The softmax backward's one-pass dQ form (ATTNLAB_GLUON_DQ=one_pass: delta zeroing an fp32 dq, the key-block
kernel adding dS K to it by TMA reduce-add, the scale-and-cast), plain causal and capped, tempered, full:
direct against the JIT bitwise where every dq element takes one reduce-add (one batch, one key block per kv
head: the order the adds arrive in cannot change the bits), and dk, dv bitwise, dq to the rounding of its
fp32 sums' order, with several key blocks and batches. Through `attn.attention` with ATTNLAB_GLUON=1: fwd+bwd
of softmax, tanh, threshold and sigmoid (and a temperature) on the Gluon tier, direct against the JIT, bitwise.
Operands the TMA view reads in place (one query per batch stored heads first, a window of a one-batch cache)
give the bits of their contiguous copies.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.kernels import runtime, tiers

CUDA = torch.device("cuda")
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and tiers.gluon_usable(CUDA)),
                                 reason="needs an sm_90 GPU and Triton's Gluon Hopper API"),
              pytest.mark.usefixtures("first_tile_configs")]
LOG2E = 1.4426950408889634

# (B, N, KV, H, H_kv, D, dtype, misaligned): the second shape also puts q 2 bytes past a 16-byte boundary
# (tma_view copies it), the temperature 4 bytes past one and lambda at stride 2
SHAPES = {"first": (2, 200, 200, 4, 2, 64, torch.bfloat16, False),
          "second": (1, 127, 333, 2, 1, 128, torch.float16, True)}


def _inputs(shape, gen):
    """Fresh operands of one shape: q, k, v, q2, k2, do (B, N | KV, H | H_kv, D), unit rows for the
    threshold's q / k, a temperature (B, N) and lambda (H,)."""
    b, n, kv, h, h_kv, d, dtype, misaligned = shape

    def r(rows, heads, unit=False, offset=0):
        """A (B, rows, heads, D) tensor, its address `offset` elements past the start of its storage."""
        x = torch.randn(b, rows, heads, d, device=CUDA, generator=gen)
        x = (F.normalize(x, dim=-1) * 1.5 if unit else x).to(dtype)
        if not offset:
            return x
        view = torch.empty(x.numel() + offset, device=CUDA, dtype=dtype)[offset:].view(x.shape)
        return view.copy_(x)

    x = {"q": r(n, h, unit=True, offset=1 if misaligned else 0), "k": r(kv, h_kv, unit=True), "v": r(kv, h_kv),
         "q2": r(n, h, unit=True), "k2": r(kv, h_kv, unit=True), "do": r(n, h)}
    temp = torch.rand(b, n + 1, device=CUDA, generator=gen) + 0.5
    x["temperature"] = temp[:, 1:] if misaligned else temp[:, :n].contiguous()
    lam = torch.rand(2 * h, device=CUDA, generator=gen) - 0.3
    x["lam"] = lam[::2] if misaligned else lam[:h].contiguous()
    return x


def _entries():
    """name -> (prepare(x): the forward outputs a backward reads, launched before the timing of first
    launches; call(x): the launches under test, returning tensors)."""
    from attn.kernels import gluon_diff_bwd as dbw
    from attn.kernels import gluon_diff_fwd as dfw
    from attn.kernels import gluon_softmax_bwd as sbw
    from attn.kernels import gluon_softmax_fwd as sfw
    from attn.kernels import gluon_weighted_bwd as wbw
    from attn.kernels import gluon_weighted_fwd as wfw

    def scale(x):
        return 1.0 / math.sqrt(x["q"].shape[-1])

    def softmax_forward(x, cap=0, cap_value=0.0, knee=0.0, temperature=False):
        """The softmax family's forward as its launch plans call it (softmax_family._scalars' constants)."""
        from attn.kernels.softmax_family import _scalars

        cap_scale, qk_scale, _, _, alsc_a, _ = _scalars(cap, cap_value, knee, scale(x))
        shift = cap_value * LOG2E if cap and not temperature and x["q"].dtype == torch.bfloat16 else None
        return sfw.launch_forward(x["q"], x["k"], x["v"], True, qk_scale, cap=cap, cap_scale=cap_scale,
                                  alsc_knee=alsc_a, shift=shift,
                                  temperature=x["temperature"] if temperature else None)

    def with_forward(**logits):
        def prepare(x):
            x["out"], x["lse"] = softmax_forward(x, **logits)
        return prepare

    def nothing(x):
        pass

    bwd_logits = {"cap": 2, "cap_value": 5.0}
    return {
        "softmax_fwd": (nothing, lambda x: sfw.gluon_softmax_forward(x["q"], x["k"], x["v"], scale(x), True)),
        "tanh_fwd": (nothing, lambda x: softmax_forward(x, cap=1, cap_value=5.0)),
        "alsc_fwd": (nothing, lambda x: softmax_forward(x, cap=3, cap_value=5.0, knee=0.5)),
        "temperature_fwd": (nothing, lambda x: softmax_forward(x, temperature=True)),
        "threshold_fwd": (nothing, lambda x: wfw.launch_threshold(x["q"], x["k"], x["v"], True, 1.0, 2.0)),
        "sigmoid_fwd": (nothing, lambda x: wfw.launch_sigmoid(x["q"], x["k"], x["v"], True, scale(x), None)),
        "softmax_bwd": (with_forward(), lambda x: sbw.launch_backward(
            x["q"], x["k"], x["v"], x["out"], x["do"], x["lse"], scale(x), True)),
        "soft_sign_bwd": (with_forward(**bwd_logits), lambda x: sbw.launch_backward(
            x["q"], x["k"], x["v"], x["out"], x["do"], x["lse"], scale(x), True, **bwd_logits)),
        "temperature_bwd_dt": (with_forward(temperature=True), lambda x: sbw.launch_backward_with_dt(
            x["q"], x["k"], x["v"], x["out"], x["do"], x["lse"], scale(x), True, temperature=x["temperature"])),
        "threshold_bwd": (nothing, lambda x: wbw.launch_threshold_backward(
            x["q"], x["k"], x["v"], x["do"], True, 1.0, 2.0)),
        "sigmoid_bwd": (nothing, lambda x: wbw.launch_sigmoid_backward(
            x["q"], x["k"], x["v"], x["do"], True, scale(x), None)),
        "diff_fwd": (nothing, lambda x: dfw.launch_diff_threshold(
            x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], True, 1.0, 2.0)),
        "diff_bwd": (nothing, lambda x: dbw.launch_diff_threshold_backward(
            x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], x["do"], True, 1.0, 2.0)),
    }


def _tensors(result):
    out = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in out if t is not None]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns (NaNs compare as their bits)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.fixture
def first_launches(monkeypatch):
    """Names of the DirectLaunchers whose launch went through Triton's JIT, in order."""
    names = []
    real = runtime.DirectLauncher._first_launch

    def counted(self, *args, **kwargs):
        names.append(self.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(runtime.DirectLauncher, "_first_launch", counted)
    return names


def _direct_against_jit(entry, prepare, call, shape, gen, first_launches, monkeypatch, close=()):
    """After `call`'s first launches (through the JIT), calls with fresh values twice: every launch direct,
    its outputs bitwise those of the same call through the JIT (ATTNLAB_DIRECT_LAUNCH=0); outputs whose
    index is in `close` within the rounding of fp32 sums taken in another order instead."""
    monkeypatch.delenv(runtime.DIRECT_ENV, raising=False)
    warm = _inputs(shape, gen)
    prepare(warm)
    call(warm)  # a specialization's first launches: through the JIT (compiling where needed)
    for _ in range(2):  # fresh values twice: every launch direct, each equal to the JIT's launch
        x = _inputs(shape, gen)
        prepare(x)
        before = len(first_launches)
        direct = _tensors(call(x))
        torch.cuda.synchronize()
        assert first_launches[before:] == [], f"launched through the JIT: {first_launches[before:]}"
        monkeypatch.setenv(runtime.DIRECT_ENV, "0")
        jit = _tensors(call(x))
        monkeypatch.delenv(runtime.DIRECT_ENV)
        assert len(direct) == len(jit) > 0
        for i, (a, b) in enumerate(zip(direct, jit)):
            assert a.shape == b.shape and a.dtype == b.dtype, i
            if i in close:
                scale = b.float().abs().max().item()
                assert (a.float() - b.float()).abs().max().item() <= 1e-2 * scale, f"{entry} output {i}"
            else:
                assert torch.equal(_bits(a), _bits(b)), f"{entry} output {i}: direct launch differs from the JIT's"
            assert a.float().abs().sum() > 0, f"{entry} output {i} is all zeros"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("entry", list(_entries()))
def test_direct_gluon_launches_give_the_bits_of_launches_through_the_jit(entry, shape, first_launches, monkeypatch):
    prepare, call = _entries()[entry]
    gen = torch.Generator(device=CUDA).manual_seed(sum(map(ord, entry + shape)))
    _direct_against_jit(entry, prepare, call, SHAPES[shape], gen, first_launches, monkeypatch)


# the one-pass dQ form: (B, N, KV, H, H_kv, D, dtype, misaligned) as SHAPES, and whether every dq element takes
# exactly one TMA reduce-add (one batch, KV <= 128: one key-block program per kv head; the rows a query block
# runs past N are clipped at the tensor's end), so that dq's bits do not depend on the adds' order
ONE_PASS_SHAPES = {"one_key_block": ((1, 77, 100, 4, 2, 64, torch.bfloat16, False), True),
                   "one_key_block_misaligned": ((1, 127, 128, 2, 1, 128, torch.float16, True), True),
                   "key_blocks": ((2, 200, 333, 4, 2, 128, torch.bfloat16, False), False)}
# (name, causal, the backward's logits, with a temperature)
ONE_PASS_CALLS = {"softmax_causal": (True, {}, False),
                  "soft_sign_temperature_full": (False, {"cap": 2, "cap_value": 5.0}, True)}
ONE_PASS_LAUNCHERS = ["gluon_softmax_bwd_delta_zero_dq", "gluon_softmax_bwd_dkdv_dq", "gluon_softmax_bwd_dq_cast"]


@pytest.mark.parametrize("shape", list(ONE_PASS_SHAPES))
@pytest.mark.parametrize("form", list(ONE_PASS_CALLS))
def test_one_pass_backward_launches_directly_with_the_bits_of_the_jit(form, shape, first_launches, monkeypatch):
    """ATTNLAB_GLUON_DQ=one_pass: its three launchers run, and only they for the backward (not the separate
    form's), later calls launch directly, and give the JIT's bits (dq to its sums' order where several key
    blocks add to it)."""
    from attn.kernels import gluon_softmax_bwd as sbw
    from attn.kernels import gluon_softmax_fwd as sfw
    from attn.kernels.softmax_family import _scalars

    monkeypatch.setenv(sbw.DQ_FORM_ENV, "one_pass")
    causal, logits, with_temperature = ONE_PASS_CALLS[form]
    dims, one_add = ONE_PASS_SHAPES[shape]

    def scale(x):
        return 1.0 / math.sqrt(x["q"].shape[-1])

    def temperature(x):
        return x["temperature"] if with_temperature else None

    def prepare(x):
        cap, cap_value = logits.get("cap", 0), logits.get("cap_value", 0.0)
        cap_scale, qk_scale, _, _, alsc_a, _ = _scalars(cap, cap_value, 0.0, scale(x))
        x["out"], x["lse"] = sfw.launch_forward(x["q"], x["k"], x["v"], causal, qk_scale, cap=cap, cap_scale=cap_scale,
                                                alsc_knee=alsc_a, temperature=temperature(x))

    def call(x):
        return sbw.launch_backward(x["q"], x["k"], x["v"], x["out"], x["do"], x["lse"], scale(x), causal,
                                   temperature=temperature(x), **logits)

    launched = []  # every DirectLauncher's name per launch, direct or not
    run = runtime.DirectLauncher.run

    def recorded(self, *args):
        launched.append(self.name)
        return run(self, *args)

    monkeypatch.setattr(runtime.DirectLauncher, "run", recorded)
    gen = torch.Generator(device=CUDA).manual_seed(sum(map(ord, form + shape)))
    _direct_against_jit(f"{form} one-pass", prepare, call, dims, gen, first_launches, monkeypatch,
                        close=() if one_add else (0,))
    backward = [name for name in launched if name.startswith("gluon_softmax_bwd")]
    assert backward == ONE_PASS_LAUNCHERS * 5, backward  # the first call, then twice direct and through the JIT


PUBLIC = [("softmax", {}, False), ("softmax", {}, True), ("softcap_tanh", {"cap": 5.0}, False),
          ("threshold", {}, False), ("sigmoid", {}, False)]


@pytest.mark.parametrize("variant,params,with_temperature", PUBLIC,
                         ids=[f"{v}{'-temperature' if t else ''}" for v, _, t in PUBLIC])
def test_public_calls_on_the_gluon_tier_launch_directly_with_the_bits_of_the_jit(variant, params, with_temperature,
                                                                                 first_launches, monkeypatch):
    """attn.attention with ATTNLAB_GLUON=1, fwd+bwd: the Gluon launchers ran, the repeated call directly,
    and direct launches give the JIT's bits."""
    monkeypatch.setenv(tiers.GLUON_ENV, "1")
    monkeypatch.delenv(runtime.DIRECT_ENV, raising=False)
    spec = attn.get_variant(variant).make_spec(**params)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    b, n, h, d = 2, 300, 4, 64

    def inputs():
        unit = variant == "threshold"
        x = {name: torch.randn(b, n, h, d, device=CUDA, generator=gen) for name in ("q", "k", "v", "do")}
        if unit:
            x["q"], x["k"] = F.normalize(x["q"], dim=-1) * 1.5, F.normalize(x["k"], dim=-1) * 1.5
        x = {name: t.to(torch.bfloat16) for name, t in x.items()}
        x["temperature"] = torch.rand(b, n, device=CUDA, generator=gen) + 0.5 if with_temperature else None
        return x

    def fwd_bwd(x):
        q, k, v = (x[name].detach().clone().requires_grad_() for name in ("q", "k", "v"))
        temperature = x["temperature"].clone().requires_grad_() if with_temperature else None
        out = attn.attention(q, k, v, spec, causal=True, backend="triton", temperature=temperature)
        out.backward(x["do"])
        return [out.detach(), q.grad, k.grad, v.grad] + ([temperature.grad] if with_temperature else [])

    fwd_bwd(inputs())
    assert any(name.startswith("gluon_") for name in first_launches), first_launches
    x = inputs()
    before = len(first_launches)
    direct = fwd_bwd(x)
    torch.cuda.synchronize()
    assert first_launches[before:] == [], f"launched through the JIT: {first_launches[before:]}"
    monkeypatch.setenv(runtime.DIRECT_ENV, "0")
    jit = fwd_bwd(x)
    for i, (a, b_) in enumerate(zip(direct, jit, strict=True)):
        assert torch.equal(_bits(a), _bits(b_)), f"{variant} output {i}: direct launch differs from the JIT's"


def _layouts():
    """name -> operands whose layout the TMA view reads in place (tma_view: a size-1 dim's stride is free)."""
    gen = torch.Generator(device=CUDA).manual_seed(11)

    def r(*shape):
        return torch.randn(*shape, device=CUDA, generator=gen).to(torch.bfloat16)

    return {
        # one query per batch, heads first in memory: the 2-d view's rows step by the batch stride
        "one_query_heads_major": dict(q=r(2, 4, 1, 64).transpose(1, 2), k=r(2, 200, 2, 64), v=r(2, 200, 2, 64),
                                      do=r(2, 4, 1, 64).transpose(1, 2)),
        # one batch: keys and values a window of a longer cache
        "one_batch_cache_window": dict(q=r(1, 200, 4, 64), k=r(1, 500, 2, 64)[:, 100:300],
                                       v=r(1, 500, 2, 64)[:, 100:300], do=r(1, 200, 4, 64)),
    }


@pytest.mark.parametrize("layout", ["one_query_heads_major", "one_batch_cache_window"])
def test_operands_read_in_place_give_the_bits_of_their_contiguous_copies(layout):
    from attn.kernels import gluon_softmax_fwd as sfw
    from attn.kernels import gluon_weighted_bwd as wbw

    x = _layouts()[layout]
    # copies with standard strides (torch calls these layouts contiguous, so .contiguous() would not copy)
    copies = {name: torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t) for name, t in x.items()}
    assert any(t.stride() != copies[name].stride() for name, t in x.items())

    def run(t):
        scale = 1.0 / math.sqrt(t["q"].shape[-1])
        out, lse = sfw.gluon_softmax_forward(t["q"], t["k"], t["v"], scale, True)
        grads = wbw.launch_threshold_backward(t["q"], t["k"], t["v"], t["do"], True, 1.0, 2.0)
        return [out, lse, *grads]

    for i, (a, b) in enumerate(zip(run(x), run(copies), strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"{layout} output {i}"
        assert a.float().abs().sum() > 0, f"{layout} output {i} is all zeros"
