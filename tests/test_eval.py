"""eval/: strided perplexity, bits per byte, attention statistics, generation, checkpoint errors.

Core functions are checked against hand-computed values on models with known output
distributions; the commands run end to end on a real (tiny) training run made by train.run.
"""

import json
import logging
import math
import sys
import types
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import attn
from eval import attention_stats, common, generate, perplexity
from runs.model import LoadedRun, load_run
from runs.run import Run
from models import attention_diagnostics
from eval.perplexity import Window, bits_per_byte, score_tokens, scoring_windows
from models.gpt import GPT, AttnConfig, GPTConfig
from train_helpers import CONFIG_DIR, train_tiny_run, write_corpus

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- windows


def test_windows_by_hand_stride_below_and_equal_to_context():
    # 10 tokens = 9 targets, context 4: the first window scores targets 1..4 in full
    assert scoring_windows(10, 4, 2) == [Window(0, 4, 4), Window(2, 4, 2), Window(4, 4, 2), Window(5, 4, 1)]
    assert scoring_windows(10, 4, 4) == [Window(0, 4, 4), Window(4, 4, 4), Window(5, 4, 1)]
    # a text shorter than the context is one window scored in full
    assert scoring_windows(3, 8, 4) == [Window(0, 2, 2)]


@pytest.mark.parametrize("n,context,stride", [(2, 1, 1), (50, 7, 3), (64, 8, 8), (65, 8, 1), (100, 16, 5), (9, 16, 16)])
def test_windows_score_each_target_once_with_max_left_context(n, context, stride):
    scored = []
    for i, w in enumerate(scoring_windows(n, context, stride)):
        assert 0 <= w.start and w.start + w.length + 1 <= n
        assert w.length == min(context, n - 1)
        targets = list(range(w.start + w.length - w.scored + 1, w.start + w.length + 1))
        if i > 0:
            assert w.scored <= stride
        scored += targets
    assert sorted(scored) == list(range(1, n)), "each target exactly once"


@pytest.mark.parametrize("bad", [dict(context=0, stride=1), dict(context=4, stride=0), dict(context=4, stride=5)])
def test_windows_reject_bad_arguments(bad):
    with pytest.raises(ValueError, match="context|stride"):
        scoring_windows(10, **bad)


# ---------------------------------------------------------------------------- perplexity values


@pytest.mark.parametrize("context,stride", [(8, 3), (8, 8)])
def test_uniform_model_perplexity_is_vocab_size(context, stride):
    vocab = 37
    tokens = np.random.default_rng(0).integers(0, vocab, 101)
    out = score_tokens(lambda ids: torch.zeros(*ids.shape, vocab, dtype=torch.float64), tokens, context, stride, batch_size=3)
    assert out["tokens"] == 100
    assert math.exp(out["nats_per_token"]) == pytest.approx(vocab, rel=1e-12)


def bigram_logits(table):
    log_table = torch.log(torch.as_tensor(table, dtype=torch.float64))
    return lambda ids: log_table[ids]  # position p predicts token p + 1 from token p only


def test_bigram_model_on_a_tiny_text_by_hand():
    # vocab {a: 0, b: 1}; P(next | a) = (.5, .5), P(next | b) = (.25, .75); text "aabba"
    table = [[0.5, 0.5], [0.25, 0.75]]
    tokens = [0, 0, 1, 1, 0]  # transitions a->a, a->b, b->b, b->a
    expected_ppl = (0.5 * 0.5 * 0.75 * 0.25) ** (-1 / 4)  # = 2.1606...
    for context, stride in [(2, 1), (2, 2), (3, 2), (4, 4)]:
        out = score_tokens(bigram_logits(table), tokens, context, stride)
        assert math.exp(out["nats_per_token"]) == pytest.approx(expected_ppl, rel=1e-12)
        assert out["tokens"] == 4


@pytest.mark.parametrize("context,stride", [(6, 2), (6, 6)])
def test_bigram_model_matches_direct_sum(context, stride):
    text = "the cat sat on the mat and the rat ate the hat"
    vocab = sorted(set(text))
    ids = [vocab.index(c) for c in text]
    rng = np.random.default_rng(1)
    table = rng.dirichlet(np.ones(len(vocab)), size=len(vocab))
    direct = -np.mean([math.log(table[a, b]) for a, b in zip(ids[:-1], ids[1:])])
    out = score_tokens(bigram_logits(table), ids, context, stride, batch_size=2)
    assert out["nats_per_token"] == pytest.approx(direct, rel=1e-12)


