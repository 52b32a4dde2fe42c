"""Every checkpoint carries its tokenizer; the eval commands use it and refuse data of another tokenizer."""

import json
import re
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir

from data.tokenizers import ByteTokenizer, CharTokenizer, tokenizer_from_record, tokenizer_record
from eval import generate, perplexity
from runs.checkpoints import load_checkpoint
from runs.model import load_run
from train_helpers import CONFIG_DIR, run_command, train_tiny_run, write_corpus


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("tokenizer_run"))


def eval_cfg(name, ckpt, *extra):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(f"eval/{name}", overrides=[f"ckpt={ckpt}", "wandb.enabled=false", *extra])


def test_training_writes_the_tokenizer_into_every_checkpoint(byte_run):
    for name in ("best.ckpt", "last.ckpt"):
        ckpt = load_checkpoint(byte_run / "checkpoints" / name)  # weights_only=True
        assert ckpt["tokenizer"] == tokenizer_record(ByteTokenizer())
    run = load_run(byte_run / "checkpoints" / "best.ckpt")
    assert run.tokenizer.describe() == ByteTokenizer().describe()
    assert run.describe()["tokenizer"]["hash"] == ByteTokenizer().hash
    assert "tokenizer" not in run.hparams  # kept out of hparams.yaml


def test_generate_needs_no_data_config_for_a_bare_checkpoint(byte_run, tmp_path):
    bare = tmp_path / "elsewhere" / "model.ckpt"
    bare.parent.mkdir()
    shutil.copy(byte_run / "checkpoints" / "best.ckpt", bare)
    texts = generate.run_generate(eval_cfg("generate", bare, "prompt=anna", "max_new_tokens=5", "temperature=0"))
    assert len(texts) == 1 and texts[0].startswith("anna") and len(texts[0].encode()) == len(b"anna") + 5


def test_a_data_config_with_another_tokenizer_is_refused_naming_both(byte_run, tmp_path):
    corpus = write_corpus(tmp_path / "other.txt", lines=100, seed=3)
    other = ["data=text", f"data.source.path={corpus}", "data/tokenizer=char",
             f"cache_dir={tmp_path / 'cache'}"]
    byte = ByteTokenizer()
    for name, run in (("perplexity", perplexity.run_perplexity), ("generate", generate.run_generate)):
        with pytest.raises(ValueError, match="data/tokenizer mismatch") as error:
            run(eval_cfg(name, byte_run, "split=val", "max_tokens=64", "contexts=[8]", *other)
                if name == "perplexity" else eval_cfg(name, byte_run, "prompt=anna", *other))
        message = str(error.value)
        assert f"checkpoint's tokenizer is kind=byte vocab=256 hash={byte.hash[:16]}" in message
        # refused before any work: the char tokenizer of the other corpus is not trained
        assert "data config's is a kind=char tokenizer not trained yet (evaluating would train one" in message
        assert not (tmp_path / "cache" / "tokenizers").exists()
    # the same tokenizer on other data is fine
    same = ["data=text", f"data.source.path={corpus}", "data/tokenizer=byte",
            f"cache_dir={tmp_path / 'cache'}", "split=val", "contexts=[8]", f"out={tmp_path / 'ppl.json'}"]
    result = perplexity.run_perplexity(eval_cfg("perplexity", byte_run, *same))[0]
    assert result["results"][0]["tokens"] > 0 and result["model"]["tokenizer"]["kind"] == "byte"


def test_a_data_config_with_another_bpe_is_refused_before_a_tokenizer_is_trained(tmp_path):
    """`python -m eval.perplexity ckpt=<bpe run> data=... data.tokenizer.vocab_size=<another>` is refused in
    one error line before any work: no BPE trained, nothing tokenized."""
    run = train_tiny_run(tmp_path, **{"data/tokenizer": "bpe", "data.tokenizer.vocab_size": 300})
    fresh_cache = tmp_path / "fresh_cache"
    done = run_command(["-m", "eval.perplexity", f"ckpt={run}", "data=text", f"data.source.path={tmp_path / 'corpus.txt'}",
                        "data/tokenizer=bpe", "data.tokenizer.vocab_size=400", f"cache_dir={fresh_cache}"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.fullmatch(r"error: data/tokenizer mismatch: the checkpoint's tokenizer is kind=bpe vocab=\d+ hash=\w+, the "
                        r"data config's is a kind=bpe tokenizer not trained yet \(evaluating would train one on its "
                        r"corpus\); .*", done.stderr.strip()), done.stderr[-3000:]
    assert not fresh_cache.exists() or not list(fresh_cache.rglob("*.json"))


def test_a_tampered_tokenizer_record_is_refused(byte_run, tmp_path):
    ckpt = load_checkpoint(byte_run / "checkpoints" / "best.ckpt")
    char = tokenizer_record(CharTokenizer("abc"))
    ckpt["tokenizer"] = {**char, "content": CharTokenizer("abd").to_json()}
    path = tmp_path / "tampered.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=rf"checkpoint {path}: the tokenizer rebuilt from its content .* is not the recorded one"):
        load_run(path)
    ckpt["tokenizer"] = {**char, "format": "pickle"}
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match="unknown tokenizer format 'pickle'"):
        load_run(path)
    ckpt["tokenizer"] = tokenizer_record(CharTokenizer("".join(chr(c) for c in range(40, 140))))
    torch.save(ckpt, path)  # 101 tokens for a model with 256 ids is fine; more ids than the model is not
    assert load_run(path).tokenizer.vocab_size == 101
    ckpt["tokenizer"] = tokenizer_record(CharTokenizer("".join(chr(c) for c in range(40, 400))))
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=r"its tokenizer has 361 tokens, more than the model's vocabulary \(256\)"):
        load_run(path)


