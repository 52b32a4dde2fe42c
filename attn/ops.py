"""Public attention entry point and backend selection (DESIGN.md §5).

The fused kernels register their own torch custom ops (with fakes and autograd) in
`attn/kernels/`; this module only validates, chooses a backend and dispatches, so the
reference path never imports Triton.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from attn.dropout import check_dropout_p, draw_seed, seed_tensor
from attn.families import FAMILIES, family_of
from attn.kernels.env import PIN_ENV, interpreting
from attn.masks import MaskSpec, SegmentMask, segment_mask_of
from attn.reference import reference_attention
from attn.registry import family_kernel
from attn.validation import check_attention_inputs, check_kernel_inputs, check_key_lengths

log = logging.getLogger(__name__)
# sdpa: torch's scaled_dot_product_attention, plain softmax only (the speed yardstick)
BACKENDS = ("auto", "triton", "reference", "sdpa")
_announced: set[tuple[str, str]] = set()


def pin_kernel_configs(pinned: bool) -> None:
    """Run every fused kernel with its first (fixed) tile config instead of autotuning by timing.

    Autotuning can pick different tile sizes in two processes, and a different tile changes the
    fp32 summation order; pinned, the kernels (which use no atomics) are bitwise reproducible
    across runs. Takes effect for (kernel, shape key) pairs not yet tuned in this process.
    """
    if pinned:
        os.environ[PIN_ENV] = "0"
    else:
        os.environ.pop(PIN_ENV, None)


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""
    if device.type != "cuda" and not interpreting():
        return False
    return _TRITON_INSTALLED


# looked up once, without importing it (the reference path never imports Triton)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


_MASK_SPECS: dict[tuple, MaskSpec] = {}


def mask_spec(causal: bool, window) -> MaskSpec:
    """MaskSpec(causal, window), built once per distinct pair (its checks run on the first); traced
    calls build it (a cache that a trace reads and fills would be guarded on, and recompile)."""
    if torch.compiler.is_compiling():
        return MaskSpec(causal=causal, window=window)
    key = (causal, window, type(window))
    mask = _MASK_SPECS.get(key)
    if mask is None:
        mask = _MASK_SPECS[key] = MaskSpec(causal=causal, window=window)
    return mask


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attn.backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_usable(device) else "reference"
        key = (str(device), backend)
        if key not in _announced and not torch.compiler.is_compiling():
            _announced.add(key)
            log.info("attention backend=auto on %s -> %s", device, backend)
    elif backend == "triton" and not triton_usable(device):
        raise ValueError(
            f"backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU); inputs are on {device}"
        )
    return backend


def preload_kernel(spec, backend: str) -> None:
    """Import the fused kernel module that `backend` may dispatch `spec` to, now: torch.compile
    cannot trace an import. This module already loads every family's kernels at import where
    Triton can run (CUDA, or TRITON_INTERPRET=1); this covers a later switch to the interpreter."""
    if backend == "triton" or (backend == "auto" and torch.cuda.is_available()):
        if triton_usable(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
            family_kernel(spec)


def _load_kernels_where_they_run() -> None:
    """So that `torch.compile(fullgraph=True)` of a function calling `attention` works on its first
    call: the kernel modules (and their custom ops) exist before any trace reaches them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if triton_usable(device):
        for family in FAMILIES.values():
            family.kernel()


def sdpa_attention(q, k, v, spec, mask: MaskSpec, segment_ids, temperature, dropout_p: float = 0.0) -> torch.Tensor:
    """Plain softmax through torch SDPA (flash / cuDNN kernels): causal only, no caps; its dropout
    draws from torch's generator."""
    if not family_of(spec).serves_sdpa(spec):
        raise ValueError("backend='sdpa' serves only attn=softmax (no cap); use 'triton' or 'reference'")
    if temperature is not None or segment_ids is not None or mask.window is not None:
        raise ValueError("backend='sdpa' supports causal or full masks only (no window, segment_ids, temperature)")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=mask.is_causal,
        scale=spec.scale(q.shape[-1]), enable_gqa=bool(q.shape[2] != k.shape[2]), dropout_p=dropout_p,
    )
    return out.transpose(1, 2)


def extra_values(extra) -> tuple:
    """The tensors of an `extra` mapping (none for None or a non-mapping, which the family's
    `checked_extra` then refuses by name)."""
    return tuple(extra.values()) if isinstance(extra, Mapping) else ()