def cache_model(vocab):
    """Predicts from counts of the tokens so far in its window: depends on the left context."""
    def logits(ids):
        counts = torch.nn.functional.one_hot(ids, vocab).double().cumsum(1)
        return torch.log1p(counts)
    return logits


@pytest.mark.parametrize("context,stride", [(5, 2), (5, 5), (5, 1)])
def test_left_context_is_the_window_defined_one(context, stride):
    """Brute force with a closed form of each target's context: target t <= context sees
    tokens [0, t); later targets belong to the window ending at
    end = min(context + stride * ceil((t - context) / stride), n - 1), which starts at end - context."""
    vocab, n = 4, 23
    tokens = np.random.default_rng(2).integers(0, vocab, n)
    total = 0.0
    for t in range(1, n):
        if t <= context:
            start = 0
        else:
            end = min(context + stride * math.ceil((t - context) / stride), n - 1)
            start = end - context
        seen = tokens[start:t]
        p = (1 + np.sum(seen == tokens[t])) / (vocab + len(seen))
        total -= math.log(p)
    out = score_tokens(cache_model(vocab), tokens, context, stride, batch_size=2)
    assert out["nats"] == pytest.approx(total, rel=1e-12)


def test_bits_per_byte_formula():
    assert bits_per_byte(2.0, 1000, 4000) == pytest.approx(2.0 * 1000 / 4000 / math.log(2))
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 10, 0)


class FakeTokenizer:
    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


class FakeData:
    """The TokenDataModule surface eval/ uses, over a fixed token array."""

    def __init__(self, tokens, num_bytes, vocab_size):
        self.tokens, self.num_bytes, self.vocab_size = np.asarray(tokens), num_bytes, vocab_size
        self.tokenizer = FakeTokenizer()

    def token_ids(self, split):
        return self.tokens

    def split_stats(self, split):
        return {"tokens": len(self.tokens), "bytes": self.num_bytes}

    def unigram_bpb(self, split):
        return 8.0


def tiny_gpt(name="softmax", vocab=64, context=16, **attn_kw):
    params = {"softcap_tanh": {"cap": 5.0}, "softcap_softsign": {"cap": 5.0}, "alsc": {"cap": 5.0}}.get(name, {})
    cfg = GPTConfig(vocab_size=vocab, context=context, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    attn=AttnConfig(name=name, backend="reference", params=params, **attn_kw))
    torch.manual_seed(0)
    return GPT(cfg).eval()


def loaded(model, path=Path("/nowhere/best.ckpt")):
    run = Run(path.parent.parent)
    run.config, run.results = None, {"seed": 3}
    return LoadedRun(model=model, model_config=model.cfg, checkpoint_path=path, hparams={}, run=run, global_step=1,
                     tokens_seen=10)


def ppl_cfg(**kw):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("eval/perplexity", overrides=["ckpt=x", "wandb.enabled=false"] + [f"{k}={v}" for k, v in kw.items()])


def test_evaluate_run_contexts_strides_and_bpb():
    model = tiny_gpt(context=8)
    tokens = np.random.default_rng(3).integers(0, 64, 200)
    data = FakeData(tokens, num_bytes=700, vocab_size=64)
    result = perplexity.evaluate_run(loaded(model), ppl_cfg(), data, torch.device("cpu"))
    rows = result["results"]
    assert [r["context"] for r in rows] == [8, 16, 32]  # 1x, 2x, 4x the training context
    assert [r["stride"] for r in rows] == [4, 8, 16]
    with torch.no_grad():
        direct = score_tokens(model, tokens, 16, 8)["nats_per_token"]
    assert rows[1]["nats_per_token"] == pytest.approx(direct, rel=1e-9)
    for r in rows:
        assert r["tokens"] == 199
        assert r["bpb"] == pytest.approx(r["nats_per_token"] * 200 / 700 / math.log(2))
        assert r["ppl"] == pytest.approx(math.exp(r["nats_per_token"]))
    assert result["eval"]["config"]["split"] == "test"


