"""eval.export folders in transformers: AutoModelForCausalLM (trust_remote_code: the folder's
modeling_attnlab.py) gives attnlab's logits for every attention variant, greedy `generate` the tokens
GPT.generate picks, and AutoTokenizer the ids of the attnlab tokenizer the model was trained with."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn  # noqa: E402
from data.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer, train_bpe  # noqa: E402
from eval import export  # noqa: E402
from models.gpt import GPT, AttnConfig, GPTConfig  # noqa: E402

GPT2_BLOCKS = {"positions": "learned", "norm": "layer", "bias": True, "mlp": "gelu_tanh", "norm_eps": 1e-5}


def trained_looking_gpt(name="softmax", vocab=300, **model_kw):
    """A tiny GPT whose weights are unlike any initialization (lambda, norms and biases included)."""
    cfg = GPTConfig(vocab_size=vocab, context=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    attn=AttnConfig(name=name, backend="reference"), **model_kw)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def load_in_transformers(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__name__ == "AttnlabForCausalLM" and not model.training
    return model


@pytest.mark.parametrize("name", attn.variant_names())
def test_transformers_gives_our_logits_for_every_variant(tmp_path, name):
    model = trained_looking_gpt(name)
    export.write_export(model, ByteTokenizer(), tmp_path)
    hf_model = load_in_transformers(tmp_path)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert ours.abs().max() > 0.5
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)  # fp32, the same code


def test_gpt2_blocks_logits_loss_and_greedy_generation(tmp_path):
    model = trained_looking_gpt("softcap_tanh", **GPT2_BLOCKS)
    export.write_export(model, ByteTokenizer(), tmp_path)
    hf_model = load_in_transformers(tmp_path)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        output = hf_model(ids, labels=ids)
        torch.testing.assert_close(output.logits, model(ids), rtol=1e-6, atol=1e-6)
        mean_loss = model(ids[:, :-1], targets=ids[:, 1:]) / ids[:, 1:].numel()
        torch.testing.assert_close(output.loss, mean_loss, rtol=1e-5, atol=1e-6)
        prompt = ids[:, :5]
        generated = hf_model.generate(prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(generated, model.generate(prompt, 6, temperature=0))


def test_a_right_padded_batch_scores_its_tokens_as_unpadded(tmp_path):
    model = trained_looking_gpt("sigmoid")
    export.write_export(model, ByteTokenizer(), tmp_path)
    hf_model = load_in_transformers(tmp_path)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        padded = hf_model(ids, attention_mask=mask).logits
        torch.testing.assert_close(padded[1, :7], model(ids[1:, :7])[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(padded[0], model(ids[:1])[0], rtol=1e-6, atol=1e-6)


def test_folders_with_the_lambda_held_by_the_layer_load_with_the_key_map(tmp_path):
    """An export whose weights name the differential lambda at the attention layer
    (`model.blocks.<i>.attn.lambda_vectors`, as the layer held it before attn.extras): attnlab's
    load_exported reads it as it is, transformers with LAYER_HELD_KEYS; both give the model's logits."""
    import json

    from safetensors.torch import load_file, save_file

    from models.modeling_attnlab import LAYER_HELD_KEYS

    model = trained_looking_gpt("diff_threshold")
    export.write_export(model, ByteTokenizer(), tmp_path)
    weights = tmp_path / export.WEIGHTS_FILE
    state = {name.replace(".attn.extras.", ".attn."): t for name, t in load_file(str(weights)).items()}
    assert "model.blocks.1.attn.lambda_vectors" in state
    save_file(state, str(weights), metadata={"format": "pt", "attnlab_format": export.EXPORT_FORMAT})
    config = json.loads((tmp_path / export.CONFIG_FILE).read_text())
    config["attnlab"]["weights"]["sha256"] = export._sha256_file(weights)
    (tmp_path / export.CONFIG_FILE).write_text(json.dumps(config))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True,
                                                                 key_mapping=LAYER_HELD_KEYS)
    ours, _ = export.load_exported(tmp_path)
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(hf_model(ids).logits, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(ours(ids), want)


def tokenizer_of(kind):
    import tiktoken

    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer.fit(["anna sees the cat and bert likes it."])
    if kind == "bpe":
        return train_bpe(["anna sees the cat and bert likes it. "] * 40, vocab_size=280)
    ranks = {bytes([i]): i for i in range(256)} | {b"an": 256, b"na": 257, b"ana": 258, b"nan": 259}
    return TiktokenTokenizer(tiktoken.Encoding(name="tiny", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                                               special_tokens={"<|endoftext|>": 260}))


@pytest.mark.parametrize("kind", ["byte", "char", "bpe", "tiktoken"])
def test_auto_tokenizer_gives_the_attnlab_tokenizers_ids(tmp_path, kind):
    tokenizer = tokenizer_of(kind)
    export.write_export(trained_looking_gpt(vocab=300), tokenizer, tmp_path)
    # transformers 5 reads config.json (whose auto_map names the modeling file) before the tokenizer
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    for text in ["anna sees the banana, nan", "Ünïcode  and\n\ttabs 123 ~ zebra"]:
        ids = tokenizer.encode(text)
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
        assert hf_tokenizer.decode(ids) == tokenizer.decode(ids)
    assert hf_tokenizer.eos_token_id == tokenizer.end_of_text_id
