"""The launch runtime every kernel family shares: tile configs, tuning or pinning, direct launches.

A family module holds its kernels' math and the data of its `ConfigTable` (candidate tile configs
per kernel and variant, the interpreter's tiles). The table gives a launch its candidates and
`Kernel.launch` picks one per tuning key and starts the compiled kernel with as little host work as
possible, because at training shapes a call's host work can exceed its GPU time:

* candidates: under the interpreter (CPU tests) one small config per kernel; on a GPU the table's
  list for the kernel and variant (the first is the pinned default), or one untimed config for
  launches of few rows where the table names one. Tuning keys bucket lengths with `n_bucket`.
* config: a pinned one (`ATTNLAB_AUTOTUNE=0`: the first candidate, or `ATTNLAB_KERNEL_CONFIG=i`:
  the i-th); otherwise the fastest candidate, timed once per key at its first launch and
  remembered (one dict lookup per launch after that).
* launch (`DirectLauncher`, the portable kernels' and the Gluon kernels' alike): the compiled kernel
  of one specialization (integer values, pointer alignment, dtypes, TMA descriptors' dtype, block
  shape and layout, constexprs) is remembered after its first launch through Triton's JIT; later
  launches call its launcher directly, skipping the JIT's argument binding and cache-key work.
  `ATTNLAB_DIRECT_LAUNCH=0` sends every launch through the JIT (the yardstick the GPU checks
  compare the direct path against). Tuning and first launches time and compile: they belong in
  warm-up steps, never inside a CUDA-graph capture.
* plans: a family's entry keeps, per call signature (shapes, strides, dtypes, flags, scalars and
  the launch settings), everything its launches derive from it (`LaunchPlans`), so a repeated call
  allocates its outputs and launches without recomputing configs, keys or scalars.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from attn.kernels.env import PIN_ENV, autotune_pinned, interpreting, setting, settings_values

CONFIG_ENV = "ATTNLAB_KERNEL_CONFIG"
DIRECT_ENV = "ATTNLAB_DIRECT_LAUNCH"
# "BM,BN": the interpreter's tiles of a table built with env_blocks=True (query-block kernels BM x BN,
# key-block kernels BN x BM)
INTERPRET_BLOCKS_ENV = "ATTNLAB_INTERPRET_BLOCKS"
DECODE_SPLITS_ENV = "ATTNLAB_DECODE_SPLITS"
# 0, 1 or a comma list of TMA_KERNELS: the kernels that load tiles through TMA descriptors (`use_tma`);
# dq_add: the one-pass backward adds its dq tiles by TMA bulk reduce
TMA_ENV = "ATTNLAB_TMA"
TMA_KERNELS = ("fwd", "dkdv", "dq", "dq_add")
# "BLOCK_N,warps,stages": the split-key forward's tiles (sweeps; 16 query rows always)
DECODE_TILES_ENV = "ATTNLAB_DECODE_TILES"
# the split-key (flash-decoding) forward serves calls with at most this many queries
DECODE_MAX_QUERIES = 16
# each split walks at least this many key tiles (fewer make the merge cost more than it saves)
DECODE_MIN_TILES_PER_SPLIT = 4
DECODE_MAX_SPLITS = 64


@dataclass(frozen=True)
class TileConfig:
    """One candidate launch config: tile sizes (the kernels' BLOCK_M / BLOCK_N) and Triton options."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}

    @functools.cached_property
    def launch_options(self) -> dict:
        """The config's keyword arguments of a launch (tile constexprs and Triton's options), one dict per
        config, read and never changed (a launch passes it without building one)."""
        return {**self.meta(), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        return f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} warps={self.num_warps} stages={self.num_stages}"


def cdiv(a: int, b: int) -> int:
    # plain Python: triton.cdiv goes through the JIT's call machinery (~5 us per call)
    return -(-a // b)


def n_bucket(n: int, cap: int | None = None) -> int:
    """A length as tuning keys hold it: the next power of two, at least 64, at most `cap` if given."""
    bucket = max(64, 1 << (max(n, 1) - 1).bit_length())
    return bucket if cap is None else min(bucket, cap)


class ConfigTable:
    """One family's candidate tile configs, per kernel kind (a family's names: "fwd", "dq", ...).

    gpu: {(kind, *variant): [TileConfig, ...]}, the first the pinned default; `default` serves a
    (kind, *variant) without an entry. small: {kind: TileConfig}, the one untimed config of a launch
    of at most `small_n` rows (kinds without one always take their list). interpreter: {kind: (BLOCK_M,
    BLOCK_N)}, the one config under TRITON_INTERPRET=1 (4 warps, 1 stage; tests may change the dict);
    with env_blocks, ATTNLAB_INTERPRET_BLOCKS="BM,BN" overrides it: (BM, BN) for every kind, (BN, BM)
    for those in `key_block_kinds`."""

    def __init__(self, gpu: dict[tuple, list[TileConfig]], interpreter: dict[str, tuple[int, int]], *,
                 default: list[TileConfig] | None = None, small: dict[str, TileConfig] | None = None,
                 small_n: int = 64, env_blocks: bool = False, key_block_kinds: tuple[str, ...] = ()):
        self.gpu = gpu
        self.interpreter = interpreter
        self.default = default
        self.small = small or {}
        self.small_n = small_n
        self.env_blocks = env_blocks
        self.key_block_kinds = key_block_kinds

    def candidates(self, kind: str, *variant, n: int | None = None) -> list[TileConfig]:
        """The configs a launch of kernel `kind` may use; n: the rows its tuning key counts."""
        if interpreting():
            bm, bn = self.interpreter_blocks(kind)
            return [TileConfig(bm, bn, 4, 1)]
        if n is not None and n <= self.small_n and kind in self.small:
            return [self.small[kind]]
        configs = self.gpu.get((kind, *variant), self.default)
        if configs is None:
            raise KeyError(f"no tile configs for {(kind, *variant)}")
        return configs

    def interpreter_blocks(self, kind: str) -> tuple[int, int]:
        raw = setting(INTERPRET_BLOCKS_ENV) if self.env_blocks else None
        if raw is None:
            return self.interpreter[kind]
        bm, bn = (int(x) for x in raw.split(","))
        return (bn, bm) if kind in self.key_block_kinds else (bm, bn)


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' tl.dot input precision: IEEE products for fp32 inputs (no tf32, so tests against
    the float64 reference are meaningful); 16-bit inputs go to the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_config() -> TileConfig:
    """Tiles of the split-key (flash-decoding) forwards: 16 query rows (a decode step's few queries;
    the smallest tl.dot), key tiles of 64 (16 under the interpreter, so small tests still walk several).
    ATTNLAB_DECODE_TILES="BLOCK_N,warps,stages" sets the GPU's (for sweeps, scripts/bench/bench_decode.py)."""
    if interpreting():
        return TileConfig(16, 16, 4, 1)
    raw = setting(DECODE_TILES_ENV)
    if raw is None:
        return TileConfig(16, 64, 4, 2)
    fields = raw.split(",")
    if len(fields) != 3 or not all(f.strip().isdigit() and int(f) > 0 for f in fields):
        raise ValueError(f"{DECODE_TILES_ENV} must be three positive integers 'BLOCK_N,warps,stages', got {raw!r}")
    block_n, warps, stages = (int(f) for f in fields)
    return TileConfig(16, block_n, warps, stages)


def tuned_configs(kernels) -> dict[str, str]:
    """The configs tuning chose so far for `kernels`, readable (for benchmark reports)."""
    return {f"{kern.name} {key}": str(cfg) for kern in kernels for key, cfg in kern.tuned.items()}


def pinned_index() -> int | None:
    """The candidate every kernel runs without timing, or None (tune)."""
    raw = setting(CONFIG_ENV)
    if raw is not None:
        if not raw.isdigit():
            raise ValueError(f"{CONFIG_ENV} must be a non-negative integer (a candidate index), got {raw!r}")
        return int(raw)
    return 0 if autotune_pinned() else None


def traced(*tensors) -> bool:
    """Whether a call is being traced (torch.compile, export, fake or subclass tensors): traced calls
    run the families' launcher ops (their fakes trace); eager calls run the impls directly, without
    the dispatcher."""
    if torch.compiler.is_compiling():
        return True
    for t in tensors:  # a loop, not any(generator): this runs on every eager call
        if t is not None and type(t) is not torch.Tensor:
            return True
    return False


# The kernel launchers' torch ops (FlashAttention's layering): each a launcher with a fake
# implementation and no autograd of its own; AutogradOp's autograd.Function differentiates through
# them. Defined through torch.library's low-level API, so a call costs the dispatcher and one Python
# function (torch.library.custom_op adds Python layers that cost more than the launch itself).
KERNEL_LIBRARY = torch.library.Library("attnlab", "FRAGMENT")


def kernel_op(name: str):
    """Decorator: `fn` (annotated as torch.library.custom_op's functions are) becomes the CPU and CUDA
    kernel of the op attnlab::name, whose schema is inferred from the annotations; returns the op
    (register its fake with torch.library.register_fake(op, lib=KERNEL_LIBRARY))."""

    def register(fn):
        KERNEL_LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))
        for key in ("CPU", "CUDA"):
            KERNEL_LIBRARY.impl(name, fn, key)
        return getattr(torch.ops.attnlab, name).default

    return register