def test_explicit_contexts_stride_and_max_tokens():
    model = tiny_gpt(context=8)
    tokens = np.arange(300) % 64
    data = FakeData(tokens, num_bytes=10**6, vocab_size=64)
    result = perplexity.evaluate_run(loaded(model), ppl_cfg(contexts="[4,12]", stride=4, max_tokens=50), data, torch.device("cpu"))
    assert [(r["context"], r["stride"], r["tokens"]) for r in result["results"]] == [(4, 4, 49), (12, 4, 49)]
    # truncated: bytes are those of the decoded prefix (one byte per token here)
    assert result["data"]["bytes"] == 50 and result["data"]["truncated_to_max_tokens"]
    with pytest.raises(ValueError, match="stride"):
        perplexity.evaluate_run(loaded(model), ppl_cfg(contexts="[4,12]", stride=8), data, torch.device("cpu"))


def test_context_lengths_and_default_strides():
    from eval.perplexity import context_lengths, stride_for

    assert context_lengths(ppl_cfg(), 8) == [8, 16, 32]  # 1x, 2x, 4x the training context
    assert context_lengths(ppl_cfg(context=6, context_multipliers="[1,1.5,0.5]"), 8) == [6, 9, 3]
    assert context_lengths(ppl_cfg(contexts="[5,7]", context=6), 8) == [5, 7]  # an explicit list wins
    for bad in ("[0]", "[4,-1]", "[2.5]"):
        with pytest.raises(ValueError, match=r"context lengths must be positive ints, got \["):
            context_lengths(ppl_cfg(contexts=bad), 8)
    assert [stride_for(ppl_cfg(), n) for n in (1, 2, 9, 16)] == [1, 1, 4, 8]  # half the context, at least 1
    assert stride_for(ppl_cfg(stride=3), 3) == 3
    for stride, length in ((4, 3), (0, 3)):
        with pytest.raises(ValueError, match=f"stride must be an int in \\[1, context\\] for every context; got stride={stride} with context {length}"):
            stride_for(ppl_cfg(stride=stride), length)


def test_evaluate_run_rows_and_data_record():
    """Each row's context multiple, bits per token and beyond-training flag, and the data record:
    the split's own counts and its unigram baseline; a max_tokens of the split's length or more
    truncates nothing."""
    model = tiny_gpt(context=8)
    tokens = np.random.default_rng(4).integers(0, 64, 60)
    data = FakeData(tokens, num_bytes=90, vocab_size=64)
    for max_tokens in ("null", 60, 61):
        result = perplexity.evaluate_run(loaded(model), ppl_cfg(contexts="[4,8,16]", stride=4, max_tokens=max_tokens),
                                         data, torch.device("cpu"))
        assert result["data"] == {"tokens": 60, "bytes": 90, "bytes_per_token": 1.5,
                                  "truncated_to_max_tokens": False, "unigram_bpb": 8.0}, max_tokens
        rows = result["results"]
        assert [r["context_multiple"] for r in rows] == [0.5, 1.0, 2.0]
        assert [r["beyond_training_context"] for r in rows] == [False, False, True]
        for r in rows:
            assert r["bits_per_token"] == pytest.approx(r["nats_per_token"] / math.log(2), rel=1e-12)
            assert r["windows"] == len(scoring_windows(60, r["context"], 4)) and r["tokens"] == 59
    truncated = perplexity.evaluate_run(loaded(model), ppl_cfg(contexts="[4]", max_tokens=59), data, torch.device("cpu"))
    assert truncated["data"]["truncated_to_max_tokens"] and truncated["data"]["unigram_bpb"] is None


# ---------------------------------------------------------------------------- attention statistics


def test_head_stats_on_constructed_weights():
    # one head, 3 queries: row 0 sees key 0; row 1 has a negative weight (differential); row 2 is empty
    w = torch.tensor([[[[0.5, 0, 0], [-1.0, 3.0, 0], [0, 0, 0]]]])
    visible = attn.dense_mask(attn.MaskSpec(causal=True), 3)
    stats = attention_diagnostics.HeadStats(1)
    stats.add(w, visible, torch.zeros_like(w), torch.zeros_like(w))
    r = stats.result()
    assert r["zero_fraction"] == [pytest.approx(3 / 6)]
    assert r["empty_rows"] == [pytest.approx(1 / 3)]
    assert r["surviving_keys"] == [pytest.approx(1.0)]  # (1 + 2 + 0) / 3
    assert r["sink_mass"] == [pytest.approx(0.25)]  # only row 1 counts: |-1| / (1 + 3)
    assert r["entropy"] == [pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))]


