"""One small GPT whose attention is chosen by name from the attn registry.

Token embedding tied to the output head, RoPE, pre-norm RMSNorm, grouped-query
attention with the variant's number of q/k views, GELU or SwiGLU MLP, optional QK-norm, per-head
output RMSNorm, and per layer the module its family builds for its extra per-call tensors (the
differential variants' second view and lambda: attn/families/differential.py). Three switches give
GPT-2's blocks instead (configs/model/gpt2_compat.yaml, which models/pretrained.py loads GPT-2
weights into): `positions=learned` (a position embedding added to the token embedding, no RoPE),
`norm=layer` (LayerNorm) and `bias=true` (biases in every linear layer and norm), with
`mlp=gelu_tanh` (GPT-2's tanh-approximated GELU). Generation
decodes against a static KV cache (`KVCache`), one token per step (`GPT.decode_step`), on CUDA
as a captured CUDA graph replayed per token (`DecodeStep`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import attn
from models.captured_step import capture_cuda_graph
from models.head_norms import head_norm_rope, head_rms_norm, rotate_pairs

QK_NORMS = ("none", "l2", "rms")
# the MLP's activation by kind; swiglu gates (its up projection is twice as wide)
MLP_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "swiglu": None}
MLP_KINDS = tuple(MLP_ACTIVATIONS)
POSITION_KINDS = ("rope", "learned")
NORM_KINDS = ("rms", "layer")


@dataclass
class AttnConfig:
    name: str = "softmax"
    backend: str = "auto"
    params: dict = field(default_factory=dict)  # the variant's spec parameters (cap, knee, beta, ...)
    qk_norm: str | None = None  # None: the variant's default (attn/registry.py: l2 for threshold, rms for sigmoid)
    out_norm: bool | None = None  # None: the variant's default (on for threshold variants)
    out_norm_eps: float = 1e-5  # the per-head output RMSNorm's eps (fp32 arithmetic)
    # the differential variants' lambda (attn/families/differential.py): reparam (Differential Transformer,
    # per head), clamp (per head, in [0, 1]), scalar_clamp (the official TDA code: one scalar per layer in [0, 1])
    lambda_mode: str = "reparam"
    window: int | None = None


@dataclass
class GPTConfig:
    vocab_size: int = 2048
    context: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    d_model: int = 256
    mlp: str = "swiglu"  # one of MLP_KINDS
    mlp_ratio: float = 4.0
    positions: str = "rope"  # rope (rotary, in attention) | learned (an embedding of positions 0 .. context - 1)
    rope_base: float = 10000.0
    norm: str = "rms"  # the blocks' and the final norm: rms (RMSNorm) | layer (LayerNorm)
    norm_eps: float | None = None  # None: the norm's default (RMSNorm: the dtype's machine epsilon, LayerNorm: 1e-5)
    bias: bool = False  # biases in the linear layers (attention, MLP) and in LayerNorm
    dropout: float = 0.0  # residual dropout (attention and MLP outputs)
    attn_dropout: float = 0.0  # attention-weight dropout inside the attention op, training mode only
    embed_dropout: float = 0.0  # dropout after the token embedding
    attn: AttnConfig = field(default_factory=AttnConfig)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def block_norm(cfg: GPTConfig) -> nn.Module:
    """The norm of the blocks and of the output (cfg.norm)."""
    if cfg.norm == "layer":
        return nn.LayerNorm(cfg.d_model, eps=1e-5 if cfg.norm_eps is None else cfg.norm_eps, bias=cfg.bias)
    return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)


class RoPE(nn.Module):
    def __init__(self, head_dim: int, base: float, max_len: int):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        # cos/sin tables up to the training context, built once: inside a compiled step the
        # fused kernel otherwise recomputes them for every batch element and head
        for name in ("cos_table", "sin_table"):
            self.register_buffer(name, torch.empty(max_len, head_dim // 2, dtype=torch.float32), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """Compute the frequency and cos/sin buffers in place (they are not in state dicts, so a model
        materialized from the meta device, as transformers loads one, computes them again here)."""
        arange = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq.copy_(self.base ** (-arange / self.head_dim))
        cos, sin = self._tables(self.cos_table.shape[0])
        self.cos_table.copy_(cos)
        self.sin_table.copy_(sin)

    def _tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(torch.arange(n, device=self.inv_freq.device, dtype=torch.float32), self.inv_freq)
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """x (B, N, H, D) at positions offset .. offset + N - 1: rotate pairs (first half, second
        half) by position. `offset` may be a (1,) int64 device tensor (a decode step's position,
        N = 1, inside the training context): the table rows are then gathered on the device."""
        return rotate_pairs(x, *self.table_rows(offset, x.shape[1]))

    def table_rows(self, offset: int | torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) (n, D/2) of positions offset .. offset + n - 1: views of the tables; a (1,) device
        offset (n = 1) gathers its row on the device; past the training context (length-extrapolation
        evals) the rows are computed for the call."""
        if isinstance(offset, torch.Tensor):
            if n != 1:
                raise ValueError(f"a tensor RoPE offset serves one position (N = 1), got N = {n}")
            return self.cos_table.index_select(0, offset), self.sin_table.index_select(0, offset)
        if offset + n > self.cos_table.shape[0]:
            return tuple(t[offset:] for t in self._tables(offset + n))
        return self.cos_table[offset:offset + n], self.sin_table[offset:offset + n]


