"""Mask semantics shared by every variant and backend (DESIGN.md §3).

A key j is visible to query i when every enabled rule allows it:
  causal: j <= i;  window W: i - W < j <= i;  segment ids (ranker layout, per row
  one contiguous history range and one contiguous candidate range, the rest padding):
  history queries see history keys, candidate queries see history keys and
  themselves, padding sees and is seen by nothing.

The kernels never read segment ids; they read per-row bounds (B, 4) int32 =
[history_start, history_end, candidate_start, candidate_end) computed here once.

Queries and keys of different lengths (Q <= KV, a decode step against a KV cache) align to the
bottom-right corner: query i sits at position i + KV - Q, so the last query sees every key under
the causal mask (FlashAttention's convention). Segment ids need Q == KV.

Per-row key lengths (`key_lengths` (B,), flash-attn's `cache_seqlens`: a static KV cache of KV
slots of which row b has filled L_b): only keys [0, L_b) exist for row b, and query i sits at
position L_b - Q + i, so causal / window masks and n_i count only filled keys. A row with
L_b < Q places its first queries at negative positions: under a causal or window mask those see
no key (output 0); under the full mask every query sees the L_b keys.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

HISTORY, CANDIDATE, PADDING = 1, -1, 0


@dataclass(frozen=True)
class MaskSpec:
    """Static part of a mask (hashable, part of kernel specialization)."""

    causal: bool = True
    window: int | None = None

    def __post_init__(self):
        if self.window is not None:
            if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
                raise ValueError(f"window must be a positive int or None, got {self.window!r}")

    @property
    def is_causal(self) -> bool:
        # a window implies causality
        return self.causal or self.window is not None

    @property
    def kind(self) -> str:
        return "window" if self.window is not None else ("causal" if self.causal else "full")


def _range_of(is_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[start, end) of the True entries per row; (0, 0) for rows without any."""
    n = is_value.shape[-1]
    pos = torch.arange(n, device=is_value.device, dtype=torch.int32)
    big = torch.full_like(pos, n)
    start = torch.where(is_value, pos, big).amin(dim=-1)
    end = torch.where(is_value, pos + 1, torch.zeros_like(pos)).amax(dim=-1)
    start = torch.where(end > 0, start, torch.zeros_like(start))
    return start, end