def reference_backend(q, k, v, spec, mask, segment_ids, temperature, *, extra, **options) -> torch.Tensor:
    """The PyTorch reference as the backend of a call. A float16 call computes in float32 and returns
    float16, as the kernels accumulate in float32: a float16 score q.k overflows past 65504 (|q| and |k|
    of 100 per element at D = 16 reach 160000), and the softmax of infinite scores is NaN. `reference_attention` itself computes in
    the inputs' dtype: it is the tolerance rule's same-dtype yardstick (DESIGN.md section 6)."""
    if q.dtype != torch.float16:
        return reference_attention(q, k, v, spec, mask, segment_ids, temperature, extra=extra, **options)

    def wide(t):
        return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    wide_extra = None if extra is None else {name: wide(t) for name, t in extra.items()}
    out = reference_attention(wide(q), wide(k), wide(v), spec, mask, segment_ids, wide(temperature), extra=wide_extra,
                              **options)
    return out.to(torch.float16)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
    backend: str = "auto",
    dropout_p: float = 0.0,
    dropout_seed: int | torch.Tensor | None = None,
    key_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of any registered variant: q (B,N,H,D), k/v (B,KV,H_kv,D) -> (B,N,H,D).

    KV >= N keys: a query block against a longer key sequence (a decode step against a KV cache),
    aligned to the bottom-right corner (query i at position i + KV - N, attn/masks.py), on the
    fused kernels with backend='triton' (a few queries against many keys take their split-key
    decode path) and on the reference; backend='sdpa' needs KV == N; backend='auto' picks as for
    KV == N (the kernels where Triton runs).

    `spec` is the variant's frozen config (`attn.get_variant(name).make_spec(...)`).
    Softmax family: optional per-query `temperature` (B, N). `extra`: the family's extra per-call
    tensors, a mapping whose keys are exactly `attn.family_of(spec).extra_inputs(spec)` (None or
    empty where it names none; the differential threshold's are the second view 'q2' (B,N,H,D),
    'k2' (B,KV,H_kv,D) and the per-head lambda 'lam' (H,)).

    `segment_ids`: (B, N) ids (1 history, -1 candidate, 0 padding), or the `attn.segments(ids)` mask
    built once for every call of a batch (FlexAttention's BlockMask habit: the calls then do no mask
    work at all). A call never waits for the device: shapes, dtypes and devices are checked on the
    host; the values of an ids tensor are checked the first time a call sees that tensor (one sync,
    then remembered while the tensor is unchanged), never inside compiled code or a CUDA-graph capture
    (there the bounds come from the buffer's values by device ops, so a captured call follows new ids
    written into it). `attn.check_inputs` runs every value check explicitly.

    `dropout_p` in [0, 1) drops attention weights (attn/dropout.py), whatever the module's mode:
    pass 0 at evaluation. `dropout_seed` (int or one-element integer tensor) fixes the mask: the
    kernels' mask is a function of it (`attn.kernels.dropout.keep_mask`), the reference's is drawn
    from a torch generator seeded with it; None draws from torch's generator.

    `key_lengths` (B,) int32 (flash-attn's `cache_seqlens` / `seqused_k`): k / v are a static KV
    cache of KV slots of which row b has filled the first key_lengths[b]; only keys
    [0, key_lengths[b]) exist for row b, and query i sits at key position key_lengths[b] - N + i
    (bottom-right alignment against the filled length), so causal / window masks and the threshold
    family's n_i count filled keys only; the slots beyond are never read into the output. A row
    with key_lengths[b] < N puts its first queries at negative positions: under a causal or window
    mask they see no key and output 0, under the full mask every query sees the filled keys.
    Forward only (inference): a ValueError if an input requires grad (with grad mode on), with
    segment_ids or with dropout_p > 0. Values outside [0, KV] are clamped to it by every backend
    (`attn.check_inputs` refuses them; a call does not read them, since that would wait for the
    device). The fused kernels read the lengths on the device, so their launches do not depend on
    the values (a call can be captured in a CUDA graph and replayed as the cache fills);
    backend='sdpa' sends these calls to the reference.
    """
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    check_attention_inputs(q, k, v, spec, window=window, segment_ids=segment_ids, temperature=temperature,
                           extra=extra)
    dropout_p = check_dropout_p(dropout_p)
    mask = mask_spec(causal, window)
    segments = segment_mask_of(segment_ids, q.shape[0], q.shape[1], q.device)
    segment_ids = segments.segment_ids if segments is not None else None
    if key_lengths is not None:
        check_key_lengths(key_lengths, q, k, segment_ids=segment_ids, dropout_p=dropout_p,
                          tensors=(v, temperature, *extra_values(extra)))
        backend = longer_keys_backend(backend)
    elif k.shape[1] != q.shape[1]:
        if backend == "sdpa":
            raise ValueError(f"backend='sdpa' needs queries and keys of one length; {q.shape[1]} queries against "
                             f"{k.shape[1]} keys run on backend='triton', 'reference' or 'auto'")
        backend = longer_keys_backend(backend)
    backend = resolve_backend(backend, q.device)
    if backend == "reference":
        return reference_backend(q, k, v, spec, mask, segment_ids, temperature, extra=extra,
                                 dropout_p=dropout_p, dropout_seed=dropout_seed, key_lengths=key_lengths)
    if backend == "sdpa":
        if dropout_seed is not None:
            raise ValueError("backend='sdpa' draws its dropout mask from torch's generator; dropout_seed must be None")
        return sdpa_attention(q, k, v, spec, mask, segment_ids, temperature, dropout_p)
    check_kernel_inputs(q)
    if q.device.type != "cuda" and q.dtype == torch.bfloat16:
        raise ValueError("q.dtype bfloat16 cannot run on the Triton interpreter (TRITON_INTERPRET=1 on CPU computes it "
                         "wrongly): use float16 or float32 there, backend='reference', or a CUDA device")
    seed = None
    if dropout_p > 0.0:
        seed = draw_seed(q.device) if dropout_seed is None else seed_tensor(dropout_seed, q.device)
    return family_kernel(spec)(q, k, v, spec, mask, None, temperature, extra=extra,
                               bounds=segments.bounds if segments is not None else None,
                               dropout_p=dropout_p, dropout_seed=seed, key_lengths=key_lengths)


def longer_keys_backend(backend: str) -> str:
    """The backend for queries against more keys than queries (KV > N): the chosen one, except that
    SDPA's causal mask aligns top-left, so 'sdpa' calls go to the reference. The fused kernels
    match the float64 reference on these calls under the interpreter and natively on a GPU (bf16
    too; tests/test_kernels_longer_keys.py)."""
    return "reference" if backend == "sdpa" else backend


class AttentionCall:
    """The attention of one module, resolved once: the model's fast path.

    The spec, mask and backend are checked at construction; a call does no input validation (the
    backend choice is a string comparison or two), and takes the batch's `bounds`
    (`attn.segment_bounds(segment_ids)`, computed once per batch instead of once per layer), or
    `segment_ids=attn.segments(ids)`, which carries both. The caller owns what the public `attention`
    checks per call: tensor shapes and dtypes (the model's own projections) and segment ids
    (`attn.segments` checks them once per batch). `dropout_p` (checked by the caller, e.g. the model's
    config check) drops attention weights; the kernels' seed is drawn per call from torch's generator.
    k / v may hold more positions than q (a decode step, bottom-right aligned): the backend for
    those calls is `longer_keys_backend`'s. `key_lengths` (B,) int32: per-row filled lengths of a
    static KV cache, as in `attention` (forward only; values are not checked, the backends clamp
    them to [0, KV]); its calls also take `longer_keys_backend`'s backend. `extra` is the family's
    mapping of extra per-call tensors, as in `attention` (its keys are checked: a few dict lookups).
    """

    def __init__(self, spec, *, causal: bool = True, window: int | None = None, backend: str = "auto"):
        family_of(spec)  # a ValueError for anything but a family's spec
        if backend not in BACKENDS:
            raise ValueError(f"attn.backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, got {causal!r}")
        self.spec, self.backend = spec, backend
        self.mask = MaskSpec(causal=causal, window=window)
        preload_kernel(spec, backend)

    def __call__(self, q, k, v, *, segment_ids=None, bounds=None, temperature=None, extra=None,
                 dropout_p: float = 0.0, key_lengths=None):
        if isinstance(segment_ids, SegmentMask):
            segment_ids, bounds = segment_ids.segment_ids, segment_ids.bounds
        # resolved per call, no state: a cache filled during a trace would make torch.compile recompile
        if k.shape[1] == q.shape[1] and key_lengths is None:
            backend = self.backend
        else:
            backend = longer_keys_backend(self.backend)
        backend = resolve_backend(backend, q.device)
        if key_lengths is not None:
            check_key_lengths(key_lengths, q, k, segment_ids=segment_ids, bounds=bounds, dropout_p=dropout_p,
                              tensors=(v, temperature, *extra_values(extra)))
        if backend == "triton":
            kernel = family_kernel(self.spec)
            seed = draw_seed(q.device) if dropout_p > 0.0 else None
            return kernel(q, k, v, self.spec, self.mask, segment_ids, temperature, extra=extra, bounds=bounds,
                          dropout_p=dropout_p, dropout_seed=seed, key_lengths=key_lengths)
        if backend == "reference":
            return reference_backend(q, k, v, self.spec, self.mask, segment_ids, temperature, extra=extra,
                                     dropout_p=dropout_p, key_lengths=key_lengths)
        family_of(self.spec).checked_extra(self.spec, extra)
        return sdpa_attention(q, k, v, self.spec, self.mask, segment_ids, temperature, dropout_p)


_load_kernels_where_they_run()