def zero_qk_projection(model):
    """Zero the q and k rows of every fused qkv projection: all scores become 0."""
    with torch.no_grad():
        for block in model.blocks:
            layer = block.attn
            q_dim, kv_dim = layer.n_head * layer.head_dim, layer.n_kv_head * layer.head_dim
            layer.qkv.weight[: layer.views * (q_dim + kv_dim)] = 0


def test_sink_mass_of_uniform_softmax_attention_is_known():
    model = tiny_gpt("softmax", context=16)
    zero_qk_projection(model)
    n = 12
    ids = torch.randint(0, 64, (3, n), generator=torch.Generator().manual_seed(0))
    stats = attention_stats.attention_statistics(model, [ids[:2], ids[2:]])
    m = stats["metrics"]
    # all logits 0: query i spreads 1 / (i + 1) over its i + 1 keys
    sink = np.mean([1 / (i + 1) for i in range(1, n)])
    entropy = np.mean([math.log(i + 1) for i in range(1, n)])
    for layer in range(2):
        assert m["sink_mass"][layer] == pytest.approx([sink] * 4)
        assert m["entropy"][layer] == pytest.approx([entropy] * 4)
        assert m["zero_fraction"][layer] == [0.0] * 4
        assert m["surviving_keys"][layer] == pytest.approx([(n + 1) / 2] * 4)
        assert m["max_logit"][layer] == [0.0] * 4
    assert stats["tokens"] == 3 * n


def test_threshold_attention_with_zero_scores_is_all_zero():
    # q = k = 0 after L2 norm: every score 0 <= tau, so every weight is exactly 0 (sink-free, empty rows)
    model = tiny_gpt("threshold")
    zero_qk_projection(model)
    stats = attention_stats.attention_statistics(model, [torch.randint(0, 64, (2, 10))])
    assert stats["summary"]["zero_fraction"] == 1.0
    assert stats["summary"]["empty_rows"] == 1.0
    assert stats["summary"]["sink_mass"] is None  # undefined without any nonzero row


def test_sigmoid_statistics_logits_are_the_argument_of_its_sigmoid():
    """With bias null the statistics' logits carry b_i = -ln(n_i): the sigmoid of a layer's logits is
    its weights on every visible pair, so max_logit reads s q.k + b_i."""
    model = tiny_gpt("sigmoid")
    assert model.blocks[0].attn.spec.bias is None
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = model.embed(ids)
        for block in model.blocks:
            weights, visible, logits, scores = attention_diagnostics.layer_weights(block.attn, block.norm1(x))
            vis = visible[:, None].expand_as(weights)
            torch.testing.assert_close(torch.sigmoid(logits)[vis], weights[vis], rtol=1e-6, atol=1e-7)
            n_visible = vis.sum(-1, keepdim=True).double()
            torch.testing.assert_close(logits[vis].double(), (scores - torch.log(n_visible))[vis].double(),
                                       rtol=1e-6, atol=1e-6)
            x = block(x)


def direct_zero_fraction(model, ids):
    """Direct count from the reference weights, layer by layer (no hooks)."""
    fractions = []
    with torch.no_grad():
        x = model.embed(ids)
        for block in model.blocks:
            layer = block.attn
            qs, ks, _ = layer.split_heads(block.norm1(x))
            extra = dict(q2=qs[1], k2=ks[1], lam=layer.extras.per_head_lambda()) if layer.views == 2 else {}
            w = attn.attention_weights(qs[0], ks[0], layer.spec, attn.MaskSpec(causal=True), extra=extra)
            visible = torch.ones(ids.shape[1], ids.shape[1]).tril().bool()
            zeros = ((w == 0) & visible).sum(dim=(0, 2, 3)).double()
            fractions.append((zeros / (visible.sum() * ids.shape[0])).tolist())
            x = block(x)
    return fractions


@pytest.mark.parametrize("name", ["threshold", "diff_threshold"])
def test_zero_fraction_matches_direct_count(name):
    model = tiny_gpt(name)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    stats = attention_stats.attention_statistics(model, [ids[:1], ids[1:]])
    expected = direct_zero_fraction(model, ids)
    np.testing.assert_allclose(stats["metrics"]["zero_fraction"], expected, rtol=0, atol=1e-12)
    flat = [v for layer in expected for v in layer]
    assert 0.0 < min(flat) and max(flat) < 1.0, "the case must have both zero and nonzero weights"


