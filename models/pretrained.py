"""Start from pretrained GPT-2-family weights: `train.init_from=<folder>` with `model=gpt2_compat`.

The folder is a Hugging Face GPT-2 model folder (what `GPT2LMHeadModel.save_pretrained` writes, or
a download of openai-community/gpt2, distilgpt2, gpt2-medium, ...): `config.json` (model_type gpt2)
and `model.safetensors`. Both are read as data (JSON, safetensors); nothing in the folder runs and
transformers is not needed. A name that is not a folder is downloaded from the Hugging Face Hub
(those two files and the tokenizer's) when huggingface_hub can reach it.

`GPT2Weights(folder)` reads the config: `model_fields()` gives the model.* values it fixes (layers,
width, heads, context, activation, MLP ratio, norm eps; `vocab_size` the vocabulary), `check_blocks(cfg)` refuses a model config
whose blocks are not GPT-2's, and `load_into(model)` copies the weights into a GPT built with any
attention variant: GPT-2's fused q/k/v projection becomes the first q/k view and the values
(Conv1D weights are stored (in, out) and are transposed); what the variant adds and GPT-2 lacks (a
differential variant's second q/k view and its lambda, learned q/k or output norms) keeps the
GPT's fresh initialization, and `load_into` returns those names.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from data.tokenizers import HFTokenizer, Tokenizer, describe_tokenizer
from models.gpt import GPT, GPTConfig

log = logging.getLogger("attnlab.pretrained")

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HUB_FILES = [CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
# GPT-2's activation_function values and the MLP kind (models.gpt.MLP_ACTIVATIONS) computing each
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# the block switches of models.gpt.GPTConfig that GPT-2's weights need (configs/model/gpt2_compat.yaml)
GPT2_BLOCKS = {"positions": "learned", "norm": "layer", "bias": True}
TOKENIZER_PROBE = "Hello world! Ünïcode, digits 12345 and\n  spaces:\tdone."
TOKENIZER_ADVICE = "train with its tokenizer: data/tokenizer=pretrained data.tokenizer.path={path}"


def resolve_folder(name_or_folder: str, argument: str = "train.init_from") -> Path:
    """A local folder as it is; else a Hub repository id, downloaded (config, weights, tokenizer)."""
    path = Path(os.path.expanduser(str(name_or_folder)))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_folder), allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repository, huggingface_hub missing
        raise ValueError(f"{argument}={name_or_folder} is not a folder and could not be downloaded from the Hugging "
                         f"Face Hub ({type(e).__name__}): give a local folder with {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE}") from None


class GPT2Weights:
    """A GPT-2-family model folder, its config checked on construction (a ValueError names the field)."""

    def __init__(self, name_or_folder: str, argument: str = "train.init_from"):
        self.argument = argument
        self.folder = resolve_folder(name_or_folder, argument)
        where = self.folder / CONFIG_FILE
        if not where.is_file() or not (self.folder / WEIGHTS_FILE).is_file():
            raise ValueError(f"{argument}={name_or_folder} needs {CONFIG_FILE} and {WEIGHTS_FILE} (a Hugging Face GPT-2 "
                             f"model folder); {self.folder} holds {sorted(p.name for p in self.folder.iterdir())}")
        try:
            config = json.loads(where.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(config, dict) or config.get("model_type") != "gpt2":
            found = config.get("model_type") if isinstance(config, dict) else type(config).__name__
            raise ValueError(f"{argument}: {where} has model_type {found!r}; attnlab loads GPT-2-family models "
                             "(model_type 'gpt2')")
        activation = config.get("activation_function", "gelu_new")
        if activation not in GPT2_ACTIVATIONS:
            raise ValueError(f"{argument}: {where} has activation_function {activation!r}; supported: "
                             f"{sorted(GPT2_ACTIVATIONS)}")
        for key, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                               ("add_cross_attention", False), ("tie_word_embeddings", True)):
            if config.get(key, supported) != supported:
                raise ValueError(f"{argument}: {where} has {key}={config[key]!r}; attnlab's GPT needs {supported}")
        width = config.get("n_embd", 768)
        inner = config.get("n_inner") or 4 * width
        self.fields = {
            "n_layer": config.get("n_layer", 12), "n_head": config.get("n_head", 12),
            "n_kv_head": config.get("n_head", 12), "d_model": width, "context": config.get("n_positions", 1024),
            "mlp": GPT2_ACTIVATIONS[activation], "mlp_ratio": inner / width,
            "norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
        }
        self.vocab_size = config.get("vocab_size", 50257)

    def model_fields(self) -> dict:
        """The model.* values the pretrained model fixes."""
        return dict(self.fields)

    def check_blocks(self, model_cfg) -> None:
        """Refuse a model config whose blocks differ from GPT-2's (learned positions, LayerNorm, biases)."""
        wrong = {key: model_cfg.get(key) for key, value in GPT2_BLOCKS.items() if model_cfg.get(key) != value}
        if wrong:
            raise ValueError(f"{self.argument} loads GPT-2 blocks; the model config has "
                             + ", ".join(f"model.{k}={v!r}" for k, v in wrong.items())
                             + ": use model=gpt2_compat")

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Refuse a tokenizer with more tokens than the pretrained vocabulary, or one that encodes a
        probe text unlike the folder's tokenizer.json (when the folder has one)."""
        path = self.folder / "tokenizer.json"
        advice = TOKENIZER_ADVICE.format(path=path if path.is_file() else "<the model's tokenizer.json>")
        if tokenizer.vocab_size > self.vocab_size:
            raise ValueError(f"{self.argument}: the data's tokenizer has {tokenizer.vocab_size} tokens, more than the "
                             f"pretrained vocabulary ({self.vocab_size}); {advice}")
        if path.is_file():
            from tokenizers import Tokenizer as RustTokenizer

            theirs = HFTokenizer(RustTokenizer.from_file(str(path)), kind="pretrained")
            if tokenizer.encode(TOKENIZER_PROBE) != theirs.encode(TOKENIZER_PROBE):
                raise ValueError(f"{self.argument}: the data's tokenizer ({describe_tokenizer(tokenizer)}) is not the "
                                 f"pretrained model's {path}; {advice}")

    def state_dict(self, cfg: GPTConfig) -> dict[str, torch.Tensor]:
        """GPT-2's tensors under models.gpt.GPT's names, for a GPT of config cfg (q/k/v as the first view)."""
        from safetensors.torch import load_file

        tensors = {name.removeprefix("transformer."): t for name, t in load_file(str(self.folder / WEIGHTS_FILE)).items()}
        q_dim = cfg.n_head * cfg.head_dim
        out = {"embed.weight": tensors.pop("wte.weight"), "position_embed.weight": tensors.pop("wpe.weight"),
               "norm.weight": tensors.pop("ln_f.weight"), "norm.bias": tensors.pop("ln_f.bias")}
        tensors.pop("lm_head.weight", None)  # tied to wte
        for i in range(cfg.n_layer):
            h, b = f"h.{i}.", f"blocks.{i}."
            for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
                for kind in ("weight", "bias"):
                    out[f"{b}{ours}.{kind}"] = tensors.pop(f"{h}{theirs}.{kind}")
            for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
                out[f"{b}{ours}.weight"] = tensors.pop(f"{h}{theirs}.weight").t()
                out[f"{b}{ours}.bias"] = tensors.pop(f"{h}{theirs}.bias")
            # c_attn: (width, 3 * width) as [q | k | v]; ours: [q1 | k1 | (q2 | k2) | v] rows
            qkv_w, qkv_b = tensors.pop(f"{h}attn.c_attn.weight").t(), tensors.pop(f"{h}attn.c_attn.bias")
            out[f"{b}attn.qkv.weight.first_view"], out[f"{b}attn.qkv.bias.first_view"] = qkv_w[:2 * q_dim], qkv_b[:2 * q_dim]
            out[f"{b}attn.qkv.weight.values"], out[f"{b}attn.qkv.bias.values"] = qkv_w[2 * q_dim:], qkv_b[2 * q_dim:]
            for buffer in ("attn.bias", "attn.masked_bias"):  # the causal-mask buffers of older checkpoints
                tensors.pop(f"{h}{buffer}", None)
        if tensors:
            raise ValueError(f"{self.folder / WEIGHTS_FILE} holds tensors a GPT-2 has not: {sorted(tensors)[:8]}")
        return out

    @torch.no_grad()
    def load_into(self, model: GPT) -> list[str]:
        """Copy the weights into `model` (sizes and shapes checked); returns what keeps its
        initialization (the attention variant's own parameters, which GPT-2 has not)."""
        cfg = model.cfg
        expected = {**self.fields, **GPT2_BLOCKS}
        wrong = [f"model.{k}={getattr(cfg, k)!r} (pretrained: {v!r})" for k, v in expected.items() if getattr(cfg, k) != v]
        if cfg.vocab_size < self.vocab_size:
            wrong.append(f"vocab_size {cfg.vocab_size} (pretrained: {self.vocab_size})")
        if wrong:
            raise ValueError(f"{self.argument}: the model does not fit the pretrained one: {', '.join(wrong)}")
        params = dict(model.named_parameters())
        loaded, kept = set(), []
        kv_rows = cfg.n_kv_head * cfg.head_dim
        for name, tensor in self.state_dict(cfg).items():
            target_name, part = name.rsplit(".", 1) if ".qkv." in name else (name, None)
            target = params[target_name]
            if part == "first_view":  # rows of the fused projection: q and k of the first view
                target = target[:tensor.shape[0]]
                if target_name.endswith("weight") and len(params[target_name]) - kv_rows > tensor.shape[0]:
                    kept.append(f"{target_name.removesuffix('.weight')} (second q/k view)")
            elif part == "values":
                target = target[len(target) - kv_rows:]
            elif name == "embed.weight":  # a vocabulary padded beyond GPT-2's keeps its extra rows
                target = target[:tensor.shape[0]]
            if target.shape != tensor.shape:
                raise ValueError(f"{self.argument}: {name} has shape {tuple(tensor.shape)} in {self.folder / WEIGHTS_FILE}, "
                                 f"the model's {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(target_name)
        kept += sorted(set(params) - loaded)
        log.info("%s: GPT-2 weights loaded from %s; %s keep their initialization", self.argument, self.folder,
                 kept or "no parameters")
        return kept
