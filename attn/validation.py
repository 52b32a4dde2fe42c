"""Input checks of the public attention API: every error names the argument and what is allowed."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from attn.families import family_of
from attn.families.base import check_tensor
from attn.dropout import check_dropout_p
from attn.masks import SegmentMask, segment_bounds, validate_segment_ids

KERNEL_HEAD_DIMS = (16, 32, 64, 128)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attention_inputs(q, k, v, spec, *, window, segment_ids, temperature, extra) -> None:
    """The host-side checks of `attn.attention`'s inputs: types, shapes, dtypes, devices, the spec's
    own (no device sync; segment ids' values are `attn.masks.segment_mask_of`'s, once per tensor)."""
    if not isinstance(q, torch.Tensor) or q.ndim != 4:
        raise ValueError(f"q must be a (B, N, H, D) tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q.dtype must be one of {FLOAT_DTYPES}, got {q.dtype}")
    b, n, h, d = q.shape
    if n < 1 or d < 1 or h < 1 or b < 1:
        raise ValueError(f"q must have B, N, H, D >= 1 (at least one query of a head dim >= 1), got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 4, q.dtype, q.device)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[1] < n or k.shape[3] != d:
        raise ValueError(f"k must have shape (B, KV, H_kv, D) = ({b}, KV >= {n}, H_kv, {d}), got {tuple(k.shape)}")
    if segment_ids is not None and k.shape[1] != n:
        raise ValueError(f"segment_ids need queries and keys of one length, got {n} queries and {k.shape[1]} keys")
    if k.shape[2] < 1 or h % k.shape[2] != 0:
        raise ValueError(f"the number of query heads ({h}) must be divisible by k's heads H_kv ({k.shape[2]})")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    family_of(spec).validate(spec, q, k, temperature=temperature, extra=extra)


def check_kernel_inputs(q, k=None, *, kernels: str = "backend='triton'") -> None:
    """Limits of the fused kernels of every family (the reference takes anything): head dim and
    dtype, and with k, at least as many keys as queries. `kernels` names them in the message."""
    d = q.shape[-1]
    if d not in KERNEL_HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {KERNEL_HEAD_DIMS} for {kernels}, got {d}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q.dtype must be float16, bfloat16 or float32 for {kernels}, got {q.dtype}")
    if k is not None and k.shape[1] < q.shape[1]:
        raise ValueError(f"k must hold at least as many keys as q has queries (KV >= N), got {k.shape[1]} keys "
                         f"for {q.shape[1]} queries")


def kernel_segment_bounds(q, k, segment_ids=None, bounds=None):
    """The per-row segment bounds a fused-kernel call uses: `bounds`, else `segment_bounds(segment_ids)`,
    else None; segment ids need queries and keys of one length."""
    if (bounds is not None or segment_ids is not None) and k.shape[1] != q.shape[1]:
        raise ValueError(f"segment_ids need queries and keys of one length, got {q.shape[1]} queries and "
                         f"{k.shape[1]} keys")
    if bounds is None and segment_ids is not None:
        bounds = segment_bounds(segment_ids)
    return bounds


def check_key_lengths(key_lengths, q, k, *, segment_ids=None, bounds=None, dropout_p: float = 0.0,
                      tensors=()) -> None:
    """The call-level checks of a `key_lengths` call (no device sync, so capturable): a (B,) int32
    tensor on q's device, forward only (nothing in `tensors` may require grad while grad mode is
    on), no segment ids, no dropout. Its values are checked by `check_key_length_values`."""
    if not isinstance(key_lengths, torch.Tensor):
        raise ValueError(f"key_lengths must be a (B,) int32 tensor, got {type(key_lengths).__name__}")
    b = q.shape[0]
    if key_lengths.dtype != torch.int32 or tuple(key_lengths.shape) != (b,):
        raise ValueError(f"key_lengths must be a (B,) = ({b},) int32 tensor, got shape {tuple(key_lengths.shape)} "
                         f"dtype {key_lengths.dtype}")
    if key_lengths.device != q.device:
        raise ValueError(f"key_lengths must be on the device of q ({q.device}), got {key_lengths.device}")
    if segment_ids is not None or bounds is not None:
        raise ValueError("key_lengths cannot be combined with segment_ids (per-row key lengths serve a KV cache)")
    if dropout_p > 0.0:
        raise ValueError(f"key_lengths is for inference: dropout_p must be 0, got {dropout_p}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, *tensors)):
        raise ValueError("key_lengths is forward-only (inference): no input may require grad "
                         "(run under torch.no_grad() or detach the inputs)")


def check_key_length_values(key_lengths: torch.Tensor, kv_len: int) -> None:
    """0 <= key_lengths <= KV. Syncs with the device: `check_inputs` runs it; calls do not (every
    backend clamps the values to [0, KV])."""
    if bool(((key_lengths < 0) | (key_lengths > kv_len)).any()):
        raise ValueError(f"key_lengths values must lie in [0, KV] = [0, {kv_len}], got values from "
                         f"{int(key_lengths.min())} to {int(key_lengths.max())}")


def check_inputs(q, k, v, spec, *, causal: bool = True, window: int | None = None, segment_ids=None,
                 temperature=None, extra=None, dropout_p: float = 0.0, key_lengths=None) -> None:
    """Every check of `attn.attention`'s inputs, the values of its index tensors included: what a call
    checks on the host, plus the segment ids' values and contiguity and key_lengths in [0, KV].

    Reads tensor values, so it syncs with the device once or twice: call it where that is fine (a
    data pipeline's first batch, a test, a debugging session). `attn.attention` itself checks segment
    ids once per tensor and never key_lengths' values (every backend clamps them to [0, KV])."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    check_attention_inputs(q, k, v, spec, window=window, segment_ids=segment_ids, temperature=temperature,
                           extra=extra)
    dropout_p = check_dropout_p(dropout_p)
    if segment_ids is not None:
        ids = segment_ids.segment_ids if isinstance(segment_ids, SegmentMask) else segment_ids
        validate_segment_ids(ids, q.shape[0], q.shape[1])
    if key_lengths is not None:
        check_key_lengths(key_lengths, q, k, segment_ids=segment_ids, dropout_p=dropout_p,
                          tensors=(v, temperature, *(extra.values() if isinstance(extra, Mapping) else ())))
        check_key_length_values(key_lengths, k.shape[1])
