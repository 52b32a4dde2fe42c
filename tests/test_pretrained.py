"""Starting from pretrained GPT-2 (models/pretrained.py, train.init_from): a tiny GPT2LMHeadModel
saved with save_pretrained in tmp_path (offline) is loaded into model=gpt2_compat and gives
transformers' logits with softmax attention; with another variant it fine-tunes through train.py."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from training import train  # noqa: E402
from models.gpt import GPT  # noqa: E402
from models.lit import gpt_config_from_dict  # noqa: E402
from models.pretrained import GPT2Weights  # noqa: E402
from runs.checkpoints import load_checkpoint  # noqa: E402
from train_helpers import compose_cfg, run_train_py, tiny_overrides, write_corpus  # noqa: E402

VOCAB, CONTEXT = 256, 32  # the byte tokenizer's vocabulary


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """(folder, model): a tiny random GPT-2 (weights unlike any init, biases included) saved as HF does."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)
    return folder, model


def pretrained_model(folder, run_dir, *overrides):
    """The GPT train.py builds with model=gpt2_compat train.init_from=folder, weights loaded."""
    cfg = compose_cfg(tiny_overrides(run_dir, run_dir / "corpus.txt", **{"model": "gpt2_compat",
                                                                         "train.init_from": str(folder)})
                      + list(overrides))
    weights = train.pretrained_weights(cfg)
    model = GPT(gpt_config_from_dict({**train.model_config(cfg), "vocab_size": weights.vocab_size})).eval()
    return model, weights.load_into(model)


def test_softmax_gives_transformers_logits(gpt2_folder, tmp_path):
    folder, hf_model = gpt2_folder
    model, kept = pretrained_model(folder, tmp_path, "attn=softmax", "attn.backend=reference")
    assert kept == [] and model.cfg.d_model == 32 and model.cfg.context == CONTEXT and model.cfg.mlp == "gelu_tanh"
    ids = torch.randint(0, VOCAB, (3, CONTEXT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert theirs.abs().max() > 1 and torch.allclose(ours, theirs, atol=2e-5, rtol=0)


def test_a_variant_keeps_what_gpt2_has_not_at_its_initialization(gpt2_folder, tmp_path):
    folder, hf_model = gpt2_folder
    model, kept = pretrained_model(folder, tmp_path, "attn=diff_threshold", "attn.backend=reference")
    assert kept == ["blocks.0.attn.qkv (second q/k view)", "blocks.1.attn.qkv (second q/k view)",
                    "blocks.0.attn.extras.lambda_vectors", "blocks.0.attn.head_norm.weight",
                    "blocks.1.attn.extras.lambda_vectors", "blocks.1.attn.head_norm.weight"]
    width = 32
    c_attn = hf_model.transformer.h[1].attn.c_attn.weight.t()  # [q | k | v] rows
    qkv = model.blocks[1].attn.qkv.weight  # [q1 | k1 | q2 | k2 | v] rows
    assert torch.equal(qkv[:2 * width], c_attn[:2 * width]) and torch.equal(qkv[-width:], c_attn[-width:])
    assert not torch.equal(qkv[2 * width:4 * width], c_attn[:2 * width])


def test_sigmoid_fine_tunes_from_gpt2_through_train_py(gpt2_folder, tmp_path):
    folder, hf_model = gpt2_folder
    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    args = tiny_overrides(tmp_path, corpus, **{
        "model": "gpt2_compat", "train.init_from": str(folder), "attn": "sigmoid", "train.max_steps": 3,
        "train.val_every": 3, "train.lr": 1e-4, "train.warmup_steps": 0,
    })
    proc = run_train_py([a for a in args if not a.startswith("model.")], cwd=tmp_path / "cwd")
    assert "keep their initialization" in proc.stdout + proc.stderr
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 3 and results["variant"] == "sigmoid" and results["val_loss"] < 8
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["state_dict"]
    # three small steps from GPT-2's weights: still near them (a fresh init is nowhere near)
    wpe = hf_model.transformer.wpe.weight
    assert (state["model.position_embed.weight"] - wpe).abs().max() < 5e-3 < (wpe.abs().max())
    assert not torch.equal(state["model.position_embed.weight"], wpe)  # and trained


def test_wrong_models_and_folders_are_refused_in_one_line(gpt2_folder, tmp_path):
    folder, _ = gpt2_folder
    with pytest.raises(ValueError, match=r"model\.positions='rope'.*use model=gpt2_compat"):
        train.pretrained_weights(compose_cfg(tiny_overrides(tmp_path, tmp_path / "c.txt",
                                                            **{"train.init_from": str(folder)})))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"train.init_from=.*needs config.json and model.safetensors"):
        GPT2Weights(str(empty))
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="model_type 'llama'; attnlab loads GPT-2-family models"):
        GPT2Weights(str(empty))


def test_a_tokenizer_unlike_the_pretrained_models_is_refused(gpt2_folder, tmp_path):
    from data.tokenizers import ByteTokenizer, train_bpe

    folder, _ = gpt2_folder
    weights = GPT2Weights(str(folder))
    weights.check_tokenizer(ByteTokenizer())  # no tokenizer.json in the folder: the vocabulary fits
    with pytest.raises(ValueError, match=r"\d+ tokens, more than the pretrained vocabulary \(256\).*data.tokenizer.path="):
        weights.check_tokenizer(train_bpe(["anna sees the cat. "] * 40, vocab_size=300))
    with_tokenizer = tmp_path / "with_tokenizer"
    with_tokenizer.mkdir()
    (with_tokenizer / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (with_tokenizer / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    bpe = train_bpe(["anna sees the cat. "] * 40, vocab_size=280)
    (with_tokenizer / "tokenizer.json").write_text(bpe.to_json())
    GPT2Weights(str(with_tokenizer)).check_tokenizer(bpe)
    with pytest.raises(ValueError, match="is not the pretrained model's"):
        GPT2Weights(str(with_tokenizer)).check_tokenizer(ByteTokenizer())