class KVCache:
    """Static keys and values of every layer for incremental decoding: per layer the keys of each
    view (RoPE and QK-norm applied) and the values, (B, capacity, H_kv, D) buffers allocated once
    for a batch size, dtype and device (zero-filled, at the first write) and written in place from
    then on, so a captured decode step keeps pointing at them.

    `length` positions are filled. The host keeps `length` (the eager paths slice with it); the
    device keeps `key_lengths` (B,) int32 (what attention reads, `attn.attention`'s key_lengths) and
    `position` (1,) int64 (where the next token's keys go), which a decode step
    (`GPT.decode_step`) reads and advances without the host. A forward with the cache writes its
    tokens after `length` (host positions) and GPT.forward then sets both to the new length."""

    def __init__(self, n_layer: int, capacity: int):
        self.capacity, self.length = capacity, 0
        self.layers: list[dict | None] = [None] * n_layer
        self.key_lengths: torch.Tensor | None = None
        self.position: torch.Tensor | None = None

    def reset(self) -> None:
        self.set_length(0)

    def set_length(self, length: int) -> None:
        """The filled length on the host and (when allocated) on the device (two fills, no sync)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"KV cache length must lie in [0, {self.capacity}], got {length}")
        self.length = length
        if self.key_lengths is not None:
            self.key_lengths.fill_(length)
            self.position.fill_(length)

    def _slot(self, layer: int, ks: list, v: torch.Tensor) -> dict:
        slot = self.layers[layer]
        if slot is None or slot["v"].shape[0] != v.shape[0] or slot["v"].dtype != v.dtype or slot["v"].device != v.device:
            shape = (v.shape[0], self.capacity, *v.shape[2:])
            slot = {"k": [v.new_zeros(shape) for _ in ks], "v": v.new_zeros(shape)}
            self.layers[layer] = slot
            if self.key_lengths is None or self.key_lengths.shape[0] != v.shape[0] or self.key_lengths.device != v.device:
                self.key_lengths = torch.full((v.shape[0],), self.length, dtype=torch.int32, device=v.device)
                self.position = torch.full((1,), self.length, dtype=torch.int64, device=v.device)
        return slot

    def append(self, layer: int, ks: list, v: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Write the new keys (one per view) and values at length .. length + n (host positions);
        return every cached position's keys and values, the new ones included."""
        start, end = self.length, self.length + v.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {end} requested (reset it first)")
        slot = self._slot(layer, ks, v)
        for buffer, k in zip(slot["k"], ks):
            buffer[:, start:end] = k
        slot["v"][:, start:end] = v
        return [buffer[:, :end] for buffer in slot["k"]], slot["v"][:, :end]

    def write(self, layer: int, ks: list, v: torch.Tensor) -> tuple[list, torch.Tensor]:
        """A decode step's write: one token per row (keys per view, values; (B, 1, H_kv, D)) at
        the device `position`; returns the whole buffers (attention masks them with key_lengths)."""
        slot = self.layers[layer]
        if slot is None or slot["v"].shape[0] != v.shape[0] or slot["v"].dtype != v.dtype:
            raise ValueError("a decode step needs a cache that a forward of this batch size and dtype filled first "
                             f"(layer {layer}: {None if slot is None else tuple(slot['v'].shape)} {v.dtype} vs "
                             f"batch {v.shape[0]})")
        for buffer, k in zip(slot["k"], ks):
            buffer.index_copy_(1, self.position, k)
        slot["v"].index_copy_(1, self.position, v)
        return slot["k"], slot["v"]


