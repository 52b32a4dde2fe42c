"""eval.export: a checkpoint as a Hugging Face model folder (safetensors, config.json, tokenizer files),
rebuilt by load_exported from that folder alone with the checkpoint model's logits (bitwise, CPU
reference backend). tests/test_hf_export.py loads the same folders with transformers."""

import json
import sys
from dataclasses import asdict

import pytest
import torch
from hydra import compose, initialize_config_dir

from data.tokenizers import ByteTokenizer, TiktokenTokenizer, tokenizer_record, train_bpe
from eval import export
from runs.model import load_run
from runs.run import Run
from models.gpt import GPT, AttnConfig, GPTConfig
from train_helpers import CONFIG_DIR, train_tiny_run


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A 2-step training run with a char tokenizer (trained on the corpus, recorded in the checkpoint)."""
    return train_tiny_run(tmp_path_factory.mktemp("export_run"), **{"data/tokenizer": "char"})


def export_cfg(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("eval/export", overrides=list(overrides))


def tiny_gpt(name="softmax", vocab=300, **attn_kw):
    cfg = GPTConfig(vocab_size=vocab, context=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    attn=AttnConfig(name=name, backend="reference", **attn_kw))
    torch.manual_seed(0)
    return GPT(cfg).eval()


def save_checkpoint(path, model, tokenizer):
    """A checkpoint as LitGPT writes one: weights under model., the model config, the tokenizer record."""
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"model": asdict(model.cfg), "optim": {}},
            "tokenizer": tokenizer_record(tokenizer)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def test_export_rebuilds_the_checkpoints_model_and_tokenizer_exactly(char_run, tmp_path):
    out = export.run_export(export_cfg(f"ckpt={char_run}", f"out={tmp_path / 'export'}", "backend=reference"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "modeling_attnlab.py", "tokenizer.attnlab.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    record = config["attnlab"]
    assert record["format"] == export.EXPORT_FORMAT and config["context"] == 16 and config["model_type"] == "attnlab_gpt"
    assert record["tokenizer"]["kind"] == "char" and record["source"]["variant"] == "softmax"

    run = load_run(Run(char_run).checkpoint(), backend="reference")
    model, tokenizer = export.load_exported(out, backend="reference")
    assert tokenizer.hash == run.tokenizer.hash and tokenizer.kind == "char"
    text = "anna sees the cat"
    assert tokenizer.encode(text) == run.tokenizer.encode(text) and tokenizer.decode(tokenizer.encode(text)) == text
    ids = torch.randint(0, model.cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), run.model(ids))
    assert not model.training and model.head.weight is model.embed.weight  # the tie survives the export


@pytest.mark.parametrize("kind", ["byte", "bpe", "tiktoken"])
def test_every_tokenizer_format_round_trips(tmp_path, kind):
    import tiktoken

    if kind == "byte":
        tokenizer = ByteTokenizer()
    elif kind == "bpe":
        tokenizer = train_bpe(["anna sees the cat and bert likes it. "] * 40, vocab_size=280)
    else:
        ranks = {bytes([i]): i for i in range(256)} | {b"an": 256, b"na": 257}
        tokenizer = TiktokenTokenizer(tiktoken.Encoding(name="tiny", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                                                        special_tokens={"<|end|>": 258}))
    model = tiny_gpt(vocab=300)
    ckpt = save_checkpoint(tmp_path / "model.ckpt", model, tokenizer)
    out = export.run_export(export_cfg(f"ckpt={ckpt}", f"out={tmp_path / 'export'}"))
    loaded_model, loaded = export.load_exported(out, backend="reference")
    text = "anna sees the cat <|end|>"
    assert loaded.describe() == tokenizer.describe() and loaded.encode(text) == tokenizer.encode(text)
    if kind == "bpe":  # a plain Hugging Face tokenizer.json, usable by other tools
        from tokenizers import Tokenizer

        assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == tokenizer.encode(text)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded_model(ids), model(ids))


@pytest.mark.parametrize("name", ["alsc", "diff_threshold"])
def test_variant_parameters_survive_the_export(tmp_path, name):
    params = {"alsc": {"cap": 5.0, "knee": 0.3}}.get(name, {})
    model = tiny_gpt(name, params=params)
    with torch.no_grad():  # weights unlike any initialization, lambda parameters included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / "export"
    export.write_export(model, ByteTokenizer(), out)
    loaded, _ = export.load_exported(out)
    assert loaded.cfg == model.cfg
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_out_folder_rules(tmp_path):
    ckpt = save_checkpoint(tmp_path / "model.ckpt", tiny_gpt(vocab=256), ByteTokenizer())
    with pytest.raises(ValueError, match=r"out=\.\.\. is required"):
        export.run_export(export_cfg(f"ckpt={ckpt}"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"out={busy} is not empty; pass overwrite=true"):
        export.run_export(export_cfg(f"ckpt={ckpt}", f"out={busy}"))
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    export.run_export(export_cfg(f"ckpt={ckpt}", f"out={busy}", "overwrite=true"))
    assert (busy / "notes.txt").read_text() == "mine" and (busy / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="overwrite must be true or false"):
        export.run_export(export_cfg(f"ckpt={ckpt}", f"out={busy}", "overwrite=maybe"))
    with pytest.raises(ValueError, match="is a file, not a folder"):
        export.run_export(export_cfg(f"ckpt={ckpt}", f"out={ckpt}"))


def test_tampered_or_foreign_export_folders_are_refused(tmp_path):
    out = tmp_path / "export"
    export.write_export(tiny_gpt(vocab=256), ByteTokenizer(), out)
    config = json.loads((out / "config.json").read_text())

    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[:-4] + bytes(4))
    with pytest.raises(ValueError, match=r"model.safetensors is not the file the export wrote"):
        export.load_exported(out)
    (out / "model.safetensors").write_bytes(weights)

    record = config["attnlab"]
    for changed, match in [
        ({"attnlab": {**record, "weights": {**record["weights"], "file": "../model.ckpt"}}},
         "must be a file name inside the export folder"),
        ({"attnlab": {**record, "format": "something-else"}}, "attnlab.format must be 'attnlab-gpt-export-v2'"),
        ({"attn": {"name": "flash_magic"}}, "does not register"),
        ({"d_model": 64}, "weights do not fit"),
        ({"attnlab": {**record, "tokenizer": {**record["tokenizer"], "hash": "0" * 64}}}, "is not the recorded one"),
    ]:
        (out / "config.json").write_text(json.dumps({**config, **changed}))
        with pytest.raises(ValueError, match=match):
            export.load_exported(out)
    with pytest.raises(FileNotFoundError, match="not an attnlab export folder"):
        export.load_exported(tmp_path / "nowhere")


def test_folders_of_the_first_export_format_still_load(tmp_path):
    """attnlab-gpt-export-v1: the GPT config under "model", the weights under GPT's own names."""
    from safetensors.torch import save_file

    model, out = tiny_gpt(vocab=256), tmp_path / "v1"
    export.write_export(model, ByteTokenizer(), out)
    record = json.loads((out / "config.json").read_text())["attnlab"]
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"},
              str(out / "model.safetensors"))
    record["weights"]["sha256"] = export._sha256_file(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**record, "format": "attnlab-gpt-export-v1",
                                                  "model": asdict(model.cfg)}))
    loaded, _ = export.load_exported(out)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_a_checkpoint_without_a_tokenizer_record_takes_the_data_config(char_run, tmp_path):
    """Checkpoints that predate the record: the run's data config gives the tokenizer."""
    from runs.checkpoints import load_checkpoint

    run = tmp_path / "old_run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text((char_run / ".hydra" / "config.yaml").read_text())
    ckpt = load_checkpoint(Run(char_run).checkpoint())
    recorded = ckpt.pop("tokenizer")
    torch.save(ckpt, run / "checkpoints" / "best.ckpt")
    out = export.run_export(export_cfg(f"ckpt={run}", f"out={tmp_path / 'export'}"))
    assert export.load_exported(out)[1].hash == recorded["hash"]


def test_command_line_error_is_one_line(tmp_path, monkeypatch, capsys):
    ckpt = save_checkpoint(tmp_path / "model.ckpt", tiny_gpt(vocab=256), ByteTokenizer())
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    monkeypatch.setattr(sys, "argv", ["eval.export", f"ckpt={ckpt}", f"out={tmp_path / 'busy'}"])
    with pytest.raises(SystemExit) as exit_info:
        export.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: out=" in err and "overwrite=true" in err and "Traceback" not in err

