"""attnlab's GPT as a transformers model: the modeling file of every `python -m eval.export` folder.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)

eval.export copies this file into the folder, and config.json's `auto_map` names its two classes:
this file is the one piece of code an export holds, and transformers runs it only with
`trust_remote_code=True`. It needs transformers >= 5 and the attnlab package installed (`pip install -e .` in a clone, or
its wheel): the model is attnlab's `models.gpt.GPT`, whose attention layer calls `attn.attention`,
the PyTorch reference backend on CPU and the fused Triton kernels on CUDA (config.attn["backend"]
"auto"; "reference" or "triton" force one).

`AttnlabConfig` holds models.gpt.GPTConfig's fields as attributes (the usual names map onto them:
hidden_size = d_model, num_hidden_layers = n_layer, num_attention_heads = n_head,
num_key_value_heads = n_kv_head, max_position_embeddings = context). `AttnlabForCausalLM` keeps the
GPT as `.model` (weights named model.<GPT's name>; the head is tied to the embedding).

forward(input_ids, attention_mask, labels) returns the logits (and with labels the mean
next-token cross-entropy, -100 ignored). An attention_mask with zeros (a padded batch) becomes the
GPT's segment ids: padded positions are neither attended to nor attend. Positions count from each
row's first column, so right padding is exact; with left padding a RoPE model scores as without
padding (rotations are relative), a model with learned positions does not.
`generate` re-encodes the last `context` tokens for every new token (transformers' KV cache is not
used); `python -m eval.generate` decodes with attnlab's static KV cache instead.
"""

from __future__ import annotations

from dataclasses import asdict, fields

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from models.gpt import GPT, AttnConfig, GPTConfig, RoPE

GPT_FIELDS = tuple(f.name for f in fields(GPTConfig))
# transformers' key_mapping for folders whose attention layers hold their family's parameters
# themselves (`model.blocks.0.attn.lambda_vectors`, where the GPT has `model.blocks.0.attn.extras.lambda_vectors`):
# from_pretrained(folder, trust_remote_code=True, key_mapping=LAYER_HELD_KEYS). transformers sets the
# weights by name, past the GPT's load_state_dict hook that maps these keys for attnlab's own loaders.
LAYER_HELD_KEYS = {r"\.attn\.([^.]+)$": r".attn.extras.\1"}


class AttnlabConfig(PreTrainedConfig):
    model_type = "attnlab_gpt"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "context"}

    def __init__(self, **kwargs):
        for name, default in asdict(GPTConfig()).items():
            kwargs.setdefault(name, default)
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)

    def gpt_config(self) -> GPTConfig:
        model = {name: getattr(self, name) for name in GPT_FIELDS}
        return GPTConfig(**{**model, "attn": AttnConfig(**model["attn"])})


class AttnlabForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnlabConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}
    _no_split_modules = ["Block"]

    def __init__(self, config: AttnlabConfig):
        super().__init__(config)
        self.model = GPT(config.gpt_config())
        self.post_init()

    def _init_weights(self, module):
        """RoPE's tables computed again (a loaded model is materialized from the meta device and the
        tables are in no file); the weights are GPT's own initialization or the file's."""
        if isinstance(module, RoPE):
            module.reset_tables()

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.head

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        segment_ids = None
        if attention_mask is not None and not bool(attention_mask.all()):
            segment_ids = attention_mask.to(torch.int32)  # 1: a token (history), 0: padding
        logits = self.model(input_ids, segment_ids=segment_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs) -> dict:
        """The whole sequence so far, cropped to the training context (no KV cache)."""
        context = self.config.context
        inputs = {"input_ids": input_ids[:, -context:]}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[:, -context:]
        return inputs