def direct_apply(function: type[torch.autograd.Function]) -> Callable:
    """`function.apply` without torch's Python layer over it where no functorch transform (vmap, grad, ...)
    is active: that layer binds setup_context's defaults (these Functions have none) and unwraps dead
    functorch wrappers, a generator step per argument (about 3 us a call at a dozen arguments, and the
    eager step makes a few per layer); under a transform or while torch.compile traces (which knows
    `function.apply`, not the layer below), `function.apply` itself."""
    c_apply = super(torch.autograd.Function, function).apply
    transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if transforms_active is None:  # a torch without that query: its public apply
        return function.apply

    def apply(*args):
        if torch.compiler.is_compiling() or transforms_active():
            return function.apply(*args)
        return c_apply(*args)

    return apply


class AutogradOp:
    """A family's differentiable fused attention: one autograd.Function named `name` whose forward runs
    the launcher op `op` when traced (torch.compile traces the Function, its op's fake and its
    backward's ops into one graph) and the op's impl `forward` otherwise (eager calls skip the
    dispatcher); both give the same numbers.

    forward(*args): the op's impl. setup_context(ctx, inputs, output): saves what backward needs.
    backward(ctx, grad_out, ops): one gradient per op input (trailing ones beyond the call's inputs are
    dropped), from the gradient of the first output, through the family's backward ops (ops=True,
    traced) or their impls (ops=False, eager). result(output): the public value of an output (default:
    the output itself).
    """

    def __init__(self, op, forward, setup_context, backward, name: str, result=None):
        self.op = op
        self.forward = forward
        self.result = result if result is not None else (lambda output: output)
        keep = self.result

        def function_forward(ctx, *args):
            output = op(*args) if traced(*(a for a in args if isinstance(a, torch.Tensor))) else forward(*args)
            setup_context(ctx, args, output)
            ctx.num_inputs = len(args)
            return keep(output)

        def function_backward(ctx, grad_out):
            return tuple(backward(ctx, grad_out, traced(grad_out)))[:ctx.num_inputs]

        self.function = type(name, (torch.autograd.Function,), {"forward": staticmethod(function_forward),
                                                                 "backward": staticmethod(function_backward)})
        self.apply = direct_apply(self.function)

    def __call__(self, args: tuple, watched: tuple):
        """The public result, differentiable in the tensors of `watched`: through the Function when a
        gradient may be asked for (or the call is traced), else the forward alone, without an autograd
        node (grad mode off, or no tensor of `watched` requires a gradient)."""
        if traced(*watched):
            return self.function.apply(*args)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in watched):
            return self.apply(*args)
        return self.result(self.forward(*args))

    def inference(self, args: tuple, watched: tuple):
        """The public result without an autograd node (forward-only calls)."""
        return self.result(self.op(*args) if traced(*watched) else self.forward(*args))