def test_every_registered_variant_gets_statistics():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    for name in attn.variant_names():
        model = tiny_gpt(name)
        stats = attention_stats.attention_statistics(model, [ids])
        summary = stats["summary"]
        assert 0.0 <= summary["zero_fraction"] <= 1.0, name
        assert summary["max_logit"] is not None and math.isfinite(summary["max_logit"]), name
        if attn.get_variant(name).family == "softmax":
            assert summary["sink_mass"] > 0 and summary["empty_rows"] == 0.0, name


def test_capped_max_logit_is_bounded_by_the_cap():
    model = tiny_gpt("softcap_tanh")
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(60.0)  # huge scores: the cap must bind
    stats = attention_stats.attention_statistics(model, [torch.randint(0, 64, (2, 16))])
    assert stats["summary"]["max_score"] > 5.0 >= stats["summary"]["max_logit"]


# ---------------------------------------------------------------------------- commands end to end


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real 4-step training run on a tiny corpus, with the .hydra/config.yaml Hydra would write."""
    return train_tiny_run(tmp_path_factory.mktemp("evalrun"), **{"train.max_steps": 4})


def eval_cfg(name, run_dir, *extra):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(f"eval/{name}", overrides=[f"ckpt={run_dir}", *extra])


def test_perplexity_command_writes_json_into_the_runs_eval_folder(trained_run):
    results = perplexity.run_perplexity(eval_cfg("perplexity", trained_run, "split=val", "max_tokens=400"))
    assert len(results) == 1
    path = Path(results[0]["path"])
    # named by the checkpoint and the settings that differ from the command's defaults
    assert path.parent == trained_run.resolve() / "eval"
    assert path.name == "best.perplexity-val.max_tokens=400.json"
    saved = json.loads(path.read_text())
    assert [r["context"] for r in saved["results"]] == [16, 32, 64]
    assert saved["eval"]["config"]["max_tokens"] == 400 and saved["model"]["variant"] == "softmax"
    assert all(math.isfinite(r["bpb"]) and r["tokens"] == 399 for r in saved["results"])
    # a sweep folder: every run in it is evaluated
    results = perplexity.run_perplexity(eval_cfg("perplexity", trained_run.parent, "split=val", "max_tokens=100", "contexts=[8]"))
    assert len(results) == 1 and results[0]["results"][0]["context"] == 8
    assert Path(results[0]["path"]).name.endswith(".perplexity-val.contexts=8_max_tokens=100.json")
    assert json.loads(path.read_text()) == saved  # the first evaluation's file is untouched


def test_eval_results_at_default_settings_keep_the_plain_name(trained_run):
    from eval import common

    cfg = eval_cfg("perplexity", trained_run, "split=val")
    assert common.settings_tag(cfg, "perplexity", perplexity.RESULT_SETTINGS) == ""
    stats = eval_cfg("attention_stats", trained_run, "num_tokens=64", "seq_len=16")
    assert common.settings_tag(stats, "attention_stats", attention_stats.RESULT_SETTINGS) == "num_tokens=64_seq_len=16"
    many = eval_cfg("perplexity", trained_run, f"contexts=[{','.join(str(8 + i) for i in range(40))}]")
    tag = common.settings_tag(many, "perplexity", perplexity.RESULT_SETTINGS)
    assert tag.startswith("settings-") and len(tag) == len("settings-") + 12


def test_data_option_selects_another_data_config(trained_run, tmp_path):
    """data=<option> replaces the run's data config; its ${model.context}-style keys resolve against the run."""
    corpus = write_corpus(tmp_path / "other.txt", lines=200, seed=5)
    cfg = eval_cfg("perplexity", trained_run, "data=text", f"data.source.path={corpus}", "data/tokenizer=byte",
                   f"cache_dir={tmp_path / 'cache'}", "split=test", "contexts=[16]", f"out={tmp_path / 'other.json'}")
    result = perplexity.run_perplexity(cfg)[0]
    used = result["eval"]["config"]["data"]
    assert used["source"]["path"] == str(corpus) and used["seq_len"] == 16 and used["cache_dir"] == str(tmp_path / "cache")
    assert (tmp_path / "other.json").is_file() and result["results"][0]["tokens"] > 0


