"""What the kernels launch on a GPU, pinned: candidate tile configs (their order: the first is the
pinned default), tuning keys, size buckets, split counts, and every launch's grid and arguments.

Nothing here runs a kernel. The GPU's selection logic runs on the CPU (`interpreting` patched to
False) and `Kernel.launch` / direct jit launches are recorded instead of run. The candidate lists
and buckets are literal tables; the launches are compared with tests/kernel_launches.json
(ATTNLAB_WRITE_LAUNCH_SNAPSHOT=1 rewrites it from the code as it is).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from attn.kernels import runtime
from attn.kernels import sigmoid_family as sg
from attn.kernels import softmax_family as sf
from attn.kernels import threshold_family as tf
from attn.masks import MaskSpec, segment_bounds
from attn.specs import SigmoidFamilySpec, SoftmaxFamilySpec, ThresholdFamilySpec

SNAPSHOT = Path(__file__).parent / "kernel_launches.json"


def _gpu_mode(monkeypatch):
    """Every attn.kernels module's `interpreting` answers False: the GPU's config choice on the CPU."""
    for name, module in list(sys.modules.items()):
        if name.startswith("attn.kernels") and hasattr(module, "interpreting"):
            monkeypatch.setattr(module, "interpreting", lambda: False)


def _cfgs(configs):
    return [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in configs]


# --------------------------------------------------------------------- candidate tables

SOFTMAX_FWD = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 4, 2), (128, 128, 8, 3)]
SOFTMAX_SMALL_FWD = (64, 64, 4, 3)  # the forward's one config at N <= 64
SOFTMAX_DKDV = [(64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 4), (16, 64, 4, 3), (64, 128, 8, 3),
                (32, 128, 4, 3)]
SOFTMAX_DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 4, 3)]

# (kind, head dim, differential, views) -> candidates; head dims 16 / 32 take the default
THRESHOLD_GPU = {
    ("fwd", 128, False, 0): [(128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
    ("fwd", 128, True, 0): [(128, 64, 8, 3), (128, 64, 8, 2)],
    ("fwd", 64, False, 0): [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    ("fwd", 64, True, 0): [(128, 64, 8, 3), (128, 64, 4, 3)],
    ("dq", 128, False, 0): [(128, 64, 8, 3), (64, 64, 4, 3)],
    ("dq", 128, True, 0): [(128, 64, 8, 2), (64, 64, 8, 3)],
    ("dq", 64, False, 0): [(128, 64, 8, 3), (64, 64, 4, 3)],
    ("dq", 64, True, 0): [(128, 64, 8, 3), (64, 64, 4, 3)],
    ("dkdv", 128, False, 0): [(32, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 2), (64, 128, 8, 3)],
    ("dkdv", 128, True, 0): [(16, 64, 8, 3), (16, 128, 8, 3), (32, 128, 8, 3), (32, 64, 8, 2)],
    ("dkdv", 128, True, 1): [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (16, 128, 8, 3)],
    ("dkdv", 128, True, 2): [(32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 2)],
    ("dkdv", 64, False, 0): [(64, 128, 8, 3), (32, 128, 8, 3), (32, 64, 4, 3)],
    ("dkdv", 64, True, 0): [(32, 128, 8, 3), (64, 64, 4, 3)],
    ("dkdv", 64, True, 1): [(64, 128, 8, 3), (32, 128, 8, 3)],
    ("dkdv", 64, True, 2): [(64, 128, 8, 3), (64, 64, 4, 3)],
}
THRESHOLD_DEFAULT = [(64, 64, 4, 2)]

# (kind, head dim) -> candidates; head dims 16 / 32 take the default
SIGMOID_GPU = {
    ("fwd", 128): [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    ("fwd", 64): [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    ("dq", 128): [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
    ("dq", 64): [(128, 64, 8, 3), (64, 64, 4, 3)],
    ("dkdv", 128): [(32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 2)],
    ("dkdv", 64): [(64, 128, 8, 3), (32, 128, 8, 3), (32, 64, 4, 3)],
}
SIGMOID_DEFAULT = [(64, 64, 4, 2)]


def softmax_candidates(kind, n):
    return sf.CONFIG_TABLE.candidates(kind, n=n)


def threshold_candidates(kind, head_dim, differential, views):
    return tf.CONFIG_TABLE.candidates(kind, head_dim, differential, views)


def softmax_bucket(n):
    return runtime.n_bucket(n, sf.N_BUCKET_CAP)


def threshold_bucket(n):
    return runtime.n_bucket(n)


def decode_config():
    return [runtime.decode_config()] * 2  # both families' split-key forwards


@pytest.mark.parametrize("n", [1, 17, 63, 64, 65, 200, 4096, 100000])
def test_softmax_family_candidates(n, monkeypatch):
    _gpu_mode(monkeypatch)
    small = n <= 64
    assert _cfgs(softmax_candidates("fwd", n)) == ([SOFTMAX_SMALL_FWD] if small else SOFTMAX_FWD)
    assert _cfgs(softmax_candidates("kv", n)) == (SOFTMAX_DKDV[:1] if small else SOFTMAX_DKDV)
    assert _cfgs(softmax_candidates("q", n)) == (SOFTMAX_DQ[:1] if small else SOFTMAX_DQ)


def test_threshold_family_candidates(monkeypatch):
    _gpu_mode(monkeypatch)
    for kind in ("fwd", "dq", "dkdv"):
        for d in (16, 32, 64, 128):
            for differential in (False, True):
                for views in ((0, 1, 2) if differential and kind == "dkdv" else (0,)):
                    want = THRESHOLD_GPU.get((kind, d, differential, views), THRESHOLD_DEFAULT)
                    assert _cfgs(threshold_candidates(kind, d, differential, views)) == want, (kind, d, differential,
                                                                                                views)


def test_sigmoid_family_candidates(monkeypatch):
    _gpu_mode(monkeypatch)
    for kind in ("fwd", "dq", "dkdv"):
        for d in (16, 32, 64, 128):
            assert _cfgs(sg.CONFIG_TABLE.candidates(kind, d)) == SIGMOID_GPU.get((kind, d), SIGMOID_DEFAULT), (kind, d)


def test_interpreter_candidates(monkeypatch):
    """Under the interpreter: one config per kernel (softmax: 64x32, dk/dv 32x64, ATTNLAB_INTERPRET_BLOCKS
    overrides; threshold: tf.INTERPRETER_CONFIG, 16x16), 4 warps, 1 stage."""
    monkeypatch.setattr(runtime, "interpreting", lambda: True)
    for module in (sf, tf, sg):
        if hasattr(module, "interpreting"):
            monkeypatch.setattr(module, "interpreting", lambda: True)
    monkeypatch.delenv("ATTNLAB_INTERPRET_BLOCKS", raising=False)
    assert _cfgs(softmax_candidates("fwd", 500)) == [(64, 32, 4, 1)]
    assert _cfgs(softmax_candidates("q", 500)) == [(64, 32, 4, 1)]
    assert _cfgs(softmax_candidates("kv", 500)) == [(32, 64, 4, 1)]
    monkeypatch.setenv("ATTNLAB_INTERPRET_BLOCKS", "16,64")
    assert _cfgs(softmax_candidates("fwd", 5)) == [(16, 64, 4, 1)]
    assert _cfgs(softmax_candidates("kv", 5)) == [(64, 16, 4, 1)]
    for kind in ("fwd", "dq", "dkdv"):
        assert _cfgs(threshold_candidates(kind, 64, True, 1)) == [(16, 16, 4, 1)]
    monkeypatch.setitem(tf.INTERPRETER_CONFIG, "dq", (32, 16))
    assert _cfgs(threshold_candidates("dq", 64, False, 0)) == [(32, 16, 4, 1)]
    for kind in ("fwd", "dq", "dkdv"):
        assert _cfgs(sg.CONFIG_TABLE.candidates(kind, 64)) == [(16, 16, 4, 1)]
    assert _cfgs([c for c in decode_config()]) == [(16, 16, 4, 1)] * 2


def test_decode_config_on_gpu(monkeypatch):
    _gpu_mode(monkeypatch)
    assert _cfgs(decode_config()) == [(16, 64, 4, 2)] * 2
    monkeypatch.setenv(runtime.DECODE_TILES_ENV, "32,8,3")
    assert _cfgs(decode_config()) == [(16, 32, 8, 3)] * 2
    for bad in ("32,8", "32,0,3", "a,4,2"):
        monkeypatch.setenv(runtime.DECODE_TILES_ENV, bad)
        with pytest.raises(ValueError, match="ATTNLAB_DECODE_TILES must be three positive integers"):
            runtime.decode_config()


BUCKETS = {0: 64, 1: 64, 2: 64, 63: 64, 64: 64, 65: 128, 100: 128, 128: 128, 129: 256, 1000: 1024, 1024: 1024,
           1025: 2048, 4096: 4096, 4097: 8192, 8192: 8192, 16383: 16384, 16384: 16384, 16385: 32768,
           100000: 131072}


def test_size_buckets():
    """Tuning keys' length buckets: powers of two from 64; the softmax family's stop at 16384 (the
    threshold family also passes its uncapped bucket to the kernels as N_BUCKET)."""
    for n, want in BUCKETS.items():
        assert threshold_bucket(n) == want, n
        assert softmax_bucket(n) == min(want, 16384), n
    for n in range(0, 70000, 37):
        want = 64
        while want < n:
            want *= 2
        assert threshold_bucket(n) == want and softmax_bucket(n) == min(want, 16384), n


# ------------------------------------------------------------------------- launches


class _Recorder:
    """Kernel.launch and direct jit launches, recorded (not run) with their tensors named."""

    def __init__(self, named: dict):
        self.names = {id(t): name for name, t in named.items()}
        self.keep = list(named.values())
        self.launches = []

    def tensor(self, t):
        if id(t) not in self.names:
            self.names[id(t)] = f"t{len(self.names)}"
            self.keep.append(t)
        return f"{self.names[id(t)]}{list(t.shape)}{list(t.stride())}:{str(t.dtype).replace('torch.', '')}"

    def launch(self, kernel, grid, tensors, scalars, meta, configs, tune_key):
        self.launches.append({
            "kernel": kernel.name,
            "grids": [list(grid(c)) for c in configs],
            "tensors": [self.tensor(t) for t in tensors],
            "scalars": [_plain(s) for s in scalars],
            "meta": {k: _plain(v) for k, v in meta.items()},
            "configs": _cfgs(configs),
            "tune_key": _plain(tune_key),
        })
        return configs[0]


def _plain(x):
    if isinstance(x, (tuple, list)):
        return [_plain(y) for y in x]
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    raise TypeError(f"unexpected launch value {x!r}")


class _JitLauncher:
    """Stands in for a @triton.jit kernel launched as kernel[grid](...)."""

    def __init__(self, rec, name):
        self.rec, self.name = rec, name

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.rec.launches.append({
                "kernel": self.name, "grids": [list(grid)],
                "tensors": [self.rec.tensor(a) for a in args if isinstance(a, torch.Tensor)],
                "scalars": [_plain(a) for a in args if not isinstance(a, torch.Tensor)],
                "meta": {k: _plain(v) for k, v in kwargs.items()},
            })
        return run


def _recording(monkeypatch, named):
    rec = _Recorder(named)
    monkeypatch.setattr(runtime.Kernel, "launch", lambda self, *a: rec.launch(self, *a))
    monkeypatch.setattr(tf, "_zero_count_kernel", _JitLauncher(rec, "threshold_zero_count"))
    return rec


def _qkv(b, n, kv, h, h_kv, d, dtype, gen, second_view=False):
    q = torch.randn(b, n, h, d, generator=gen).to(dtype)
    k = torch.randn(b, kv, h_kv, d, generator=gen).to(dtype)
    v = torch.randn(b, kv, h_kv, d, generator=gen).to(dtype)
    named = {"q": q, "k": k, "v": v}
    if second_view:
        named.update(q2=torch.randn(b, n, h, d, generator=gen).to(dtype),
                     k2=torch.randn(b, kv, h_kv, d, generator=gen).to(dtype),
                     lam=torch.rand(h, generator=gen).to(dtype))
    return named


def _segments(b, n):
    ids = torch.ones(b, n, dtype=torch.long)
    ids[:, n // 2:] = -1
    ids[-1, -3:] = 0
    return ids


def _call_options(named: dict, b, n, kv, seg, p, lens, seed: int) -> dict:
    """The fused_attention keyword options of a case (segment bounds, dropout, key lengths); the
    tensors they hold are added to `named`, so the recorded launches name them."""
    options = {}
    if seg:
        named["segment_ids"] = _segments(b, n)
        named["bounds"] = segment_bounds(named["segment_ids"])
        options["bounds"] = named["bounds"]
    if p > 0:
        named["seed"] = torch.tensor([seed], dtype=torch.int64)
        options.update(dropout_p=p, dropout_seed=named["seed"])
    if lens:
        named["key_lengths"] = torch.tensor([kv - 5, kv // 2][:b], dtype=torch.int32)
        options["key_lengths"] = named["key_lengths"]
    return options


SOFTMAX_CASES = {
    # name: (spec, B, N, KV, H, H_kv, D, dtype, mask, segments, temperature, dropout, decode splits, lens)
    "softmax-causal-small": (SoftmaxFamilySpec(), 2, 17, 17, 4, 2, 16, torch.float32, MaskSpec(causal=True),
                             False, False, 0.0, None, False),
    "softmax-full-big-fp16": (SoftmaxFamilySpec(), 1, 200, 200, 2, 2, 64, torch.float16, MaskSpec(causal=False),
                              False, False, 0.0, None, False),
    "tanh-window-temp-bf16": (SoftmaxFamilySpec(cap="tanh", cap_value=5.0), 2, 130, 130, 4, 1, 128, torch.bfloat16,
                              MaskSpec(causal=True, window=37), False, True, 0.0, None, False),
    "alsc-ranker-dropout": (SoftmaxFamilySpec(cap="alsc"), 2, 96, 96, 2, 1, 32, torch.float32,
                            MaskSpec(causal=True), True, False, 0.1, None, False),
    "soft_sign-full-temp": (SoftmaxFamilySpec(cap="soft_sign", cap_value=4.0), 1, 65, 65, 2, 2, 64, torch.float16,
                            MaskSpec(causal=False), False, True, 0.0, None, False),
    "longer-keys": (SoftmaxFamilySpec(), 2, 20, 300, 4, 2, 64, torch.float16, MaskSpec(causal=True), False, False,
                    0.0, None, False),
    "decode-splits": (SoftmaxFamilySpec(cap="tanh", cap_value=8.0), 2, 3, 1000, 4, 2, 128, torch.bfloat16,
                      MaskSpec(causal=True), False, True, 0.0, "5", False),
    "decode-key-lengths": (SoftmaxFamilySpec(), 2, 1, 700, 4, 1, 64, torch.float16, MaskSpec(causal=True), False,
                           False, 0.0, "3", True),
}


@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_softmax_family_launches(case, monkeypatch):
    spec, b, n, kv, h, h_kv, d, dtype, mask, seg, temp, p, splits, lens = SOFTMAX_CASES[case]
    _gpu_mode(monkeypatch)
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    monkeypatch.delenv("ATTNLAB_FIXED_SHIFT", raising=False)
    if splits is None:
        monkeypatch.delenv(runtime.DECODE_SPLITS_ENV, raising=False)
    else:
        monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, splits)
    gen = torch.Generator().manual_seed(1)
    named = _qkv(b, n, kv, h, h_kv, d, dtype, gen)
    if temp:
        named["temperature"] = (torch.rand(b, n, generator=gen) + 0.5).to(dtype)
    options = _call_options(named, b, n, kv, seg, p, lens, seed=1234)
    rec = _recording(monkeypatch, named)
    leaves = [named[x] for x in ("q", "k", "v", "temperature") if x in named]
    with torch.set_grad_enabled(not lens):
        for t in leaves:
            t.requires_grad_(not lens)
        out = sf.fused_attention(named["q"], named["k"], named["v"], spec, mask, named.get("segment_ids"),
                                 named.get("temperature"), **options)
        if not lens:
            out.float().sum().backward()
    _compare(f"softmax_family/{case}", rec.launches)


THRESHOLD_CASES = {
    # name: (spec, B, N, KV, H, H_kv, D, dtype, mask, segments, dropout, decode splits, lens, dk/dv form)
    "threshold-causal-p2-d16": (ThresholdFamilySpec(), 2, 17, 17, 4, 2, 16, torch.float32, MaskSpec(causal=True),
                                False, 0.0, None, False, None),
    "threshold-p1-full-d64": (ThresholdFamilySpec(power=1.0, beta=0.5), 1, 200, 200, 2, 1, 64, torch.float16,
                              MaskSpec(causal=False), False, 0.0, None, False, None),
    "threshold-p1.5-window-d128": (ThresholdFamilySpec(power=1.5), 2, 130, 130, 4, 4, 128, torch.bfloat16,
                                   MaskSpec(causal=True, window=29), False, 0.0, None, False, None),
    "diff-ranker-dropout-d64": (ThresholdFamilySpec(differential=True), 2, 96, 96, 4, 2, 64, torch.float16,
                                MaskSpec(causal=True), True, 0.2, None, False, None),
    "diff-split-d128": (ThresholdFamilySpec(differential=True, power=1.0), 1, 150, 150, 2, 1, 128, torch.bfloat16,
                        MaskSpec(causal=True), False, 0.0, None, False, "split"),
    "diff-fused-d128": (ThresholdFamilySpec(differential=True), 1, 150, 150, 2, 1, 128, torch.bfloat16,
                        MaskSpec(causal=True, window=64), False, 0.0, None, False, "fused"),
    "diff-d32": (ThresholdFamilySpec(differential=True), 1, 40, 40, 2, 2, 32, torch.float32, MaskSpec(causal=False),
                 False, 0.0, None, False, None),
    "longer-keys": (ThresholdFamilySpec(), 2, 20, 300, 4, 2, 64, torch.float16, MaskSpec(causal=True), False, 0.0,
                    None, False, None),
    "decode-splits-diff": (ThresholdFamilySpec(differential=True), 2, 3, 1000, 4, 2, 128, torch.bfloat16,
                           MaskSpec(causal=True), False, 0.0, "6", False, None),
    "decode-key-lengths": (ThresholdFamilySpec(), 2, 1, 700, 4, 1, 64, torch.float16, MaskSpec(causal=True), False,
                           0.0, "3", True, None),
}


@pytest.mark.parametrize("case", list(THRESHOLD_CASES))
def test_threshold_family_launches(case, monkeypatch):
    spec, b, n, kv, h, h_kv, d, dtype, mask, seg, p, splits, lens, form = THRESHOLD_CASES[case]
    _gpu_mode(monkeypatch)
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    if form is None:
        monkeypatch.delenv("ATTNLAB_DIFF_DKDV", raising=False)
    else:
        monkeypatch.setenv("ATTNLAB_DIFF_DKDV", form)
    if splits is None:
        monkeypatch.delenv(runtime.DECODE_SPLITS_ENV, raising=False)
    else:
        monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, splits)
    gen = torch.Generator().manual_seed(2)
    named = _qkv(b, n, kv, h, h_kv, d, dtype, gen, second_view=spec.differential)
    options = _call_options(named, b, n, kv, seg, p, lens, seed=99)
    rec = _recording(monkeypatch, named)
    extra = {x: named[x] for x in ("q2", "k2", "lam") if x in named}
    leaves = [named["q"], named["k"], named["v"], *extra.values()]
    with torch.set_grad_enabled(not lens):
        for t in leaves:
            t.requires_grad_(not lens)
        out = tf.fused_attention(named["q"], named["k"], named["v"], spec, mask, named.get("segment_ids"), None,
                                 extra=extra, **options)
        if not lens:
            out.float().sum().backward()
    if n == kv and not lens:
        with torch.no_grad():
            tf.zero_fraction(named["q"], named["k"], spec, mask, named.get("segment_ids"), extra=extra)
    _compare(f"threshold_family/{case}", rec.launches)


SIGMOID_CASES = {
    # name: (spec, B, N, KV, H, H_kv, D, dtype, mask, segments, dropout, decode splits, lens)
    "sigmoid-causal-d16": (SigmoidFamilySpec(), 2, 17, 17, 4, 2, 16, torch.float32, MaskSpec(causal=True), False,
                           0.0, None, False),
    "sigmoid-bias-full-d64": (SigmoidFamilySpec(bias=-2.0, sm_scale=0.3), 1, 200, 200, 2, 1, 64, torch.float16,
                              MaskSpec(causal=False), False, 0.0, None, False),
    "sigmoid-window-d128": (SigmoidFamilySpec(), 2, 130, 130, 4, 4, 128, torch.bfloat16,
                            MaskSpec(causal=True, window=29), False, 0.0, None, False),
    "sigmoid-ranker-dropout-d64": (SigmoidFamilySpec(), 2, 96, 96, 4, 2, 64, torch.float16, MaskSpec(causal=True),
                                   True, 0.2, None, False),
    "longer-keys": (SigmoidFamilySpec(), 2, 20, 300, 4, 2, 64, torch.float16, MaskSpec(causal=True), False, 0.0,
                    None, False),
    "decode-splits": (SigmoidFamilySpec(bias=-1.0), 2, 3, 1000, 4, 2, 128, torch.bfloat16, MaskSpec(causal=True),
                      False, 0.0, "6", False),
    "decode-key-lengths": (SigmoidFamilySpec(), 2, 1, 700, 4, 1, 64, torch.float16, MaskSpec(causal=True), False,
                           0.0, "3", True),
}


@pytest.mark.parametrize("case", list(SIGMOID_CASES))
def test_sigmoid_family_launches(case, monkeypatch):
    spec, b, n, kv, h, h_kv, d, dtype, mask, seg, p, splits, lens = SIGMOID_CASES[case]
    _gpu_mode(monkeypatch)
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    monkeypatch.delenv(sg.PATH_ENV, raising=False)  # auto: per kernel and dtype
    if splits is None:
        monkeypatch.delenv(runtime.DECODE_SPLITS_ENV, raising=False)
    else:
        monkeypatch.setenv(runtime.DECODE_SPLITS_ENV, splits)
    gen = torch.Generator().manual_seed(3)
    named = _qkv(b, n, kv, h, h_kv, d, dtype, gen)
    options = _call_options(named, b, n, kv, seg, p, lens, seed=7)
    rec = _recording(monkeypatch, named)
    with torch.set_grad_enabled(not lens):
        for t in (named["q"], named["k"], named["v"]):
            t.requires_grad_(not lens)
        out = sg.fused_attention(named["q"], named["k"], named["v"], spec, mask, named.get("segment_ids"), **options)
        if not lens:
            out.float().sum().backward()
    _compare(f"sigmoid_family/{case}", rec.launches)


def _compare(key: str, launches: list) -> None:
    assert launches, f"{key}: nothing launched"
    if os.environ.get("ATTNLAB_WRITE_LAUNCH_SNAPSHOT") == "1":
        table = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
        table[key] = launches
        SNAPSHOT.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    launches = json.loads(json.dumps(launches))  # tuples as lists, as the file holds them
    want = json.loads(SNAPSHOT.read_text())[key]
    assert len(launches) == len(want), (key, [x["kernel"] for x in launches], [x["kernel"] for x in want])
    for i, (got, exp) in enumerate(zip(launches, want)):
        assert got == exp, (key, i, got["kernel"])


def test_tunes_says_whether_a_launch_would_time_candidates_first(monkeypatch):
    """Kernel.tunes: True only where a launch would time its candidates (the GPU, unpinned, a new key, more
    than one candidate), so an accumulating kernel (the one-pass dk/dv) can run once more afterwards."""
    _gpu_mode(monkeypatch)
    monkeypatch.delenv("ATTNLAB_AUTOTUNE", raising=False)
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    kernel = runtime.Kernel(None, "probe")
    two = [runtime.TileConfig(64, 64, 4, 3), runtime.TileConfig(32, 64, 4, 3)]
    assert kernel.tunes(two, "k") and not kernel.tunes(two[:1], "k")
    kernel.tuned["k"] = two[1]
    assert not kernel.tunes(two, "k") and kernel.tunes(two, "other")
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    assert not kernel.tunes(two, "other")
    monkeypatch.delenv("ATTNLAB_AUTOTUNE")
    monkeypatch.setattr(runtime, "interpreting", lambda: True)
    assert not kernel.tunes(two, "other")
