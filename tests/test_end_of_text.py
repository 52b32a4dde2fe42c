"""The end-of-text token: reserved in every BPE we train, put after every document of a split's
token stream (trained BPE, tiktoken encodings that have it; never for byte and char), a new token
cache when that changes, and generation that ends a sample at it. CPU, generated corpora."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data import cache as cache_module
from data import tokenizers as tokenizers_module
from data.datamodule import TokenDataModule
from data.sources import build_source
from data.tokenizers import (
    END_OF_TEXT, ByteTokenizer, CharTokenizer, build_tokenizer, tokenizer_from_record, tokenizer_record, train_bpe,
)
from models.gpt import GPT, AttnConfig, GPTConfig

DOCUMENTS = [f"story {i}: anna sees the cat and bert likes it, {'very ' * (i % 4)}much." for i in range(60)]


def write_jsonl(path, documents=DOCUMENTS):
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    return path


def make_dm(tmp_path, tokenizer, **source):
    """One document per JSON line; the first 48 rows train, the next 6 val, the last 6 test."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = write_jsonl(tmp_path / "corpus.jsonl")
    dm = TokenDataModule(source={"kind": "jsonl", "path": str(corpus), "val_fraction": 0.1, "test_fraction": 0.1,
                                 **source},
                         tokenizer=tokenizer, cache_dir=str(tmp_path / "cache"), seq_len=32, batch_size=4,
                         val_tokens=4096, seed=0)
    dm.prepare_data()
    dm.setup()
    return dm


def test_trained_bpe_reserves_the_end_of_text_token():
    tok = train_bpe(DOCUMENTS, vocab_size=300)
    eot = tok.end_of_text_id
    assert eot is not None and tok.tokenizer.id_to_token(eot) == END_OF_TEXT and tok.vocab_size <= 300
    assert tok.decode([*tok.encode("anna"), eot]) == "anna" + END_OF_TEXT
    # the text "<|endoftext|>" in a document is plain text, never the token (a corpus cannot forge a boundary)
    assert eot not in tok.encode(f"a {END_OF_TEXT} b") and tok.decode(tok.encode(f"a {END_OF_TEXT} b")) == f"a {END_OF_TEXT} b"
    assert eot not in tok.encode_batch([END_OF_TEXT])[0]
    # checkpoints and export folders carry it
    rebuilt = tokenizer_from_record(tokenizer_record(tok), "test")
    assert rebuilt.end_of_text_id == eot and eot not in rebuilt.encode(END_OF_TEXT)
    with pytest.raises(ValueError, match=r"data\.tokenizer\.vocab_size must be an integer >= 257 \(the 256 bytes and "
                                         r"<\|endoftext\|>\)"):
        tokenizers_module.parse_tokenizer_config({"kind": "bpe", "vocab_size": 256})


def test_byte_and_char_have_no_end_of_text_token():
    assert ByteTokenizer().end_of_text_id is None and CharTokenizer("ab").end_of_text_id is None
    assert ByteTokenizer().encode_documents(["ab", "c"]).tolist() == [97, 98, 99]
    assert CharTokenizer("abc").encode_documents(["ab", "c"]).tolist() == [0, 1, 2]


def test_every_document_of_a_bpe_split_ends_with_the_token(tmp_path):
    dm = make_dm(tmp_path, {"kind": "bpe", "vocab_size": 300})
    tok, eot = dm.tokenizer, dm.tokenizer.end_of_text_id
    separator = dm.source.separator
    for split, documents in (("train", DOCUMENTS[:48]), ("val", DOCUMENTS[48:54]), ("test", DOCUMENTS[54:])):
        expected = [i for doc in documents for i in (*tok.encode(doc + separator), eot)]
        ids = dm.token_ids(split)
        assert ids.tolist() == expected, split
        assert int((ids == eot).sum()) == len(documents) == dm.manifest["splits"][split]["documents"]
        # bits per byte: the token adds no bytes
        assert dm.split_stats(split)["bytes"] == sum(len((doc + separator).encode()) for doc in documents)
    assert dm.manifest["end_of_text_id"] == eot
    # a training window that spans two documents sees the boundary
    x, y = next(iter(dm.train_dataloader()))
    assert bool((x == eot).any()) and bool((y == eot).any())


