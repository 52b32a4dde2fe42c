"""The launch mechanism both kernel tiers share (attn/kernels/runtime.py: `DirectLauncher`) and the Gluon
kernels' host side (attn/kernels/gluon_*.py), on the CPU: nothing here runs a kernel.

- `DirectLauncher`: a launch after the first of a specialization calls the compiled launcher with the
  arguments Triton's JIT would pass; the cached launcher serves only calls of its own specialization
  (scalar values and types, tensor dtypes and 16-byte alignment, TMA descriptors' dtype, block shape and
  layout, keyword arguments by name and value, constexpr defaults); ATTNLAB_DIRECT_LAUNCH=0, the
  interpreter and a Triton without the fields it reads send launches through the JIT.
- every Gluon entry point (softmax forward plain, capped with the bound shift, with a temperature;
  threshold and sigmoid forwards; softmax backward, capped, with d-temperature, and its one-pass dQ form
  (ATTNLAB_GLUON_DQ=one_pass) plain and capped with a temperature; threshold and sigmoid backwards;
  differential forward and backward), its kernels' `fn` replaced by a recorder: each launch binds every
  parameter (lengths, heads, strides of the tensors it writes, descriptors of the operands, the one-pass
  form's fp32 dq), and a repeated call with fresh tensors takes the direct path with exactly the JIT's
  arguments of that call; another length goes through the JIT again. The softmax backward's forms launch
  their own kernels: the one-pass form's three share one fp32 dq (zeroed, reduced into, cast), and
  d-temperature stays on the separate form.
- `tma_view` (read in place where the strides allow, a size-1 dim's stride free; copied into standard
  strides otherwise), `tma_tile` (one block shape and layout object per tile), `descriptor`
  (equal to TensorDescriptor's own construction).

tests/test_gluon_launch_gpu.py runs the direct launches on an H100 against ATTNLAB_DIRECT_LAUNCH=0 bitwise.
"""

from __future__ import annotations

import types

import pytest
import torch

from attn.kernels import gluon_pipeline, runtime

# -------------------------------------------------------------------------------- recorders


class _Compiled:
    """What DirectLauncher reads off Triton's compiled kernel; `run` records each direct launch."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log, fn):
        self.log, self.fn = log, fn

    def run(self, *args):
        self.log.append(("direct", self.fn, args))


class _Recorder:
    """A jit function's stand-in: the real one's parameters (or `arg_names` and `params` given), its JIT
    launches (`run`) and plain launches (`fn[grid](...)`) recorded."""

    def __init__(self, log, real=None, arg_names=None, params=None, compiled=_Compiled):
        self.log = log
        self.real = real
        self.arg_names = list(real.arg_names) if real is not None else arg_names
        self.params = list(real.params) if real is not None else params
        self.compiled = compiled

    def run(self, *args, grid, warmup, **kwargs):
        self.log.append(("jit", self, args, kwargs, grid))
        return self.compiled(self.log, self)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(("plain", self, args, kwargs, grid))


@pytest.fixture
def direct_mode(monkeypatch):
    """The GPU's launch path on the CPU: no interpreter, a fixed device and stream, direct launches on."""
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.delenv(runtime.DIRECT_ENV, raising=False)


def _param(name, default=None):
    return types.SimpleNamespace(name=name, has_default=default is not None, default=default)


def _fake_launcher(log, names=("A", "n", "s", "K", "BLOCK"), defaults=None):
    defaults = defaults or {}
    fn = _Recorder(log, arg_names=list(names), params=[_param(n, defaults.get(n)) for n in names])
    return runtime.DirectLauncher(fn, "fake")


def _kinds(log):
    return [entry[0] for entry in log]


# ------------------------------------------------------------------------- DirectLauncher