def _qk_normalize(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """The parameter-free QK-norms ("l2", or none); "rms" is Attention.rms_normalize_heads.

    l2: every head scaled to unit norm over D, as x / ||x|| = rms_norm(x) / sqrt(D): one fused
    RMSNorm in x's dtype (fp32 arithmetic inside) scaled by D^-1/2, instead of F.normalize's norm,
    clamp and division, which autocast runs in fp32 (21 kernels forward and backward at the `small`
    shape against 4, docs/results/public_path/). Autocast is off around it: it would widen x to fp32.
    On CUDA in eager mode the norm is models/head_norms.py's kernel, elsewhere torch's rms_norm
    weighted by D^-1/2 in x's dtype."""
    if kind != "l2":
        return x
    return head_rms_norm(x, eps=torch.finfo(torch.float32).tiny, scale=x.shape[-1] ** -0.5)


def _load_extras_held_by_the_layer(layer: Attention, state_dict: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook of Attention: state dicts whose attention layer held its family's
    parameters itself (`blocks.0.attn.<name>`, not `blocks.0.attn.extras.<name>`) load them into the
    layer's `extras`. The layer has no parameter or buffer of its own, so a key of one name below
    the layer's prefix can only be one of these."""
    for name in layer.extras.state_dict(keep_vars=True):
        held = prefix + name
        if "." not in name and held in state_dict and f"{prefix}extras.{name}" not in state_dict:
            state_dict[f"{prefix}extras.{name}"] = state_dict.pop(held)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_index: int):
        super().__init__()
        acfg = cfg.attn
        self.layer_index = layer_index
        self.variant = attn.get_variant(acfg.name)
        self.spec = self.variant.make_spec(**acfg.params)
        self.backend, self.window = acfg.backend, acfg.window
        # spec, mask and backend checked once here; per call no validation (see attn.AttentionCall)
        self.attend = attn.AttentionCall(self.spec, causal=True, window=self.window, backend=self.backend)
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.views = self.variant.views
        # the family's layer module (built below): its parameters come first in this layer's
        # parameters() and state dict, the order optimizer states list them by
        self.register_module("extras", None)
        self.register_load_state_dict_pre_hook(_load_extras_held_by_the_layer)
        self.attn_dropout = cfg.attn_dropout
        self.qk_norm = acfg.qk_norm or self.variant.qk_norm
        self.out_norm = self.variant.out_norm if acfg.out_norm is None else acfg.out_norm
        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        # one fused projection: views x (q, k) and a single v
        self.qkv = nn.Linear(cfg.d_model, self.views * (q_dim + kv_dim) + kv_dim, bias=cfg.bias)
        self.proj = nn.Linear(q_dim, cfg.d_model, bias=cfg.bias)
        self.proj.residual_projection = True
        # learned positions enter with the token embedding (GPT), so q and k are not rotated
        self.rope = RoPE(cfg.head_dim, cfg.rope_base, cfg.context) if cfg.positions == "rope" else None
        self.q_norm = nn.RMSNorm(cfg.head_dim) if self.qk_norm == "rms" else None
        self.k_norm = nn.RMSNorm(cfg.head_dim) if self.qk_norm == "rms" else None
        # eps fixed, not the input dtype's machine epsilon: with eps ~1e-7 one tiny surviving weight
        # in an otherwise empty row is scaled up to a full-size output
        self.head_norm = nn.RMSNorm(cfg.head_dim, eps=acfg.out_norm_eps) if self.out_norm else None
        # the family's per-layer parameters and the extra per-call tensors (attn.attention's `extra`
        # mapping) formed from the q/k views (attn/families/layer_extras.py)
        shape = attn.LayerShape(layer_index=layer_index, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                                head_dim=cfg.head_dim, views=self.views)
        self.extras = attn.family_of(self.spec).layer_extras(self.spec, shape, dataclasses.asdict(acfg))

    def rotate(self, x: torch.Tensor, offset: int | torch.Tensor) -> torch.Tensor:
        """RoPE at positions offset .. (models with learned positions: x as it is)."""
        return x if self.rope is None else self.rope(x, offset)

    def split_heads(self, x: torch.Tensor, offset: int | torch.Tensor = 0):
        """(B, N, C) at positions offset .. offset + N - 1 (or a decode step's (1,) device position)
        -> list of q/k views and v, each (B, N, heads, D), with RoPE and QK-norm."""
        b, n, _ = x.shape
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        h, h_kv, d = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x)
        # every q and k head at once (one norm, one RoPE, one cast instead of one per view and
        # kind: an eager step and a decode step are host-bound, so op counts count), since the
        # per-head norm and RoPE act on each head alike and the views lie side by side, q then k;
        # q and k are then views into one tensor (the kernels take strides)
        v = qkv[..., self.views * (q_dim + kv_dim):].view(b, n, h_kv, d)
        heads = qkv[..., :self.views * (q_dim + kv_dim)].view(b, n, self.views * (h + h_kv), d)
        if self.qk_norm in ("l2", "rms") and self.rope is not None:
            # QK-norm and RoPE in one pass (models/head_norms.py: one kernel each way on CUDA in eager
            # mode, in place of the norm's kernels and RoPE's elementwise ops), rounded once to v's dtype;
            # prefill, decode steps and re-encoding all take it, so their keys agree bit for bit
            rows = self.rope.table_rows(offset, n)
            return self._split_views(head_norm_rope(heads, *rows, out_dtype=v.dtype, **self.qk_norm_arguments()), v)
        if self.qk_norm == "rms":
            heads = self.rms_normalize_heads(heads)
        else:
            heads = _qk_normalize(heads, self.qk_norm)
        # norms run in fp32 under autocast: bring q and k back to v's dtype for the kernels
        return self._split_views(self.rotate(heads, offset).to(v.dtype), v)

    def _split_views(self, heads: torch.Tensor, v: torch.Tensor):
        """(q views, k views, v) from the normalized, rotated q and k heads (B, N, views (H + H_kv), D)."""
        h, h_kv = self.n_head, self.n_kv_head
        views = heads.split([h, h_kv] * self.views, dim=2)
        return list(views[0::2]), list(views[1::2]), v

    def qk_norm_arguments(self) -> dict:
        """`head_norm_rope`'s norm arguments for this layer's QK-norm: rms (q_norm's and k_norm's weights
        by head kind, their eps) or l2 (unit heads: RMSNorm scaled by D^-1/2)."""
        if self.qk_norm == "rms":
            return dict(weight=self.q_norm.weight, second_weight=self.k_norm.weight, first_slots=self.n_head,
                        period=self.n_head + self.n_kv_head, eps=self.q_norm.eps)
        return dict(eps=torch.finfo(torch.float32).tiny, scale=self.head_dim ** -0.5)

    def rms_normalize_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """RMSNorm of every q and k head of `heads` (B, N, views (H + H_kv), D) in one fused norm in at
        least fp32 (float64 heads stay float64), then each head scaled by its kind's weight (q_norm's or
        k_norm's): what q_norm and k_norm compute (their eps; None is the compute type's machine
        epsilon, fp32's for 16-bit inputs too), without rounding the normalized heads to 16 bits before
        the weight (models/head_norms.py: its kernel on CUDA in eager mode, torch's rms_norm times the
        weights elsewhere)."""
        return head_rms_norm(heads, self.q_norm.weight, second_weight=self.k_norm.weight, first_slots=self.n_head,
                             period=self.n_head + self.n_kv_head, eps=self.q_norm.eps,
                             out_dtype=torch.promote_types(heads.dtype, torch.float32))

    def normalize_output(self, y: torch.Tensor) -> torch.Tensor:
        """head_norm (the per-head output RMSNorm) times the family's `extras.output_scale` in one fused
        kernel of y's dtype, fp32 arithmetic inside, its weight rounded to y's dtype as autocast rounds
        linear weights (by the kernels as they read it: head_rms_norm's round_weight, no cast op).
        Autocast is off around it:
        it would widen y to fp32 and back (at the `small` shape, forward and backward, 259 us and 11
        kernels against 173 us and 9 for torch's rms_norm, docs/results/public_path/). On CUDA in eager
        mode the norm is models/head_norms.py's kernel, elsewhere torch's rms_norm."""
        norm = self.head_norm
        return head_rms_norm(y, norm.weight, eps=norm.eps, scale=self.extras.output_scale, round_weight=True)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None,
                segment_bounds: torch.Tensor | None = None, cache: KVCache | None = None,
                decode: bool = False) -> torch.Tensor:
        """decode: one token per row against the whole static `cache` at its device position, the
        attention masked by the cache's device key lengths (GPT.decode_step); else with a cache the
        tokens continue it at its host length."""
        b, n, _ = x.shape
        key_lengths = None
        if decode:
            qs, ks, v = self.split_heads(x, cache.position)
            ks, v = cache.write(self.layer_index, ks, v)
            key_lengths = cache.key_lengths
        else:
            qs, ks, v = self.split_heads(x, cache.length if cache is not None else 0)
            if cache is not None:
                ks, v = cache.append(self.layer_index, ks, v)
        # the kernels draw a fresh dropout seed per call from torch's generator of the device
        dropout_p = self.attn_dropout if self.training else 0.0
        # new queries against a longer cache align bottom-right (attn.AttentionCall picks their backend)
        y = self.attend(qs[0], ks[0], v, segment_ids=segment_ids, bounds=segment_bounds, dropout_p=dropout_p,
                        key_lengths=key_lengths, extra=self.extras(qs, ks))
        if self.head_norm is not None:
            y = self.normalize_output(y)
        elif self.extras.output_scale != 1.0:
            y = y * self.extras.output_scale
        return self.proj(y.reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.activation = MLP_ACTIVATIONS[cfg.mlp]  # None: SwiGLU
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        if self.activation is None:
            hidden = int(2 * hidden / 3)  # same parameter count as the GELU MLP
            self.up = nn.Linear(cfg.d_model, 2 * hidden, bias=cfg.bias)
        else:
            self.up = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.down.residual_projection = True

    def forward(self, x):
        h = self.up(x)
        if self.activation is None:
            gate, up = h.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(self.activation(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_index: int):
        super().__init__()
        self.norm1 = block_norm(cfg)
        self.attn = Attention(cfg, layer_index)
        self.norm2 = block_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, segment_ids=None, segment_bounds=None, cache=None, decode=False):
        x = x + self.drop(self.attn(self.norm1(x), segment_ids, segment_bounds, cache, decode))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        check_model_config(cfg)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embed = nn.Embedding(cfg.context, cfg.d_model) if cfg.positions == "learned" else None
        self.embed_drop = nn.Dropout(cfg.embed_dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = block_norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # GPT-2 init; residual projections scaled by 1/sqrt(2 * n_layer)
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(
        self, idx: torch.Tensor, segment_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """idx (B, N) token ids -> logits (B, N, vocab).

        With targets (B, N): the cross-entropy summed over all B * N positions (fp32 nats)
        instead. Inside a compiled graph the fp32 upcast of the logits is then fused into the
        loss and never stored (at vocab 50304 that copy is 3.3 GB per 16K tokens).
        With a `cache` (`new_cache`): idx continues the cached positions; its keys and values are
        added to the cache.
        """
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids and a KV cache cannot be combined")
        x = self.embed_tokens(idx, cache.length if cache is not None else 0)
        bounds = None
        if segment_ids is not None:  # checked and turned into kernel bounds once, not per layer
            if not torch.compiler.is_compiling():  # the check syncs with the device
                attn.masks.validate_segment_ids(segment_ids, *idx.shape)
            bounds = attn.segment_bounds(segment_ids)
        if cache is not None and cache.length + idx.shape[1] > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; {cache.length + idx.shape[1]} requested "
                             "(reset it first)")
        for block in self.blocks:
            x = block(x, segment_ids, bounds, cache)
        if cache is not None:
            cache.set_length(cache.length + idx.shape[1])
        return self.output(x, targets)

    def embed_tokens(self, idx: torch.Tensor, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """The token embedding of idx (B, N), plus with learned positions the embedding of positions
        offset .. offset + N - 1 (`offset` may be a decode step's (1,) device position), then dropout."""
        x = self.embed(idx)
        if self.position_embed is not None:
            if isinstance(offset, torch.Tensor):
                x = x + self.position_embed(offset)
            elif offset + idx.shape[1] > self.cfg.context:
                raise ValueError(f"learned positions cover model.context = {self.cfg.context} positions; "
                                 f"positions up to {offset + idx.shape[1] - 1} requested")
            else:
                x = x + self.position_embed.weight[offset:offset + idx.shape[1]]
        return self.embed_drop(x)

    def decode_step(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, 1, vocab) of one new token per row, idx (B, 1), against a static `cache` that a
        forward filled: the token's position, where its keys go and the key lengths attention reads
        are the cache's device tensors, which the step advances by one. The host's `cache.length`
        is the caller's to advance (`DecodeStep` does); nothing here reads it, so the step can be
        captured once as a CUDA graph and replayed for every token. Inference only (under
        torch.no_grad(), as `generate` runs it): the attention's key_lengths path has no backward."""
        if idx.ndim != 2 or idx.shape[1] != 1:
            raise ValueError(f"decode_step takes one token per row, idx of shape (B, 1), got {tuple(idx.shape)}")
        if cache.key_lengths is None:
            raise ValueError("a decode step needs a cache that a forward filled first (e.g. with the prompt)")
        if cache.capacity > self.cfg.context:  # RoPE's tables and learned positions end at the context
            raise ValueError(f"a decode step serves caches of at most the context ({self.cfg.context} positions), "
                             f"got capacity {cache.capacity}")
        if cache.key_lengths.shape[0] != idx.shape[0]:
            raise ValueError(f"a decode step needs a cache that a forward of this batch size filled: idx has batch "
                             f"{idx.shape[0]}, the cache {cache.key_lengths.shape[0]}")
        cache.key_lengths.add_(1)  # the new token is one of the keys its query sees
        x = self.embed_tokens(idx, cache.position)
        for block in self.blocks:
            x = block(x, cache=cache, decode=True)
        cache.position.add_(1)
        return self.output(x)

    def new_cache(self) -> KVCache:
        """An empty KV cache of the training context's length."""
        return KVCache(self.cfg.n_layer, self.cfg.context)

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and tied head: logits, or with targets the summed cross-entropy."""
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")

    def compile_per_block(self, **compile_kwargs) -> None:
        """Compile in place, one graph per transformer block plus one for the output (norm, head,
        loss); the embedding stays eager. Each block's backward is its own autograd node, so under
        DDP with buckets smaller than the gradient (not trainer=ddp's 512 MB) each block's
        gradients are all-reduced while earlier blocks run backward (not faster than the
        whole-model graph on NVLinked GPUs: docs/results/bench_ddp.md). Blocks share their
        compiled code; state-dict keys do not change."""
        for block in self.blocks:
            block.compile(fullgraph=True, **compile_kwargs)
        self.output = torch.compile(self.output, fullgraph=True, **compile_kwargs)  # shadows the method

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters (the tied head counted once); non_embedding: without the token and position
        embeddings (a lookup, no FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return n
        return n - sum(e.weight.numel() for e in (self.embed, self.position_embed) if e is not None)

    def flops_per_token(self, context: int | None = None) -> float:
        """Training FLOPs per token: 6 * non-embedding params + 6 * head matmul + attention.

        Attention per layer and token: q.k and w.v are 2 * 2 * T * d_head * H FLOPs forward
        (non-causal count, as in PaLM's MFU), x3 for forward + backward; a variant with more
        q/k views does one more q.k per view.
        """
        cfg, t = self.cfg, context or self.cfg.context
        dense = 6 * self.num_params(non_embedding=True) + 6 * cfg.d_model * cfg.vocab_size
        views = self.blocks[0].attn.views
        attention = 6 * cfg.n_layer * (views + 1) * t * cfg.n_head * cfg.head_dim
        return float(dense + attention)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 kv_cache: bool = True, generator: torch.Generator | None = None, stop_token: int | None = None,
                 graph: bool | None = None, capture: Callable | None = None):
        """Sample continuations of idx (B, N), attending to at most the training context.

        Without `kv_cache` every token re-encodes the last `context` tokens. With it (default) the
        model encodes the prompt once (eagerly) and then one token per step against a static cache
        (`decode_step`); both give the same tokens while prompt and continuation fit the context.
        Once the cache is full it is re-filled eagerly with the last 3/4 of the context (positions
        restart at 0, as the uncached path's cropped window does), so a long generation re-encodes
        3/4 context every context/4 tokens; the decode steps then go on in the same buffers.
        `graph`: the decode step captured once as a CUDA graph and replayed per token (`DecodeStep`;
        capture and replays run in the caller's autocast context); None (default) = on CUDA only,
        False = eager steps (the same static-cache code). `capture` replaces
        models.captured_step.capture_cuda_graph (tests pass a CPU stand-in with a graph's semantics).
        Sampling draws from `generator` (torch's default generator when None).
        With `stop_token` (e.g. the end-of-text id), a row that has sampled it is done: its later
        positions hold stop_token, and generation ends once every row is done (one host sync per
        token); the result may then be shorter than N + max_new_tokens.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if graph not in (None, True, False):
            raise ValueError(f"graph must be True, False or None (auto: CUDA only), got {graph!r}")
        if graph is None:
            graph = idx.is_cuda
        if graph and not idx.is_cuda and capture is None:
            raise ValueError(f"graph=True captures a CUDA graph; idx is on {idx.device} (use graph=False or None)")
        context = self.cfg.context
        done = torch.zeros(idx.shape[0], 1, dtype=torch.bool, device=idx.device) if stop_token is not None else None

        def append(idx, nxt):
            """idx with nxt appended, and whether every row is done."""
            if done is None:
                return torch.cat([idx, nxt], dim=1), False
            nxt = nxt.masked_fill(done, stop_token)
            done.logical_or_(nxt == stop_token)
            return torch.cat([idx, nxt], dim=1), bool(done.all())

        if not kv_cache:
            for _ in range(max_new_tokens):
                nxt = _sample_next(self(idx[:, -context:])[:, -1, :].float(), temperature, top_k, generator)
                idx, finished = append(idx, nxt)
                if finished:
                    break
            return idx
        cache = self.new_cache()
        logits = self(idx[:, -context:], cache=cache)[:, -1, :]
        step = DecodeStep(self, cache, graph=graph, capture=capture or capture_cuda_graph)
        for i in range(max_new_tokens):
            # the logits may be the graph's static output: sampled here, before the next replay
            nxt = _sample_next(logits.float(), temperature, top_k, generator)
            idx, finished = append(idx, nxt)
            if finished or i == max_new_tokens - 1:
                break
            if cache.length == context:
                cache.reset()
                logits = self(idx[:, -max(1, context - context // 4):], cache=cache)[:, -1, :]
            else:
                logits = step(idx[:, -1:])
        return idx


class DecodeStep:
    """`GPT.decode_step` of one model, static cache and batch, called per token: tokens (B, 1) ->
    logits (B, vocab), advancing the cache (device counters and host `length`) by one.

    graph=False runs the step eagerly. graph=True captures it at the first call with `capture`
    (models.captured_step.capture_cuda_graph: one warm-up run on a side stream, for compilation,
    autotuning and the libraries' lazy set-up, then the capture, which records without running)
    and replays it from then on: the token is copied into a static input buffer, and the logits
    land in a static output that the next replay overwrites. The warm-up's writes are undone
    before the capture (the counters reset to the length at capture time; the keys it wrote are
    written again by the first replay). The cache's buffers must stay the ones captured: refills
    of the same batch and dtype write into them (`KVCache`), anything else is refused."""

    def __init__(self, model: GPT, cache: KVCache, graph: bool, capture: Callable = capture_cuda_graph):
        self.model, self.cache, self.graph, self.capture = model, cache, graph, capture
        self._replay: Callable[[], None] | None = None
        self._tokens: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._buffers: list | None = None

    @property
    def captured(self) -> bool:
        return self._replay is not None

    def _step(self) -> torch.Tensor:
        return self.model.decode_step(self._tokens, self.cache)[:, -1, :]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if cache.length >= cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; {cache.length + 1} requested (reset it first)")
        if not self.graph:
            logits = self.model.decode_step(tokens, cache)[:, -1, :]
        else:
            buffers = [slot["v"] for slot in cache.layers]
            if self._replay is None:
                self._tokens, self._buffers = tokens.clone(), buffers
                length = cache.length
                self._replay, self._logits = self.capture(self._step, lambda: cache.set_length(length))
            else:
                if tokens.shape != self._tokens.shape:
                    raise ValueError(f"a captured decode step replays tokens of shape {tuple(self._tokens.shape)}, "
                                     f"got {tuple(tokens.shape)}")
                if any(a is not b for a, b in zip(buffers, self._buffers)):
                    raise ValueError("the KV cache was reallocated after the decode step was captured "
                                     "(another batch size or dtype): capture a new DecodeStep")
                self._tokens.copy_(tokens)
            self._replay()
            logits = self._logits
        cache.length += 1
        return logits


def _sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, vocab) fp32 logits -> next ids (B, 1): greedy at temperature 0, else top-k sampling."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_model_config(cfg: GPTConfig) -> None:
    """Config errors caught before any training: each names the field and what is allowed."""
    for name in ("vocab_size", "context", "n_layer", "n_head", "n_kv_head", "d_model"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{name} must be a positive int, got {value!r}")
    if cfg.d_model % cfg.n_head != 0:
        raise ValueError(f"model.n_head ({cfg.n_head}) must divide model.d_model ({cfg.d_model})")
    if cfg.positions not in POSITION_KINDS:
        raise ValueError(f"model.positions must be one of {POSITION_KINDS}, got {cfg.positions!r}")
    if cfg.positions == "rope" and cfg.head_dim % 2 != 0:
        raise ValueError(f"head dim d_model / n_head = {cfg.head_dim} must be even (RoPE)")
    if cfg.norm not in NORM_KINDS:
        raise ValueError(f"model.norm must be one of {NORM_KINDS}, got {cfg.norm!r}")
    if cfg.norm_eps is not None and (isinstance(cfg.norm_eps, bool) or not isinstance(cfg.norm_eps, (int, float))
                                     or cfg.norm_eps <= 0):
        raise ValueError(f"model.norm_eps must be a number > 0 or null, got {cfg.norm_eps!r}")
    if not isinstance(cfg.bias, bool):
        raise ValueError(f"model.bias must be true or false, got {cfg.bias!r}")
    if cfg.n_head % cfg.n_kv_head != 0:
        raise ValueError(f"model.n_head ({cfg.n_head}) must be divisible by model.n_kv_head ({cfg.n_kv_head})")
    if cfg.mlp not in MLP_KINDS:
        raise ValueError(f"model.mlp must be one of {MLP_KINDS}, got {cfg.mlp!r}")
    if not (_is_finite_number(cfg.mlp_ratio) and cfg.mlp_ratio > 0):
        raise ValueError(f"model.mlp_ratio must be a number > 0, got {cfg.mlp_ratio!r}")
    # RoPE's wavelengths 2 pi base^(2i/D) grow along the head dim only for base > 1 (0 gives inf, then NaN)
    if not (_is_finite_number(cfg.rope_base) and cfg.rope_base > 1):
        raise ValueError(f"model.rope_base must be a number > 1, got {cfg.rope_base!r}")
    for name in ("dropout", "attn_dropout", "embed_dropout"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"model.{name} must be a float in [0, 1), got {value!r}")
    a = cfg.attn
    variant = attn.get_variant(a.name)
    variant.make_spec(**a.params)  # spec-level checks (cap > 0, kappa in [0, 1), p > 0, ...)
    if a.backend not in attn.BACKENDS:
        raise ValueError(f"attn.backend must be one of {attn.BACKENDS}, got {a.backend!r}")
    if a.qk_norm is not None and a.qk_norm not in QK_NORMS:
        raise ValueError(f"attn.qk_norm must be one of {QK_NORMS} or null, got {a.qk_norm!r}")
    # the options the families' layer modules read (lambda_mode): allowed values, and a setting the variant has
    # no use for refused unless at its default (which every variant's config carries, and older checkpoints record)
    attn.check_layer_options(a.name, dataclasses.asdict(a), {f.name: f.default for f in dataclasses.fields(AttnConfig)})
    if not (isinstance(a.out_norm_eps, (int, float)) and not isinstance(a.out_norm_eps, bool) and a.out_norm_eps > 0):
        raise ValueError(f"attn.out_norm_eps must be a number > 0, got {a.out_norm_eps!r}")
    out_norm = variant.out_norm if a.out_norm is None else a.out_norm
    if not out_norm and a.out_norm_eps != AttnConfig.out_norm_eps:
        raise ValueError(f"attn.out_norm_eps={a.out_norm_eps} applies only with the output norm on: attn={a.name} runs "
                         "without it (set attn.out_norm=true, or leave attn.out_norm_eps out)")
    if a.window is not None and (not isinstance(a.window, int) or a.window < 1):
        raise ValueError(f"attn.window must be a positive int or null, got {a.window!r}")