@functools.lru_cache(maxsize=None)
def _properties_of(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _properties(device: torch.device):
    """The CUDA device's properties (read once per device)."""
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


def decode_splits(q_len: int, kv_len: int, programs: int, block_n: int, device: torch.device) -> int:
    """Key ranges a forward of few queries (a decode step) splits its keys into, 1 for none.

    A forward program owns a block of query rows; with q_len <= DECODE_MAX_QUERIES there is one
    block per (batch, head), too few programs to fill the GPU while each walks the whole cache.
    Splitting the keys into S ranges runs S programs per block (their partial results merged
    after). S targets two programs per multiprocessor, each range holding at least
    DECODE_MIN_TILES_PER_SPLIT key tiles of block_n. `programs`: the unsplit grid's size.
    ATTNLAB_DECODE_SPLITS=S forces S (at most one range per key tile; 0 or 1: never split), for
    tests and sweeps; without it the interpreter never splits."""
    if q_len > DECODE_MAX_QUERIES:
        return 1
    tiles = -(-kv_len // block_n)
    raw = setting(DECODE_SPLITS_ENV)
    if raw is not None:
        if not raw.isdigit():
            raise ValueError(f"{DECODE_SPLITS_ENV} must be a non-negative integer (a number of key ranges), got {raw!r}")
        return max(1, min(int(raw), tiles))
    if interpreting() or device.type != "cuda":
        return 1
    wanted = -(-2 * _properties(device).multi_processor_count
               // max(programs, 1))
    return max(1, min(wanted, tiles // DECODE_MIN_TILES_PER_SPLIT, DECODE_MAX_SPLITS))


def tma_layout(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these (B, N, H, D) tensors: unit stride in D, the other
    strides and the base address multiples of 16 bytes."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def tma_kernels() -> frozenset[str]:
    """The kernels ATTNLAB_TMA asks to load through TMA descriptors: 0 (default) none, 1 all, or a comma
    list of TMA_KERNELS (per-kernel comparisons: the descriptors free registers in some kernels and
    cost instructions in others)."""
    raw = setting(TMA_ENV, "0")
    if raw == "0":
        return frozenset()
    if raw == "1":
        return frozenset(TMA_KERNELS)
    names = frozenset(name.strip() for name in raw.split(","))
    if not names <= set(TMA_KERNELS):
        raise ValueError(f"{TMA_ENV} must be 0, 1 or a comma list of {', '.join(TMA_KERNELS)}, got {raw!r}")
    return names


def use_tma(kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether `kernel` (one of TMA_KERNELS) loads these tensors' tiles through TMA descriptors: where
    ATTNLAB_TMA names it (opt-in: on an H200 it is no faster, docs/results/kernel_options_ab/) and the
    layout allows, on a GPU with TMA (compute capability 9+) or under the interpreter (tests), and
    only while configs are tuned: tuning skips the candidates Triton cannot compile with TMA (Triton 3.6's ptxas fails on
    some 2-stage query-block tiles), a pinned config cannot be skipped."""
    if kernel not in tma_kernels() or not tma_layout(*tensors):
        return False
    if interpreting():
        return True
    return tensors[0].is_cuda and _properties(tensors[0].device).major >= 9 and pinned_index() is None


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_scratch() -> None:
    """Kernels that build TMA descriptors on the device ask Triton's allocator (a context variable,
    so per thread: autograd's backward runs in its own) for scratch memory; give it torch's caching
    allocator where none is set, leaving one a user set alone."""
    import triton
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


# the settings every family's launch plans read (a family adds its own)
PLAN_SETTINGS = ("TRITON_INTERPRET", PIN_ENV, CONFIG_ENV, INTERPRET_BLOCKS_ENV, DECODE_SPLITS_ENV, DECODE_TILES_ENV,
                 TMA_ENV)
_ALL_PLANS: list["LaunchPlans"] = []


class LaunchPlans:
    """One kernel entry's launch plans: a plan is what a call's launches need that follows from the
    call's signature alone (shapes, strides, dtypes, the device, flags, scalars, the launch settings
    named in `settings`): tile-config candidates, tuning keys, kernel scalars and meta-parameters.
    `build(*args)` makes one at a signature's first call; later calls with that signature reuse it
    and only allocate outputs and launch (at training shapes a call's host work rivals its GPU time).
    The settings' values are part of the key, so changing one takes effect at the next call."""

    def __init__(self, build: Callable, settings: tuple[str, ...] = PLAN_SETTINGS):
        self.build = build
        self.settings = settings
        self.plans: dict[tuple, object] = {}
        _ALL_PLANS.append(self)

    def get(self, signature: tuple, *args):
        key = (signature, settings_values(self.settings))
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) > 1024:  # shapes that keep changing (evaluation sweeps): start over
                self.plans.clear()
            plan = self.plans[key] = self.build(*args)
        return plan


def clear_launch_plans() -> None:
    """Forget every plan (tests that patch the module state plans are built from call it)."""
    for plans in _ALL_PLANS:
        plans.plans.clear()


def contiguous_strides(shape: tuple) -> tuple:
    """The strides torch.empty(shape) gives."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tma_alignment(*tensors: torch.Tensor) -> tuple | None:
    """What TMA decisions read from tensors beyond their signature (base addresses' 16-byte alignment),
    for plan signatures; None while ATTNLAB_TMA asks for no TMA kernel (the default)."""
    if setting(TMA_ENV, "0") == "0":
        return None
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def _direct_launches() -> bool:
    return setting(DIRECT_ENV, "1") != "0"


def median_ms(fn: Callable[[], object]) -> float:
    """Median ms of fn() as tuning times a candidate: as long as Triton's own autotuner (25 ms warm-up,
    100 ms timed), which candidates a few percent apart need to be told apart."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


class DirectLauncher:
    """Launches of one @triton.jit or @gluon.jit kernel (both tiers' kernels launch through one): the first
    launch of a specialization goes through Triton's JIT (compiling if needed) and remembers what its
    compiled launcher takes; later launches of that specialization call the launcher directly with the
    arguments the JIT would pass, skipping its argument binding and cache-key work.

    `run(grid, descriptors, tensors, scalars, constexprs, options)` launches
    fn[grid](*descriptors, *tensors, *scalars, **constexprs, **options): the kernel's parameters are its
    TMA descriptors (Gluon's `TensorDescriptor`, which Triton's launcher turns into CUtensorMaps itself),
    its tensors, its scalars (ints, floats), then constexprs (given by name, or their defaults). The
    keyword arguments come as two dicts, constexprs and options (Triton's num_warps, num_stages, and
    any constexprs a caller keeps beside them, as a TileConfig's tiles), so that callers pass dicts they
    keep rather than build one per launch; neither is changed. ATTNLAB_DIRECT_LAUNCH=0 sends every
    launch through the JIT; so does the interpreter, and a Triton whose compiled kernels lack the
    fields a direct launch reads."""

    def __init__(self, fn, name: str):
        self.fn = fn
        self.name = name
        self._compiled: dict[tuple, tuple] = {}  # specialization -> (launcher, function, metadata, constexprs, hooks)
        self._no_direct = False  # this Triton's compiled kernels lack the fields a direct launch needs

    def run(self, grid: tuple, descriptors: tuple, tensors: tuple, scalars: tuple, constexprs: dict,
            options: dict) -> None:
        if self._no_direct or interpreting() or not _direct_launches():
            self.fn[grid](*descriptors, *tensors, *scalars, **constexprs, **options)
            return
        device = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its lazy-init check
        # what Triton compiles a launch for, at least as finely as Triton's own key: the device; scalars by
        # value and type (Triton specializes integers on their value being 1, their 16-divisibility and
        # width, and types ints, floats and bools apart, which values alone would equate: 1 == 1.0 == True);
        # the keyword arguments by name and value; tensors by dtype and 16-byte alignment of their address;
        # TMA descriptors by their base's dtype, block shape and shared-memory layout (Triton's type
        # `tensordesc<dtype[block],layout>`; their address, shape and strides are launch arguments). One
        # flat tuple (the parts are told apart by their types: names are str, tensors' dtypes torch.dtype)
        key = (device, scalars, *map(type, scalars), *constexprs.items(), *options.items(),
               *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors],
               *([(d.base.dtype, tuple(d.block_shape), d.layout) for d in descriptors] if descriptors else ()))
        entry = self._compiled.get(key)
        if entry is None:
            self._first_launch(key, grid, descriptors, tensors, scalars, constexprs, options)
            return
        launcher, function, metadata, trailing, hooks = entry
        stream = torch._C._cuda_getCurrentRawStream(device)
        args = (*descriptors, *tensors, *scalars, *trailing)
        grid = (*grid, 1, 1)
        if hooks is None:
            launcher(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args)
        else:
            launcher(grid[0], grid[1], grid[2], stream, function, metadata, hooks.launch_metadata(args, grid, stream),
                     hooks.enter, hooks.exit, *args)

    def _first_launch(self, key, grid, descriptors, tensors, scalars, constexprs, options) -> None:
        """Launch through Triton's JIT (compiling if needed) and remember what a direct launch needs: the
        compiled launcher, and the values the JIT passes after the positional arguments (the constexprs in
        the kernel's parameter order, defaults included; the launcher skips them by its signature)."""
        positional = (*descriptors, *tensors, *scalars)
        compiled = self.fn.run(*positional, grid=grid, warmup=False, **constexprs, **options)
        try:
            from triton import knobs

            given = {**constexprs, **options}
            trailing = tuple(given[name] if name in given else self._default(name)
                             for name in self.fn.arg_names[len(positional):])
            entry = (compiled.run, compiled.function, compiled.packed_metadata, trailing, _hooks(compiled, knobs))
        except (ImportError, AttributeError, KeyError):  # another Triton's internals: keep the JIT path
            self._no_direct = True
            return
        if len(self._compiled) > 1024:  # shapes that keep changing (evaluation sweeps): start over
            self._compiled.clear()
        self._compiled[key] = entry

    def _default(self, name: str):
        """The default of parameter `name`; KeyError where it has none (the call left it out)."""
        param = self.fn.params[self.fn.arg_names.index(name)]
        if not param.has_default:
            raise KeyError(name)
        return param.default


class Kernel:
    """A @triton.jit kernel whose parameters are its tensors, then its scalars, then its constexprs
    (`meta`, then the config's BLOCK_M / BLOCK_N): `launch(grid, tensors, scalars, meta, ...)`, started
    through a `DirectLauncher`."""

    def __init__(self, fn, name: str):
        self.fn = fn
        self.name = name
        self.tuned: dict[tuple, TileConfig] = {}  # tuning key -> chosen config
        self.timings: dict[tuple, dict[TileConfig, float]] = {}  # tuning key -> ms per candidate
        self.launcher = DirectLauncher(fn, name)

    def launch(self, grid: Callable[[TileConfig], tuple], tensors: tuple, scalars: tuple, meta: dict,
               configs: list[TileConfig], tune_key: tuple) -> TileConfig:
        """Run the kernel with the config chosen for `tune_key` among `configs` (the first is the
        pinned default); grid maps a config to the launch grid. Returns the config used."""
        cfg = self.choose(grid, tensors, scalars, meta, configs, tune_key)
        self.run(cfg, grid(cfg), tensors, scalars, meta)
        return cfg

    def tunes(self, configs, tune_key) -> bool:
        """Whether a launch with these candidates and key would tune first (running the kernel once per
        candidate and timing: fine for kernels that only write their outputs, not for accumulating ones)."""
        return len(configs) > 1 and not interpreting() and pinned_index() is None and tune_key not in self.tuned

    def choose(self, grid, tensors, scalars, meta, configs, tune_key) -> TileConfig:
        if len(configs) == 1 or interpreting():
            return configs[0]
        pin = pinned_index()
        if pin is not None:
            return configs[pin % len(configs)]
        cfg = self.tuned.get(tune_key)
        if cfg is None:
            cfg = self.tuned[tune_key] = self._tune(grid, tensors, scalars, meta, configs, tune_key)
        return cfg

    def _tune(self, grid, tensors, scalars, meta, configs, tune_key) -> TileConfig:
        """Time every candidate on the call's own arguments (kernels that only write their outputs
        may run any number of times), as long as Triton's own autotuner does (25 ms warm-up, 100 ms
        timed: candidates a few percent apart need that to be told apart); a candidate that does not
        fit the GPU or that the compiler fails on is skipped (as Triton's autotuner does)."""
        from triton.runtime.errors import OutOfResources, PTXASError

        times = {}
        for cfg in configs:
            try:
                self.run(cfg, grid(cfg), tensors, scalars, meta)  # compiles outside the timing
            except (OutOfResources, PTXASError):
                continue
            times[cfg] = median_ms(lambda: self.run(cfg, grid(cfg), tensors, scalars, meta))
        if not times:
            raise RuntimeError(f"{self.name}: no tile config fits this GPU for {tune_key}: {[str(c) for c in configs]}")
        self.timings[tune_key] = times
        return min(times, key=times.get)

    def run(self, cfg: TileConfig, grid: tuple, tensors: tuple, scalars: tuple, meta: dict) -> None:
        self.launcher.run(grid, (), tensors, scalars, meta, cfg.launch_options)


def _hooks(compiled, knobs):
    """Triton's launch hooks as its JIT passes them (profilers such as proton read them), or None
    while none is registered (read at a specialization's first launch)."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if all(h is None or getattr(h, "calls", None) == [] for h in (enter, exit_)):
        return None
    return _Hooks(compiled, knobs)


class _Hooks:
    def __init__(self, compiled, knobs):
        self.compiled = compiled
        self.knobs = knobs

    @property
    def enter(self):
        return self.knobs.runtime.launch_enter_hook

    @property
    def exit(self):
        return self.knobs.runtime.launch_exit_hook

    def launch_metadata(self, args, grid, stream):
        return self.compiled.launch_metadata(grid, stream, *args)