def test_a_repeated_specialization_launches_directly_with_the_jit_arguments(direct_mode):
    log = []
    launcher = _fake_launcher(log)
    buf = torch.zeros(64)
    a, b = buf[:16], buf[16:32]
    launcher.run((3, 2), (), (a,), (100, 0.5), {"K": 7}, {"BLOCK": 64, "num_warps": 4})
    launcher.run((3, 2), (), (b,), (100, 0.5), {"K": 7}, {"BLOCK": 64, "num_warps": 4})
    assert _kinds(log) == ["jit", "direct"]
    _, fn, args, kwargs, grid = log[0]
    assert args == (a, 100, 0.5) and kwargs == {"K": 7, "BLOCK": 64, "num_warps": 4} and grid == (3, 2)
    grid0, grid1, grid2, stream, function, metadata, launch_metadata, enter, exit_, *kernel_args = log[1][2]
    assert (grid0, grid1, grid2, stream, function, metadata) == (3, 2, 1, 1234, "function", "metadata")
    assert (launch_metadata, enter, exit_) == (None, None, None)
    assert kernel_args[0] is b and kernel_args[1:] == [100, 0.5, 7, 64]  # the constexprs in parameter order


@pytest.mark.parametrize("other", [1.0, True, 2, 17])
def test_a_scalar_of_another_type_or_value_is_another_specialization(other, direct_mode):
    """1, 1.0 and True are equal in Python but three specializations to Triton (constexpr 1, fp32, i1)."""
    log = []
    launcher = _fake_launcher(log)
    t = torch.zeros(16)
    launcher.run((1,), (), (t,), (1, 0.5), {"K": 1}, {"BLOCK": 64})
    launcher.run((1,), (), (t,), (other, 0.5), {"K": 1}, {"BLOCK": 64})
    launcher.run((1,), (), (t,), (1, 0.5), {"K": 1}, {"BLOCK": 64})
    assert _kinds(log) == ["jit", "jit", "direct"]


def test_tensors_key_on_dtype_and_alignment_only(direct_mode):
    log = []
    launcher = _fake_launcher(log)
    buf = torch.zeros(256)
    runs = [buf[:16], buf[32:48], buf[1:17], buf[33:49], buf[:16].double(), buf[:16].view(2, 8)]
    for t in runs:
        launcher.run((1,), (), (t,), (100, 0.5), {"K": 1}, {"BLOCK": 64})
    # aligned float32, another aligned one (direct), misaligned (JIT), another misaligned (direct), float64 (JIT),
    # another shape of the first (direct: shapes and strides are arguments of the kernel, not specialized)
    assert _kinds(log) == ["jit", "direct", "jit", "direct", "jit", "direct"]


def test_keyword_arguments_key_by_name_and_value(direct_mode):
    log = []
    launcher = _fake_launcher(log, names=("A", "n", "s", "K", "L"))
    t = torch.zeros(16)
    launcher.run((1,), (), (t,), (100, 0.5), {"K": 1, "L": 2}, {})
    launcher.run((1,), (), (t,), (100, 0.5), {"L": 1, "K": 2}, {})  # the same values, swapped between names
    launcher.run((1,), (), (t,), (100, 0.5), {"K": 1, "L": 2}, {"num_warps": 8})
    assert _kinds(log) == ["jit", "jit", "jit"]
    launcher.run((1,), (), (t,), (100, 0.5), {"L": 1, "K": 2}, {})
    assert _kinds(log)[-1] == "direct" and log[-1][2][-2:] == (2, 1)  # K, L in the kernel's order


def test_constexprs_left_out_pass_their_defaults(direct_mode):
    log = []
    launcher = _fake_launcher(log, names=("A", "n", "s", "K", "POLY"), defaults={"POLY": 3})
    t = torch.zeros(16)
    for _ in range(2):
        launcher.run((1,), (), (t,), (100, 0.5), {"K": 1}, {})
    assert _kinds(log) == ["jit", "direct"] and log[1][2][-2:] == (1, 3)


def _descriptor_stand_in(base, block=(16, 8), layout="layout-a", shape=None, strides=None):
    return types.SimpleNamespace(base=base, shape=shape or [base.shape[0], base.shape[1]],
                                 strides=strides or list(base.stride()), block_shape=list(block), layout=layout,
                                 padding="zero")