def segment_bounds(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, N) valid ids (`validate_segment_ids`: contiguous ranges) -> (B, 4) int32
    [hist_start, hist_end, cand_start, cand_end); (0, 0) for a kind a row lacks.

    Start = first index (argmax of the indicator), end = start + count: few device ops, since
    this runs on every kernel call and its host-side launch cost showed in small problems."""
    member = torch.stack([segment_ids == HISTORY, segment_ids == CANDIDATE], dim=1).to(torch.int32)  # (B, 2, N)
    count = member.sum(dim=-1)
    start = member.argmax(dim=-1)  # the first maximum: 0 for a row without that kind, with count 0
    return torch.stack([start, start + count], dim=-1).reshape(-1, 4).to(torch.int32)


def check_segment_ids_layout(segment_ids, batch: int, seq_len: int, device: torch.device | None = None) -> None:
    """The host-side checks of segment ids (no device sync): a signed integer (B, N) tensor, on
    `device` when given."""
    if not isinstance(segment_ids, torch.Tensor):
        raise ValueError(f"segment_ids must be a (B, N) integer tensor or an attn.SegmentMask, "
                         f"got {type(segment_ids).__name__}")
    if segment_ids.shape != (batch, seq_len):
        raise ValueError(
            f"segment_ids must have shape (B, N) = ({batch}, {seq_len}), got {tuple(segment_ids.shape)}"
        )
    if segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool or not segment_ids.dtype.is_signed:
        # unsigned ids cannot hold -1 (candidate): uint8's 255 would compare equal to it
        raise ValueError(f"segment_ids must be an integer tensor, signed (values 1, -1, 0), got dtype {segment_ids.dtype}")
    if device is not None and segment_ids.device != device:
        raise ValueError(f"segment_ids must be on the device of q ({device}), got {segment_ids.device}")


def validate_segment_ids(segment_ids: torch.Tensor, batch: int, seq_len: int) -> None:
    """Shape, values and contiguity checks. One device sync (every value check is read in one
    transfer): call in eager mode, outside CUDA-graph captures."""
    check_segment_ids_layout(segment_ids, batch, seq_len)
    bad = ~((segment_ids == HISTORY) | (segment_ids == CANDIDATE) | (segment_ids == PADDING))
    member = torch.stack([segment_ids == HISTORY, segment_ids == CANDIDATE], dim=1)  # (B, 2, N)
    start, end = _range_of(member)  # first and last position, whatever lies between
    split = (member.sum(dim=-1) != (end - start)).any(dim=0)  # (2,): a kind with a gap in some row
    bad_value, history_split, candidate_split = torch.cat([bad.any().reshape(1), split]).tolist()
    if bad_value:
        raise ValueError("segment_ids values must be in {1 (history), -1 (candidate), 0 (padding)}")
    for name, is_split in (("history (1)", history_split), ("candidate (-1)", candidate_split)):
        if is_split:
            raise ValueError(f"segment_ids: the {name} positions must form one contiguous range per row")


class SegmentMask(NamedTuple):
    """Segment ids with their kernel bounds, built once (`segments`) and passed as `segment_ids=` to
    every `attn.attention` / `AttentionCall` call of a batch, as FlexAttention's BlockMask is: the
    calls then neither check the ids nor compute bounds. segment_ids (B, N) as given; bounds (B, 4)
    int32 (`segment_bounds`)."""

    segment_ids: torch.Tensor
    bounds: torch.Tensor


def segments(segment_ids: torch.Tensor, *, check: bool = True) -> SegmentMask:
    """The reusable ranker mask of a batch's segment ids (B, N): values 1 (history), -1
    (candidate), 0 (padding), each kind one contiguous range per row.

    check=True validates the values (one device sync, here and never in the calls that use the
    mask); check=False skips that (inside a CUDA-graph capture or compiled code, or for ids known
    to be valid): the bounds are then computed by device ops only, so a mask built inside a capture
    follows new ids written into the same buffer at replay."""
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.ndim != 2:
        got = tuple(segment_ids.shape) if isinstance(segment_ids, torch.Tensor) else type(segment_ids).__name__
        raise ValueError(f"segment_ids must be a (B, N) integer tensor, got {got}")
    if check:
        validate_segment_ids(segment_ids, *segment_ids.shape)
    else:
        check_segment_ids_layout(segment_ids, *segment_ids.shape)
    return SegmentMask(segment_ids, segment_bounds(segment_ids))


class _CheckedSegmentIds:
    """Bounds of the segment-id tensors calls have seen, validated once per tensor: keyed by the
    tensor's identity, valid while it is alive and unchanged (its version counter counts in-place
    writes). A few entries: a model's layers and a benchmark's repeats reuse one tensor."""

    MAX_ENTRIES = 16

    def __init__(self):
        self._seen: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def bounds(self, segment_ids: torch.Tensor) -> torch.Tensor:
        entry = self._seen.get(id(segment_ids))
        if entry is not None and entry[0]() is segment_ids and entry[1] == segment_ids._version:
            return entry[2]
        validate_segment_ids(segment_ids, *segment_ids.shape)
        bounds = segment_bounds(segment_ids)
        if len(self._seen) >= self.MAX_ENTRIES:
            self._seen.pop(next(iter(self._seen)))
        self._seen[id(segment_ids)] = (weakref.ref(segment_ids), segment_ids._version, bounds)
        return bounds


_CHECKED = _CheckedSegmentIds()


def segment_mask_of(segment_ids, batch: int, seq_len: int, device: torch.device) -> SegmentMask | None:
    """The SegmentMask a call uses for its `segment_ids` argument (None, a SegmentMask, or ids).

    A SegmentMask is used as built (its batch and length checked). Ids are checked on the host; their
    values once per tensor (`_CheckedSegmentIds`: one device sync the first time a tensor is seen),
    except inside compiled code or a CUDA-graph capture, where nothing may sync: there the bounds
    are computed by device ops in the call, from whatever the buffer holds."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, SegmentMask):
        check_segment_ids_layout(segment_ids.segment_ids, batch, seq_len, device)
        return segment_ids
    check_segment_ids_layout(segment_ids, batch, seq_len, device)
    if torch.compiler.is_compiling() or (segment_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return SegmentMask(segment_ids, segment_bounds(segment_ids))
    return SegmentMask(segment_ids, _CHECKED.bounds(segment_ids))


def _key_length(seq_len: int, kv_len: int | None, segment_ids) -> int:
    kv_len = seq_len if kv_len is None else kv_len
    if kv_len < seq_len:
        raise ValueError(f"keys ({kv_len}) must be at least as many as queries ({seq_len})")
    if segment_ids is not None and kv_len != seq_len:
        raise ValueError("segment_ids need queries and keys of one length")
    return kv_len


def dense_mask(
    spec: MaskSpec, seq_len: int, segment_ids: torch.Tensor | None = None, device=None, kv_len: int | None = None
) -> torch.Tensor:
    """Boolean visibility (B or 1, N, KV), [.., i, j] True when query i sees key j; `kv_len`
    (default N) keys, query i at position i + KV - N."""
    if segment_ids is not None:
        device = segment_ids.device
    kv_len = _key_length(seq_len, kv_len, segment_ids)
    i = torch.arange(seq_len, device=device)[:, None] + (kv_len - seq_len)
    j = torch.arange(kv_len, device=device)[None, :]
    visible = torch.ones(seq_len, kv_len, dtype=torch.bool, device=device)
    if spec.is_causal:
        visible &= j <= i
    if spec.window is not None:
        visible &= j > i - spec.window
    visible = visible[None]
    if segment_ids is not None:
        q_seg = segment_ids[:, :, None]
        k_seg = segment_ids[:, None, :]
        history_key = k_seg == HISTORY
        seg_visible = ((q_seg == HISTORY) & history_key) | (
            (q_seg == CANDIDATE) & (history_key | (i == j)[None])
        )
        visible = visible & seg_visible
    return visible


def visible_key_counts(
    spec: MaskSpec, seq_len: int, segment_ids: torch.Tensor | None = None, device=None, kv_len: int | None = None
) -> torch.Tensor:
    """n_i: number of keys query i sees, (B or 1, N) float (closed form, no N^2 memory); `kv_len`
    (default N) keys, query i at position i + KV - N."""
    if segment_ids is not None:
        device = segment_ids.device
    kv_len = _key_length(seq_len, kv_len, segment_ids)
    i = torch.arange(seq_len, device=device, dtype=torch.int64)[None] + (kv_len - seq_len)
    if segment_ids is None:
        if not spec.is_causal:
            return torch.full((1, seq_len), float(kv_len), device=device)
        hi = i + 1
        lo = torch.zeros_like(i) if spec.window is None else (i - spec.window + 1).clamp_min(0)
        return (hi - lo).float()
    b = segment_bounds(segment_ids).long()
    hs, he = b[:, 0:1], b[:, 1:2]
    hi = torch.full_like(i, seq_len) if not spec.is_causal else i + 1
    lo = torch.zeros_like(i) if spec.window is None else (i - spec.window + 1).clamp_min(0)
    history_seen = (torch.minimum(he, hi) - torch.maximum(hs, lo)).clamp_min(0)
    is_hist = segment_ids == HISTORY
    is_cand = segment_ids == CANDIDATE
    # a candidate always sees itself (j == i passes causal and window too)
    return torch.where(is_hist, history_seen, torch.where(is_cand, history_seen + 1, 0)).float()


def length_mask(spec: MaskSpec, seq_len: int, key_lengths: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean visibility (B, N, KV) against per-row key lengths (values clamped to [0, KV]): key j
    exists for row b when j < L_b; query i sits at position L_b - N + i. Segment ids do not combine
    with key lengths."""
    lengths = key_lengths.to(torch.int64).clamp(0, kv_len)[:, None, None]
    i = torch.arange(seq_len, device=key_lengths.device)[None, :, None] + lengths - seq_len
    j = torch.arange(kv_len, device=key_lengths.device)[None, None, :]
    visible = j < lengths
    if spec.is_causal:
        visible = visible & (j <= i)
    if spec.window is not None:
        visible = visible & (j > i - spec.window)
    return visible