def test_records_reject_malformed_content():
    # the message names the keys it got, or the type of a record that is no mapping
    with pytest.raises(ValueError, match=r"must have exactly the keys .*, got \['kind'\]$"):
        tokenizer_from_record({"kind": "byte"}, "here")
    with pytest.raises(ValueError, match=r"must have exactly the keys .*, got int$"):
        tokenizer_from_record(5, "here")
    record = tokenizer_record(CharTokenizer("abc"))
    with pytest.raises(ValueError, match="here: the attnlab-char tokenizer content cannot be read"):
        tokenizer_from_record({**record, "content": "{not json"}, "here")
    payload = json.loads(record["content"])
    rebuilt = tokenizer_from_record({**record, "content": json.dumps(payload, indent=2)}, "here")
    assert rebuilt.hash == CharTokenizer("abc").hash  # formatting does not matter, content does


def test_the_runs_own_data_is_tokenized_with_the_checkpoints_tokenizer(tmp_path, monkeypatch):
    """A BPE run evaluates on its own data config with the tokenizer its checkpoint holds: the
    tokenizer and token caches gone (another machine) and BPE training now giving another
    vocabulary (as a later attnlab may), perplexity and attention stats still run on the tokens
    the model was trained on, without training a tokenizer; data= with another tokenizer is
    refused as before."""
    from data import tokenizers as tokenizers_module
    from eval import attention_stats

    run = train_tiny_run(tmp_path, **{"data/tokenizer": "bpe", "data.tokenizer.vocab_size": 300})
    recorded = load_run(run / "checkpoints" / "best.ckpt").tokenizer
    assert recorded.kind == "bpe" and recorded.end_of_text_id is not None
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setattr(tokenizers_module, "train_bpe", lambda *a, **k: pytest.fail("trained a tokenizer"))
    result = perplexity.run_perplexity(eval_cfg("perplexity", run, "split=val", "contexts=[16]"))[0]
    assert result["results"][0]["tokens"] > 0 and result["model"]["tokenizer"]["hash"] == recorded.hash
    stats = attention_stats.run_attention_stats(eval_cfg("attention_stats", run, "num_tokens=32", "plot=false"))[0]
    assert stats["tokens"] == 32
    cached = [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()]
    assert len(cached) == 1 and json.loads((cached[0] / "manifest.json").read_text())["tokenizer"]["hash"] == recorded.hash
    with pytest.raises(ValueError, match="data/tokenizer mismatch"):
        perplexity.run_perplexity(eval_cfg("perplexity", run, "data=text", f"data.source.path={tmp_path / 'corpus.txt'}",
                                           "data/tokenizer=byte", "split=val", "contexts=[16]"))


def test_a_resumed_run_keeps_its_checkpoints_tokenizer(tmp_path, monkeypatch):
    """Resuming tokenizes with the checkpoint's tokenizer, not one the data config would train now
    (the tokenizer cache gone and BPE training changed): the run continues on its own tokens. A
    resume with another tokenizer kind is refused, naming both kinds."""
    from training import train
    from data import tokenizers as tokenizers_module
    from train_helpers import compose_cfg, tiny_overrides

    corpus = write_corpus(tmp_path / "corpus.txt", lines=300)
    settings = {"data/tokenizer": "bpe", "data.tokenizer.vocab_size": 300, "train.max_steps": 4, "train.val_every": 2,
                "model.context": 16}
    first = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **settings, **{"train.stop_at_step": 2})))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    recorded = tokenizer_from_record(load_checkpoint(last)["tokenizer"], "test")
    assert first["steps"] == 2
    shutil.rmtree(tmp_path / "cache" / "tokenizers")
    monkeypatch.setattr(tokenizers_module, "train_bpe", lambda *a, **k: pytest.fail("trained a tokenizer"))
    resumed = train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **settings, ckpt_path=str(last))))
    assert resumed["steps"] == 4
    assert tokenizer_from_record(load_checkpoint(last)["tokenizer"], "test").hash == recorded.hash
    with pytest.raises(ValueError, match=r"data\.tokenizer\.kind is 'byte', but the checkpoint's tokenizer .* is of "
                                         r"kind 'bpe'.*data/tokenizer=bpe"):
        byte = {key: value for key, value in settings.items() if not key.startswith("data.tokenizer")}
        train.run(compose_cfg(tiny_overrides(tmp_path, corpus, **{**byte, "data/tokenizer": "byte"}, ckpt_path=str(last))))