def test_descriptors_key_on_base_dtype_block_shape_and_layout(direct_mode):
    log = []
    launcher = _fake_launcher(log, names=("desc", "n", "K"))
    x, y = torch.zeros(64, 8), torch.zeros(32, 16)
    runs = [
        _descriptor_stand_in(x),
        _descriptor_stand_in(y, shape=[32, 16], strides=[16, 1]),  # address, shape, strides: launch arguments
        _descriptor_stand_in(x, block=(32, 8)),
        _descriptor_stand_in(x, layout="layout-b"),
        _descriptor_stand_in(x.double()),
    ]
    for desc in runs:
        launcher.run((1,), (desc,), (), (5,), {"K": 1}, {})
    assert _kinds(log) == ["jit", "direct", "jit", "jit", "jit"]
    assert log[1][2][9] is runs[1]  # the descriptor itself: Triton's launcher fills its CUtensorMap


def test_the_switch_and_the_interpreter_send_every_launch_through_the_jit(direct_mode, monkeypatch):
    log = []
    launcher = _fake_launcher(log)
    t = torch.zeros(16)

    def launch():
        launcher.run((2,), (), (t,), (100, 0.5), {"K": 1}, {"BLOCK": 64})

    launch()
    monkeypatch.setenv(runtime.DIRECT_ENV, "0")
    launch()
    assert _kinds(log) == ["jit", "plain"] and log[1][2] == (t, 100, 0.5) and log[1][3] == {"K": 1, "BLOCK": 64}
    monkeypatch.delenv(runtime.DIRECT_ENV)
    monkeypatch.setattr(runtime, "interpreting", lambda: True)
    launch()
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    launch()
    assert _kinds(log) == ["jit", "plain", "plain", "direct"]


def test_a_triton_whose_compiled_kernels_lack_a_field_keeps_the_jit_path(direct_mode):
    class Bare:  # no packed_metadata
        function = "function"

        def __init__(self, log, fn):
            pass

    log = []
    fn = _Recorder(log, arg_names=["A", "n", "s", "K"], params=[_param(n) for n in "A n s K".split()], compiled=Bare)
    launcher = runtime.DirectLauncher(fn, "bare")
    t = torch.zeros(16)
    for _ in range(3):
        launcher.run((1,), (), (t,), (100, 0.5), {"K": 1}, {})
    assert _kinds(log) == ["jit", "plain", "plain"]