def test_a_pretrained_encoding_with_the_token_gets_it_after_every_document(tmp_path, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([i]): i for i in range(256)}
    toy = tiktoken.Encoding(name="toy", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={END_OF_TEXT: 256})
    plain = tiktoken.Encoding(name="plain", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    monkeypatch.setattr(tiktoken, "get_encoding", {"toy": toy, "plain": plain}.__getitem__)
    with_token = make_dm(tmp_path / "a", {"kind": "pretrained", "name": "toy"})
    assert with_token.tokenizer.end_of_text_id == 256
    train = with_token.token_ids("train").tolist()
    assert train == [i for doc in DOCUMENTS[:48] for i in (*(doc + "\n\n").encode(), 256)]
    without = make_dm(tmp_path / "b", {"kind": "pretrained", "name": "plain"})
    assert without.tokenizer.end_of_text_id is None
    assert without.token_ids("train").tolist() == list("".join(d + "\n\n" for d in DOCUMENTS[:48]).encode())


def test_caches_from_before_the_token_are_not_reused(tmp_path, monkeypatch):
    """The token cache's key holds FORMAT_VERSION (2: documents end with the token) and the trained
    tokenizer's cache path holds TRAINED_TOKENIZER_VERSION (2: BPE vocabularies hold it), so a
    cache built before either is left alone and a new one is built beside it."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl")
    source = build_source({"kind": "jsonl", "path": str(corpus)}, tmp_path)
    tokenizer = ByteTokenizer()
    now = cache_module.cache_directory(tmp_path, source, tokenizer)
    monkeypatch.setattr(cache_module, "FORMAT_VERSION", 1)
    assert cache_module.cache_directory(tmp_path, source, tokenizer) != now
    cfg = tokenizers_module.parse_tokenizer_config({"kind": "bpe", "vocab_size": 300})
    bpe_now = tokenizers_module.tokenizer_cache_path(cfg, source, tmp_path)
    monkeypatch.setattr(tokenizers_module, "TRAINED_TOKENIZER_VERSION", 1)
    assert tokenizers_module.tokenizer_cache_path(cfg, source, tmp_path) != bpe_now
    monkeypatch.undo()
    assert build_tokenizer(cfg, source, tmp_path).end_of_text_id is not None


def tiny_gpt(vocab_size=40):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab_size, context=16, n_layer=1, n_head=2, n_kv_head=2, d_model=16,
                    attn=AttnConfig(name="softmax", backend="reference"))
    return GPT(cfg).eval()


@pytest.mark.parametrize("kv_cache", [True, False])
def test_generation_stops_each_row_at_the_stop_token(kv_cache):
    model = tiny_gpt()
    prompt = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(2))
    free = model.generate(prompt, 12, temperature=0, kv_cache=kv_cache)
    stop = int(free[0, 4 + 2])  # the third new token of row 0
    out = model.generate(prompt, 12, temperature=0, kv_cache=kv_cache, stop_token=stop)
    for row in range(3):
        new, unstopped = out[row, 4:].tolist(), free[row, 4:].tolist()
        if stop in unstopped:
            first = unstopped.index(stop)
            assert new[: first + 1] == unstopped[: first + 1] and set(new[first:]) == {stop}
        else:
            assert new == unstopped
    # generation ends once every row has stopped
    all_stop = model.generate(prompt[:1], 12, temperature=0, kv_cache=kv_cache, stop_token=stop)
    assert all_stop.shape[1] == 4 + free[0, 4:].tolist().index(stop) + 1


def test_eval_generate_ends_a_sample_at_the_end_of_text_token(tmp_path, monkeypatch):
    """eval.generate cuts the text before the token and says so; stop_at_end_of_text=false writes
    everything. The run's tokenizer (byte) is given an end-of-text id: the token its greedy
    continuation writes third, so where the sample must end is known."""
    from hydra import compose, initialize_config_dir

    from eval import generate
    from train_helpers import CONFIG_DIR, train_tiny_run

    run = train_tiny_run(tmp_path)

    def cfg(*extra):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return compose("eval/generate", overrides=[f"ckpt={run}", "prompt=anna", "temperature=0",
                                                       "max_new_tokens=10", "wandb.enabled=false", *extra])

    (full,) = generate.run_generate(cfg("stop_at_end_of_text=false"))
    continuation = full.encode()[len(b"anna"):]
    stop = continuation[2]
    monkeypatch.setattr(ByteTokenizer, "end_of_text_id", property(lambda self: stop))
    out = tmp_path / "samples.json"
    (ended,) = generate.run_generate(cfg(f"out={out}"))
    assert ended.encode() == b"anna" + continuation[: continuation.index(stop)]
    assert json.loads(out.read_text())["ended_at_end_of_text"] == [True]
    (again,) = generate.run_generate(cfg("stop_at_end_of_text=false"))
    assert again == full
    with pytest.raises(ValueError, match="stop_at_end_of_text must be true or false"):
        generate.run_generate(cfg("stop_at_end_of_text=3"))


def test_lm_harness_conditions_empty_contexts_on_the_end_of_text_token():
    from eval.harness_model import HarnessScorer

    tok = train_bpe(DOCUMENTS, vocab_size=300)
    scorer = HarnessScorer(tiny_gpt(tok.vocab_size), tok)
    assert scorer.prefix_ids == [tok.end_of_text_id]
    assert HarnessScorer(tiny_gpt(256), ByteTokenizer()).prefix_ids == list(b"\n")
    assert np.isfinite(scorer.loglikelihood([("", "anna sees")])[0][0])


@pytest.mark.parametrize("sample_by, ends", [("line", False), ("paragraph", True), ("document", True)])
def test_the_lines_of_a_text_file_are_pieces_of_one_text_not_documents(tmp_path, sample_by, ends):
    """sample_by=line rows keep their line breaks and join into the file's text: no token between
    them; paragraphs and whole files are documents."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"anna sees the cat {i}.\nbert likes it." for i in range(80)) + "\n")
    # one file is one document with sample_by=document: val and test read it too
    splits = ({"val_path": str(corpus), "test_path": str(corpus)} if sample_by == "document"
              else {"val_fraction": 0.1, "test_fraction": 0.1})
    dm = TokenDataModule(source={"kind": "text", "path": str(corpus), "sample_by": sample_by, **splits},
                         tokenizer={"kind": "bpe", "vocab_size": 300}, cache_dir=str(tmp_path / "cache"), seq_len=8,
                         batch_size=2, val_tokens=256, seed=0)
    dm.prepare_data()
    dm.setup()
    eot = dm.tokenizer.end_of_text_id
    found = int((dm.token_ids("train") == eot).sum())
    assert (found == dm.manifest["splits"]["train"]["documents"]) if ends else found == 0
    assert dm.manifest["end_of_text_id"] == (eot if ends else None)


def test_hub_rows_can_be_pieces_of_one_text(tmp_path, monkeypatch):
    """data.source.rows_are_documents=false (wikitext103's lines): no token between rows, and a cache
    of its own (the option is part of the source fingerprint)."""
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, config_name, split, streaming, revision:
                        datasets.Dataset.from_dict({"text": [f" line {i} of an article .\n" for i in range(30)]}))

    def dm(**options):
        source = {"kind": "hub", "hub_id": "someone/wiki", "splits": {"train": "train", "val": "train", "test": "train"},
                  "separator": "", **options}
        module = TokenDataModule(source=source, tokenizer={"kind": "bpe", "vocab_size": 300},
                                 cache_dir=str(tmp_path / "cache"), seq_len=8, batch_size=2, val_tokens=256, seed=0)
        module.prepare_data()
        module.setup()
        return module

    pieces, documents = dm(rows_are_documents=False), dm()
    assert pieces.cache_path != documents.cache_path
    assert int((pieces.token_ids("train") == pieces.tokenizer.end_of_text_id).sum()) == 0
    assert int((documents.token_ids("train") == documents.tokenizer.end_of_text_id).sum()) == 30
    with pytest.raises(ValueError, match=r"data\.source\.rows_are_documents must be true or false, got 'no'"):
        build_source({"kind": "hub", "hub_id": "x", "rows_are_documents": "no"}, tmp_path)