def test_attention_stats_command_writes_json_and_heatmaps(trained_run):
    results = attention_stats.run_attention_stats(eval_cfg("attention_stats", trained_run, "num_tokens=64"))
    saved = json.loads(Path(results[0]["path"]).read_text())
    assert saved["tokens"] == 64 and len(saved["metrics"]["sink_mass"]) == 2  # 2 layers
    assert len(saved["heatmaps"]) == len(attention_stats.METRICS)
    for png in saved["heatmaps"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert Path(png).parent == Path(results[0]["path"]).parent


def test_eval_commands_on_the_command_line_write_into_the_runs_eval_folder(trained_run, tmp_path):
    """`python -m eval.attention_stats ckpt=<run>` and `python -m eval.perplexity ckpt=<run>/checkpoints/last.ckpt`:
    their JSONs and the heatmap PNGs go to <run>/eval/, and checkpoints/ keeps only the .ckpt files."""
    import shutil

    from train_helpers import run_command

    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("eval"))  # the run as training left it
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    done = run_command(["-m", "eval.attention_stats", f"ckpt={run}", "num_tokens=32"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_command(["-m", "eval.perplexity", f"ckpt={run / 'checkpoints' / 'last.ckpt'}", "split=val",
                        "contexts=[8]", "max_tokens=100"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints
    written = sorted(p.name for p in (run / "eval").iterdir())
    assert "best.attention-val.num_tokens=32.json" in written
    assert "last.perplexity-val.contexts=8_max_tokens=100.json" in written
    heatmaps = [name for name in written if name.endswith(".png")]
    assert sorted(heatmaps) == sorted(f"best.attention-val.num_tokens=32.{metric}.png" for metric in attention_stats.METRICS)


def test_generate_command_samples_text(trained_run, capsys):
    texts = generate.run_generate(eval_cfg("generate", trained_run, "prompt=anna", "max_new_tokens=12", "num_samples=2"))
    assert len(texts) == 2 and all(t.startswith("anna") and len(t) > len("anna") for t in texts)
    assert "anna" in capsys.readouterr().out


def test_generate_command_with_and_without_the_kv_cache_gives_the_same_greedy_text(trained_run):
    texts = {kv: generate.run_generate(eval_cfg("generate", trained_run, "prompt=anna", "max_new_tokens=10",
                                                 "temperature=0", f"kv_cache={kv}"))
             for kv in ("true", "false")}
    assert texts["true"] == texts["false"]
    with pytest.raises(ValueError, match="kv_cache must be true or false"):
        generate.run_generate(eval_cfg("generate", trained_run, "prompt=anna", "kv_cache=3"))
    # eager decode steps (the CUDA-graph option off) give the same text
    assert generate.run_generate(eval_cfg("generate", trained_run, "prompt=anna", "max_new_tokens=10",
                                          "temperature=0", "cuda_graph=false")) == texts["true"]
    with pytest.raises(ValueError, match="cuda_graph must be true, false or null"):
        generate.run_generate(eval_cfg("generate", trained_run, "prompt=anna", "cuda_graph=3"))


def test_wandb_logs_into_the_runs_group_offline(trained_run, monkeypatch, caplog):
    calls = {}

    class FakeRun:
        summary = {}
        offline = True
        settings = types.SimpleNamespace(sync_dir="/runs/wandb/offline-run-1")

        def log(self, data):
            calls["log"] = data

        def finish(self):
            calls["finished"] = True

    def fake_init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    import wandb

    monkeypatch.setattr(wandb, "init", fake_init)
    caplog.set_level(logging.INFO, logger="attnlab.eval")
    perplexity.run_perplexity(eval_cfg("perplexity", trained_run, "split=val", "max_tokens=64", "contexts=[8]",
                                       "wandb.enabled=true"))
    assert calls["init"]["group"] == "default" and calls["init"]["mode"] == "offline"
    assert calls["init"]["job_type"] == "perplexity" and calls["finished"]
    assert "eval/val/perplexity" in calls["log"]
    # wandb's own run header and summary block stay quiet (-v brings them back); one line says where the run is
    assert calls["init"]["settings"].silent is True
    assert "logged to wandb offline run /runs/wandb/offline-run-1 (upload: wandb sync /runs/wandb/offline-run-1)" in caplog.text


# ---------------------------------------------------------------------------- refusing bad checkpoints


def save_fake_checkpoint(path, model, mutate=None):
    hparams = {"model": asdict(model.cfg), "optim": {}, "compile": False, "bytes_per_token": {}}
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "hyper_parameters": hparams}
    if mutate:
        mutate(ckpt)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def _unknown_variant(c):
    c["hyper_parameters"]["model"]["attn"]["name"] = "flash_magic"


def _unknown_field(c):
    c["hyper_parameters"]["model"]["n_experts"] = 8


def _wrong_shapes(c):
    c["hyper_parameters"]["model"]["d_model"] = 64


def _missing_weights(c):
    c["state_dict"] = {k: v for k, v in c["state_dict"].items() if "blocks.1" not in k}


def _no_model_config(c):
    del c["hyper_parameters"]["model"]


@pytest.mark.parametrize("mutate,match", [
    (_unknown_variant, "does not register"),
    (_unknown_field, "cannot build"),
    (_wrong_shapes, "do not fit"),
    (_missing_weights, "missing weights"),
    (_no_model_config, "no 'model' dict"),
])
def test_incompatible_checkpoints_are_refused_clearly(tmp_path, mutate, match):
    path = save_fake_checkpoint(tmp_path / "x.ckpt", tiny_gpt(), mutate)
    with pytest.raises(ValueError, match=match):
        load_run(path)


COMMANDS = [
    ("perplexity", perplexity.run_perplexity),
    ("attention_stats", attention_stats.run_attention_stats),
    ("generate", generate.run_generate),
]


@pytest.mark.parametrize("name,run", COMMANDS)
def test_every_command_rejects_missing_and_incompatible_checkpoints(tmp_path, name, run):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        run(eval_cfg(name, tmp_path / "nope.ckpt"))
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no best checkpoint"):
        run(eval_cfg(name, tmp_path / "empty_run"))
    (tmp_path / "garbage.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read safely"):
        run(eval_cfg(name, tmp_path / "garbage.ckpt"))
    path = save_fake_checkpoint(tmp_path / "bad.ckpt", tiny_gpt(), _unknown_variant)
    with pytest.raises(ValueError, match="does not register"):
        run(eval_cfg(name, path))
    # a bare checkpoint (no run directory) with no data= given: told what to pass
    path = save_fake_checkpoint(tmp_path / "bare" / "model.ckpt", tiny_gpt())
    with pytest.raises(ValueError, match="pass data=<option>"):
        run(eval_cfg(name, path))


def test_vocabulary_mismatch_with_the_data_is_refused(trained_run, tmp_path):
    # a checkpoint whose model vocabulary (64) differs from the run's byte tokenizer (256)
    ckpt = save_fake_checkpoint(tmp_path / "run" / "checkpoints" / "best.ckpt", tiny_gpt(vocab=64))
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text((trained_run / ".hydra" / "config.yaml").read_text())
    with pytest.raises(ValueError, match="vocabulary size 256.*has 64"):
        perplexity.run_perplexity(eval_cfg("perplexity", ckpt, "split=val"))


@pytest.mark.parametrize("module", [perplexity, attention_stats, generate])
def test_command_line_reports_a_missing_checkpoint_in_one_line(tmp_path, monkeypatch, capsys, module):
    """The Hydra entry points (python -m eval.X ckpt=...) exit with status 2 and one error line."""
    monkeypatch.setattr(sys, "argv", [module.__name__, f"ckpt={tmp_path / 'missing.ckpt'}"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: checkpoint not found" in err and "Traceback" not in err


TRAINING_GROUPS = ("attn", "callbacks", "eval", "experiment", "logger", "model", "optimizer", "scheduler", "trainer")


def listed_config_groups(help_text: str) -> dict[str, list[str]]:
    """{group: options} of the "Configuration groups" section of a Hydra --help text."""
    section = help_text.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    groups = {}
    for line in section.splitlines():
        name, colon, options = line.partition(": ")
        if colon and not line.startswith(" ") and "(group=option)" not in line:
            groups[name] = options.split(", ")
    return groups


def test_eval_generate_help_lists_only_the_config_groups_it_takes(tmp_path):
    """`python -m eval.generate --help` listed every group under configs/ (attn, model, trainer, ...), which it
    then refuses (`Could not override 'model'`): it lists data and data/tokenizer, with their options."""
    from train_helpers import run_command

    done = run_command(["-m", "eval.generate", "--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    groups = listed_config_groups(done.stdout)
    assert set(groups) == {"data", "data/tokenizer"}, groups
    assert groups["data"] == sorted(p.stem for p in (REPO / "configs" / "data").glob("*.yaml"))
    assert groups["data/tokenizer"] == sorted(p.stem for p in (REPO / "configs" / "data" / "tokenizer").glob("*.yaml"))
    assert "prompt:" in done.stdout.split("== Config ==", 1)[1]


def test_train_help_lists_the_training_groups_and_not_evals(tmp_path):
    """`python train.py --help` lists every group train.yaml composes, each with the options in its
    folder, and not the eval group, which training refuses."""
    from train_helpers import run_command

    done = run_command([str(REPO / "train.py"), "--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    groups = listed_config_groups(done.stdout)
    assert set(groups) == {"attn", "model", "data", "data/tokenizer", "trainer", "logger", "optimizer", "scheduler",
                           "callbacks", "experiment"}, groups
    for group, options in groups.items():
        assert options == sorted(p.stem for p in (REPO / "configs" / group).glob("*.yaml")), group


@pytest.mark.parametrize("command", ["attention_stats", "export", "generate", "lm_harness", "perplexity"])
def test_every_eval_command_help_lists_groups_it_accepts(command, capsys, monkeypatch):
    """`attnlab-eval <command> --help` for each command: every listed group is one the command accepts
    (an option of each composes), and no training group is listed."""
    from hydra.core.hydra_config import HydraConfig

    from eval import cli

    # Hydra's help leaves its config set in the process, as if a Hydra app were running: given back after
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)
    assert command in cli.commands()
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    groups = listed_config_groups(capsys.readouterr().out)
    assert groups and not set(groups) & set(TRAINING_GROUPS), groups
    for option in groups["data"]:
        eval_cfg(command, "run", f"data={option}", f"data/tokenizer={groups['data/tokenizer'][0]}")


def test_wandb_group_follows_train_py(tmp_path):
    """results.json's wandb_group when recorded; else <group>-<sweep folder> for a multirun job
    (also when the saved sweep dir still holds ${now:...} and the job subdir is nested)."""
    job = tmp_path / "multirun" / "2026-01-01_00-00-00" / "softmax" / "s0"
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"hydra": {
        "mode": "MULTIRUN", "runtime": {"output_dir": str(job)},
        "sweep": {"dir": "multirun/${group}/${now:%Y-%m-%d_%H-%M-%S}", "subdir": "${attn.name}/s${seed}"},
    }}), job / ".hydra" / "hydra.yaml")
    run = Run(job)
    run.config, run.results = OmegaConf.create({"group": "ablation"}), {}
    assert run.wandb_group == "ablation-2026-01-01_00-00-00"
    run.results = {"wandb_group": "recorded"}
    assert run.wandb_group == "recorded"
    (job / ".hydra" / "hydra.yaml").write_text("hydra:\n  mode: RUN\n")
    run.results = {}
    assert run.wandb_group == "ablation"


@pytest.mark.parametrize("payload", ["target", "nested", "other_datamodule"])
def test_evaluation_never_runs_code_named_in_a_run_config(trained_run, tmp_path, payload):
    """A shared run directory's .hydra/config.yaml is data: a `_target_` anywhere in its data config
    (here one that would truncate a file) is refused with the key named, and nothing runs."""
    import shutil

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    config = OmegaConf.load(run / ".hydra" / "config.yaml")
    opener = {"_target_": "builtins.open", "file": str(victim), "mode": "w"}
    if payload == "target":
        config.data.source = opener
    elif payload == "nested":
        config.data.tokenizer.extra = [opener]
    else:
        config.data._target_ = "builtins.open"
    OmegaConf.save(config, run / ".hydra" / "config.yaml")
    with pytest.raises(ValueError, match=r"data\.(source\._target_|tokenizer\.extra\[0\]\._target_|_target_ must be one of)"):
        # the copied checkpoint itself (the run directory's results.json names the original's)
        perplexity.run_perplexity(eval_cfg("perplexity", run / "checkpoints" / "best.ckpt", "split=val",
                                           "max_tokens=100", "contexts=[8]"))
    assert victim.read_text() == "keep me"