def test_kernel_launches_run_through_the_direct_launcher(direct_mode):
    """runtime.Kernel (the portable kernels) passes its meta and the config's tiles and options."""
    log = []
    fn = _Recorder(log, arg_names=["A", "n", "K", "BLOCK_M", "BLOCK_N"],
                   params=[_param(n) for n in ("A", "n", "K", "BLOCK_M", "BLOCK_N")])
    kernel = runtime.Kernel(fn, "portable")
    cfg = runtime.TileConfig(64, 32, 4, 2)
    t = torch.zeros(16)
    for _ in range(2):
        kernel.run(cfg, (5,), (t,), (9,), {"K": 3})
    assert _kinds(log) == ["jit", "direct"]
    assert log[0][3] == {"K": 3, "BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    assert log[1][2][9:] == (t, 9, 3, 64, 32)
    kernel.run(runtime.TileConfig(64, 32, 8, 2), (5,), (t,), (9,), {"K": 3})  # other warps: another kernel
    assert _kinds(log)[-1] == "jit"


# ----------------------------------------------------------------------------- Gluon host side

needs_descriptor = pytest.mark.skipif(gluon_pipeline._IMPORT_ERROR is not None,
                                      reason=f"no Gluon TensorDescriptor: {gluon_pipeline._IMPORT_ERROR}")


def test_tma_view_reads_a_tensor_in_place_where_its_strides_allow_and_copies_the_rest():
    base = torch.randn(2, 5, 3, 64, dtype=torch.bfloat16)
    flat, shape, strides = gluon_pipeline.tma_view(base)
    assert flat is base and shape == (10, 192) and strides == (192, 1)
    # one query per batch, heads first in memory: the rows step by stride(0), not by stride(1)
    one_row = torch.randn(2, 3, 1, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert one_row.stride() == (192, 64, 64, 1)
    flat, shape, strides = gluon_pipeline.tma_view(one_row)
    assert flat is one_row and shape == (2, 192) and strides == (192, 1)
    # one batch: its stride is free (a slice of a longer cache is read in place)
    window = torch.randn(1, 10, 3, 64, dtype=torch.bfloat16)[:, 2:7]
    flat, shape, strides = gluon_pipeline.tma_view(window)
    assert flat is window and shape == (5, 192) and strides == (192, 1)
    # one head: its stride is free
    one_head = torch.randn(2, 5, 64, dtype=torch.bfloat16).as_strided((2, 5, 1, 64), (320, 64, 7, 1))
    flat, shape, strides = gluon_pipeline.tma_view(one_head)
    assert flat is one_head and shape == (10, 64) and strides == (64, 1)
    # copied: an address 2 bytes past a 16-byte boundary, heads-major rows, batches not L rows apart
    storage = torch.randn(2 * 5 * 3 * 64 + 1, dtype=torch.bfloat16)
    misaligned = storage[1:].view(2, 5, 3, 64)
    heads_major = torch.randn(2, 3, 5, 64, dtype=torch.bfloat16).transpose(1, 2)
    gapped = torch.randn(2, 7, 3, 64, dtype=torch.bfloat16)[:, :5]
    for t in (misaligned, heads_major, gapped):
        flat, shape, strides = gluon_pipeline.tma_view(t)
        assert flat is not t and flat.stride() == (960, 192, 64, 1) and flat.data_ptr() % 16 == 0
        assert shape == (10, 192) and strides == (192, 1) and torch.equal(flat, t)


@needs_descriptor
def test_tiles_are_made_once_and_descriptors_equal_tensor_descriptors():
    tile = gluon_pipeline.tma_tile(torch.bfloat16, 64, 128)
    assert gluon_pipeline.tma_tile(torch.bfloat16, 64, 128) is tile
    block, layout = tile
    assert block == [64, 128] and layout is gluon_pipeline.smem_layout([64, 128], gluon_pipeline.gl.bfloat16)
    q = torch.randn(2, 7, 2, 64, dtype=torch.bfloat16)
    view = gluon_pipeline.tma_view(q)
    desc = gluon_pipeline.descriptor(view, tile)
    made = gluon_pipeline.TensorDescriptor(q, [14, 128], [128, 1], [64, 128], layout)
    assert desc == made and desc.base is q and type(desc) is gluon_pipeline.TensorDescriptor


B, N, KV, H, H_KV, D = 2, 200, 333, 4, 2, 64
STRIDES = [  # (tensor parameter, its stride parameters: batch, row, head)
    ("O", ("stride_ob", "stride_on", "stride_oh")), ("DO", ("stride_dob", "stride_don", "stride_doh")),
    ("DQ", ("stride_dqb", "stride_dqn", "stride_dqh")), ("DK", ("stride_dkb", "stride_dkn", "stride_dkh")),
    ("DK", ("stride_kvb", "stride_kvn", "stride_kvh")), ("DV", ("stride_dvb", "stride_dvn", "stride_dvh")),
    ("TEMP", ("stride_tb", "stride_tn")), ("LAM", ("stride_lam",)),
]


def _inputs(gen, n=N, kv=KV):
    def r(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    x = dict(q=r(B, n, H, D), k=r(B, kv, H_KV, D), v=r(B, kv, H_KV, D), o=r(B, n, H, D), do=r(B, n, H, D),
             q2=r(B, n, H, D), k2=r(B, kv, H_KV, D), lse=torch.randn(B, H, n, generator=gen),
             lam=torch.rand(H, generator=gen), temp=torch.rand(B, n + 3, generator=gen)[:, 3:])
    return x


def _entries():
    from attn.kernels import gluon_diff_bwd as dbw
    from attn.kernels import gluon_diff_fwd as dfw
    from attn.kernels import gluon_softmax_bwd as sbw
    from attn.kernels import gluon_softmax_fwd as sfw
    from attn.kernels import gluon_weighted_bwd as wbw
    from attn.kernels import gluon_weighted_fwd as wfw

    return {
        "softmax_fwd": lambda x: sfw.launch_forward(x["q"], x["k"], x["v"], True, 0.18),
        "tanh_fwd_bound_shift": lambda x: sfw.launch_forward(x["q"], x["k"], x["v"], False, 0.3, cap=1,
                                                             cap_scale=0.02, shift=43.3),
        "alsc_fwd_temperature": lambda x: sfw.launch_forward(x["q"], x["k"], x["v"], True, 0.3, cap=3, cap_scale=0.02,
                                                             alsc_knee=0.5, temperature=x["temp"]),
        "threshold_fwd": lambda x: wfw.launch_threshold(x["q"], x["k"], x["v"], True, 0.7, 1.5),
        "sigmoid_fwd": lambda x: wfw.launch_sigmoid(x["q"], x["k"], x["v"], False, 0.125, -1.0),
        "softmax_bwd": lambda x: sbw.launch_backward(x["q"], x["k"], x["v"], x["o"], x["do"], x["lse"], 0.125, True),
        "soft_sign_bwd": lambda x: sbw.launch_backward(x["q"], x["k"], x["v"], x["o"], x["do"], x["lse"], 0.125, False,
                                                       cap=2, cap_value=5.0),
        "alsc_bwd_dt": lambda x: sbw.launch_backward_with_dt(x["q"], x["k"], x["v"], x["o"], x["do"], x["lse"], 0.125,
                                                             True, temperature=x["temp"], cap=3, cap_value=5.0,
                                                             knee=0.25),
        # ONE_PASS entries: run with ATTNLAB_GLUON_DQ=one_pass
        "softmax_bwd_one_pass": lambda x: sbw.launch_backward(x["q"], x["k"], x["v"], x["o"], x["do"], x["lse"], 0.125,
                                                              True),
        "tanh_bwd_one_pass_temperature": lambda x: sbw.launch_backward(x["q"], x["k"], x["v"], x["o"], x["do"],
                                                                       x["lse"], 0.125, False, cap=1, cap_value=5.0,
                                                                       temperature=x["temp"]),
        "alsc_bwd_dt_one_pass_set": lambda x: sbw.launch_backward_with_dt(x["q"], x["k"], x["v"], x["o"], x["do"],
                                                                          x["lse"], 0.125, True, temperature=x["temp"],
                                                                          cap=3, cap_value=5.0, knee=0.25),
        "threshold_bwd": lambda x: wbw.launch_threshold_backward(x["q"], x["k"], x["v"], x["do"], True, 0.7, 2.0),
        "sigmoid_bwd": lambda x: wbw.launch_sigmoid_backward(x["q"], x["k"], x["v"], x["do"], False, 0.125, None),
        "threshold_bwd_one_pass": lambda x: wbw.launch_threshold_backward(x["q"], x["k"], x["v"], x["do"], True, 0.7,
                                                                          1.5, one_pass=True),
        "sigmoid_bwd_one_pass": lambda x: wbw.launch_sigmoid_backward(x["q"], x["k"], x["v"], x["do"], False, 0.125,
                                                                      -1.0, one_pass=True),
        "diff_fwd": lambda x: dfw.launch_diff_threshold(x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], True, 0.8,
                                                        1.5),
        "diff_bwd": lambda x: dbw.launch_diff_threshold_backward(x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"],
                                                                 x["do"], True, 0.8, 2.0),
        **{f"diff_bwd_{form}": (lambda x, form=form: dbw.launch_diff_threshold_backward(
            x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], x["do"], False, 0.8, 1.5, dkdv_form=form))
           for form in ("view_warpgroups", "view_exchange")},
        "diff_bwd_dq_views": lambda x: dbw.launch_diff_threshold_backward(
            x["q"], x["k"], x["v"], x["q2"], x["k2"], x["lam"], x["do"], True, 0.8, 2.0, dkdv_form="view_warpgroups",
            dq_form="view_warpgroups"),
    }


# entries run with ATTNLAB_GLUON_DQ=one_pass, and the softmax backward's kernels each entry launches
ONE_PASS = ("softmax_bwd_one_pass", "tanh_bwd_one_pass_temperature", "alsc_bwd_dt_one_pass_set")
SEPARATE_KERNELS = ["_delta_kernel", "_dkdv_kernel", "_dq_kernel"]
BACKWARD_KERNELS = {"softmax_bwd": SEPARATE_KERNELS, "soft_sign_bwd": SEPARATE_KERNELS, "alsc_bwd_dt": SEPARATE_KERNELS,
                    "softmax_bwd_one_pass": ["_delta_zero_dq_kernel", "_dkdv_dq_kernel", "_dq_cast_kernel"],
                    "tanh_bwd_one_pass_temperature": ["_delta_zero_dq_kernel", "_dkdv_dq_kernel", "_dq_cast_kernel"],
                    "alsc_bwd_dt_one_pass_set": SEPARATE_KERNELS,  # d-temperature: the separate form
                    "threshold_bwd_one_pass": ["_dkdv_dq_kernel", "_dq_cast_kernel"],  # dq zeroed by torch
                    "sigmoid_bwd_one_pass": ["_dkdv_dq_kernel", "_dq_cast_kernel"]}


@pytest.fixture
def gluon_recorders(direct_mode, monkeypatch):
    """Every Gluon DirectLauncher's kernel replaced by a recorder of the real kernel's parameters."""
    from attn.kernels import (gluon_diff_bwd, gluon_diff_fwd, gluon_softmax_bwd, gluon_softmax_fwd,
                              gluon_weighted_bwd, gluon_weighted_fwd)

    log = []
    for module in (gluon_softmax_fwd, gluon_weighted_fwd, gluon_softmax_bwd, gluon_weighted_bwd, gluon_diff_fwd,
                   gluon_diff_bwd):
        for value in vars(module).values():
            if isinstance(value, runtime.DirectLauncher):
                monkeypatch.setattr(value, "fn", _Recorder(log, real=value.fn))
                monkeypatch.setattr(value, "_compiled", {})
                monkeypatch.setattr(value, "_no_direct", False)
    return log


def _binding(fn, args, kwargs):
    """A JIT launch's arguments by parameter name, in the kernel's parameter order, defaults included."""
    given = {**dict(zip(fn.arg_names, args)), **kwargs}
    missing = [p.name for p in fn.params if p.name not in given and not p.has_default]
    assert not missing, f"{fn.real.__name__}: parameters without a value: {missing}"
    return {p.name: given[p.name] if p.name in given else p.default for p in fn.params}


def _check_binding(fn, args, bound, x, n, kv):
    name = fn.real.__name__
    positional = [p.name for p in fn.params if not p.is_constexpr]
    assert list(fn.arg_names[:len(args)]) == positional, f"{name}: constexprs only by keyword"
    expected = {"q_len": n, "kv_len": kv, "H": H, "H_KV": H_KV, "GROUP": H // H_KV}
    for key, value in expected.items():
        if key in bound:
            assert bound[key] == value, (name, key, bound[key], value)
    for tensor, stride_names in STRIDES:
        if tensor in bound and all(s in bound for s in stride_names):
            unused = tensor == "TEMP" and not bound.get("HAS_TEMP", True)  # a stand-in pointer, strides 0
            want = (0, 0) if unused else bound[tensor].stride()[:len(stride_names)]
            assert tuple(bound[s] for s in stride_names) == tuple(want), (name, tensor)
    inputs = {t.data_ptr(): key for key, t in x.items()}
    for param, value in bound.items():
        if param == "dq_desc":  # the one-pass form's fp32 dq (B, N, H, D), in reduce boxes of D / 2 columns
            assert tuple(value.base.shape) == (B, n, H, D) and value.base.dtype == torch.float32, name
            assert list(value.shape) == [B * n, H * D] and list(value.strides) == [H * D, 1], name
            assert list(value.block_shape) == [64, D // 2], name
        elif param.endswith("_desc"):
            assert inputs.get(value.base.data_ptr()) in ("q", "k", "v", "do", "q2", "k2"), (name, param)
            rows = value.base.shape[0] * value.base.shape[1]
            assert list(value.shape) == [rows, value.base.shape[2] * D] and list(value.strides) == [value.shape[1], 1]
            assert value.block_shape[1] == D, (name, param)


def _comparable(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if hasattr(value, "block_shape"):
        return ("descriptor", _comparable(value.base), list(value.shape), list(value.strides), list(value.block_shape),
                value.layout)
    return (type(value), value)


@pytest.mark.parametrize("entry", list(_entries()))
def test_gluon_launches_bind_every_parameter_and_repeat_directly_with_the_jit_arguments(entry, gluon_recorders,
                                                                                       monkeypatch):
    from attn.kernels import gluon_softmax_bwd

    log = gluon_recorders
    call = _entries()[entry]
    if entry in ONE_PASS:
        monkeypatch.setenv(gluon_softmax_bwd.DQ_FORM_ENV, "one_pass")
    else:
        monkeypatch.delenv(gluon_softmax_bwd.DQ_FORM_ENV, raising=False)
    gen = torch.Generator().manual_seed(0)
    first = _inputs(gen)
    call(first)
    jit_launches = [e for e in log if e[0] == "jit"]
    assert jit_launches and len(jit_launches) == len(log)
    if entry in BACKWARD_KERNELS:
        assert [fn.real.__name__ for _, fn, *_ in jit_launches] == BACKWARD_KERNELS[entry]
    for _, fn, args, kwargs, grid in jit_launches:
        bound = _binding(fn, args, kwargs)
        _check_binding(fn, args, bound, first, N, KV)
        assert kwargs["num_warps"] == gluon_pipeline.NUM_WARPS
        if fn.real.__name__ == "_dq_cast_kernel":  # one program per CAST_BLOCK elements of dq
            assert bound["numel"] == B * N * H * D and grid == (-(-bound["numel"] // gluon_softmax_bwd.CAST_BLOCK),)
        else:
            assert grid[1] in (B * H, B * H_KV)
    if BACKWARD_KERNELS.get(entry, [None])[0] == "_delta_zero_dq_kernel":  # one fp32 dq: zeroed, reduced into, cast
        zeroed, reduced, cast = (_binding(fn, args, kwargs) for _, fn, args, kwargs, _ in jit_launches)
        assert zeroed["DQ_ACC"] is reduced["dq_desc"].base is cast["DQ_ACC"]
    if BACKWARD_KERNELS.get(entry, [None])[0] == "_dkdv_dq_kernel":  # a zeroed fp32 dq, reduced into, cast
        reduced, cast = (_binding(fn, args, kwargs) for _, fn, args, kwargs, _ in jit_launches)
        assert reduced["dq_desc"].base is cast["DQ_ACC"] and not cast["DQ_ACC"].any()  # the recorder launches none
        assert reduced["grad_scale"] == cast["grad_scale"]

    fresh = _inputs(gen)  # new tensors of the same specialization: every launch direct
    log.clear()
    call(fresh)
    direct = list(log)
    assert direct and all(e[0] == "direct" for e in direct), [e[0] for e in direct]
    monkeypatch.setenv(runtime.DIRECT_ENV, "0")
    log.clear()
    call(fresh)
    plain = list(log)
    assert len(plain) == len(direct) and all(e[0] == "plain" for e in plain)
    for (_, fn, direct_args), (_, plain_fn, args, kwargs, grid) in zip(direct, plain):
        assert fn is plain_fn
        bound = _binding(fn, args, kwargs)
        _check_binding(fn, args, bound, fresh, N, KV)
        assert direct_args[:3] == (*grid, *[1] * (3 - len(grid)))
        assert [_comparable(a) for a in direct_args[9:]] == [_comparable(v) for v in bound.values()], fn.real.__name__
        inputs = {t.data_ptr() for t in fresh.values()}
        for a, b in zip(direct_args[9:], bound.values()):  # the inputs' descriptors address the inputs themselves
            if hasattr(a, "block_shape") and a.base.data_ptr() in inputs:
                assert a.base is b.base

    monkeypatch.delenv(runtime.DIRECT_ENV)
    log.clear()
    odd = _inputs(gen, n=127, kv=127)  # other lengths: other integer arguments, the JIT again
    call(odd)
    assert [e[0] for e in log] == ["jit"] * len(direct)
    for _, fn, args, kwargs, _ in log:
        _check_binding(fn, args, _binding(fn, args, kwargs), odd, 127, 127)


@pytest.mark.parametrize("change, message", [
    (dict(q2=torch.zeros(1, 8, 4, 64)), r"q2 must have the shape of q \(1, 9, 4, 64\), got \(1, 8, 4, 64\)"),
    (dict(k2=torch.zeros(1, 9, 2, 64, dtype=torch.float16)), r"k2 must match k's dtype and device"),
    (dict(dout=torch.zeros(1, 9, 4, 32, dtype=torch.bfloat16)), r"dout must have the shape of q"),
    (dict(lam=torch.zeros(2)), r"lam must be a tensor of shape \(H,\) = \(4,\)"),
    (dict(lam=torch.zeros(4, dtype=torch.float64)), r"lam must be float32, bfloat16 or float16"),
    (dict(power=0.0), r"power must be > 0 and finite, got 0.0"),
    (dict(beta=float("nan")), r"beta must be finite"),
])
def test_the_differential_entries_name_what_their_second_view_misses(change, message):
    """The differential entries' check of the second view, lam, power and beta (and the backward's dout), on any
    device: the refusal names the argument and what is allowed."""
    from attn.kernels.gluon_diff_fwd import check_second_view

    q = torch.zeros(1, 9, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 9, 2, 64, dtype=torch.bfloat16)
    args = dict(q=q, k=k, q2=q.clone(), k2=k.clone(), lam=torch.zeros(4), beta=1.0, power=2.0, dout=q.clone())
    check_second_view(**args, what="entry")  # every argument as allowed
    with pytest.raises(ValueError, match=r"^entry: " + message):
        check_second_view(**{**args, **change}, what="entry")


def test_both_differential_entries_run_the_second_view_check(monkeypatch):
    """The forward and the backward entry refuse a bad second view (the backward a bad dout too) with the check's
    message under their own names; `check_operands` (CUDA, sm_90) is stood in for to reach it on the CPU."""
    from attn.kernels import gluon_diff_bwd, gluon_diff_fwd

    for module in (gluon_diff_fwd, gluon_diff_bwd):
        monkeypatch.setattr(module, "check_operands", lambda *args: None)
    q = torch.zeros(1, 9, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 9, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^gluon differential threshold forward: q2 must have the shape of q"):
        gluon_diff_fwd.gluon_diff_threshold_forward(q, k, k, q[:, :8], k, torch.zeros(4), True)
    with pytest.raises(ValueError, match=r"^gluon differential threshold backward: dout must have the shape of q"):
        gluon_diff_bwd.gluon_diff_threshold_backward(q, k, k, q, k, torch.zeros(4), q[:, :8], True)
