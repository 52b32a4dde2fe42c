"""eval.lm_harness and eval.harness_model: the scorer against hand computations from the model's
logits, the lm_eval adapter end to end on local tasks (a JSONL file and task YAMLs written into
tmp_path, offline), and the command's refusals before its heavy imports."""

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from data.sources import DOCUMENT_SEPARATOR
from data.tokenizers import ByteTokenizer
from eval.harness_model import HarnessScorer
from models.gpt import GPT, AttnConfig, GPTConfig
from train_helpers import CONFIG_DIR, ROOT, train_tiny_run

CONTEXT = 16


def tiny_scorer(batch_size=4, name="softmax"):
    cfg = GPTConfig(vocab_size=256, context=CONTEXT, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    attn=AttnConfig(name=name, backend="reference"))
    torch.manual_seed(0)
    return HarnessScorer(GPT(cfg), ByteTokenizer(), batch_size=batch_size)


def hand_loglikelihood(scorer, ids, continuation_length):
    """Sum of log p(token | all tokens before it, at most the context) over the last continuation_length ids."""
    ids = ids[-(CONTEXT + 1):]
    with torch.no_grad():
        logprobs = F.log_softmax(scorer.model(torch.tensor([ids[:-1]])).double()[0], dim=-1)
    positions = range(len(ids) - 1 - continuation_length, len(ids) - 1)
    return sum(float(logprobs[p, ids[p + 1]]) for p in positions), [int(logprobs[p].argmax()) for p in positions]


def test_loglikelihood_is_the_sum_of_the_continuations_token_logprobs():
    scorer = tiny_scorer()
    pairs = [("anna sees", " the cat"), ("b", "ert likes it"), ("carl ", "finds"),  # the space moves to the continuation
             ("a much longer context than the model sees", " it."), ("", "dora")]
    results = scorer.loglikelihood(pairs)
    prefix = list(DOCUMENT_SEPARATOR.encode())[-1:]
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        if context.endswith(" "):
            context, continuation = context.rstrip(), " " + continuation
        context_ids = list(context.encode()) if context else prefix
        continuation_ids = list(continuation.encode())
        expected, argmax = hand_loglikelihood(scorer, context_ids + continuation_ids, len(continuation_ids))
        assert logprob == pytest.approx(expected, abs=1e-4) and logprob < 0
        assert greedy == (argmax == continuation_ids)
    # batching and padding change nothing
    assert [r[0] for r in tiny_scorer(batch_size=1).loglikelihood(pairs)] == pytest.approx([r[0] for r in results], abs=1e-5)


def test_greedy_continuation_is_greedy_and_generate_until_stops():
    scorer = tiny_scorer()
    context = "anna sees the"
    ids = torch.tensor([list(context.encode())])
    with torch.no_grad():
        greedy_ids = scorer.model.generate(ids, 6, temperature=0)[0, ids.shape[1]:].tolist()
    greedy_text = bytes(greedy_ids).decode("utf-8", errors="replace")
    logprob, is_greedy = scorer.loglikelihood([(context, greedy_text)])[0]
    assert is_greedy or "\ufffd" in greedy_text  # bytes that are not UTF-8 do not round-trip as text
    stop = greedy_text[3:5]
    out = scorer.generate_until([(context, {"until": [], "max_gen_toks": 6}),
                                 (context, {"until": ["never", stop], "max_gen_toks": 6}),
                                 (context, {"max_gen_toks": 2, "do_sample": True})])  # answered greedily
    assert out[0] == greedy_text and out[1] == greedy_text[:greedy_text.index(stop)]
    assert out[2] == bytes(greedy_ids[:2]).decode("utf-8", errors="replace")


def test_rolling_loglikelihood_scores_every_token_once():
    scorer = tiny_scorer(batch_size=2)
    short, long = "anna sees it", "anna sees the cat and bert likes the red ball; carl finds an old book."
    rolling = scorer.loglikelihood_rolling([short, long, ""])
    assert rolling[0] == pytest.approx(scorer.loglikelihood([("", short)])[0][0], abs=1e-4)
    assert rolling[2] == 0.0
    # the long text by hand: disjoint windows of CONTEXT targets, the last one with full left context
    tokens = list(DOCUMENT_SEPARATOR.encode())[-1:] + list(long.encode())
    total, scored_until = 0.0, 0
    while scored_until < len(tokens) - 1:
        end = min(scored_until + CONTEXT, len(tokens) - 1)
        window = tokens[max(0, end - CONTEXT):end + 1]
        total += hand_loglikelihood(scorer, window, end - scored_until)[0]
        scored_until = end
    assert rolling[1] == pytest.approx(total, abs=1e-3)


def test_scorer_rejects_bad_options_and_overlong_continuations():
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        tiny_scorer(batch_size=0)
    with pytest.raises(ValueError, match="longer than the model's context"):
        tiny_scorer().loglikelihood([("a", "x" * (CONTEXT + 1))])


# ---------------------------------------------------------------------------- lm_eval end to end


DOCS = [
    {"question": "anna sees", "choices": [" the cat", " a dog", " the red ball"], "label": 0},
    {"question": "bert likes", "choices": [" an old book", " the river"], "label": 1},
    {"question": "carl finds", "choices": [" the cat", " zq xv"], "label": 0},
    {"question": "dora helps", "choices": [" it.", " fred"], "label": 1},
]


def write_tasks(folder):
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}output_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\n"
        "doc_to_target: label\ndoc_to_choice: \"{{choices}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "tiny_rolling.yaml").write_text(
        f"task: tiny_rolling\n{common}output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{question}}{{choices[0]}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (folder / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}output_type: generate_until\ndoc_to_text: \"{{{{question}}}}\"\n"
        "doc_to_target: \"{{choices[label]}}\"\ngeneration_kwargs:\n  until: [\".\"]\n  max_gen_toks: 5\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory):
    pytest.importorskip("lm_eval")
    tmp = tmp_path_factory.mktemp("harness")
    (tmp / "tasks").mkdir()
    return train_tiny_run(tmp), write_tasks(tmp / "tasks")


def harness_cfg(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("eval/lm_harness", overrides=list(overrides))


def test_harness_on_local_tasks_matches_the_scorer(harness_run):
    from eval import lm_harness
    from runs.model import load_run
    from runs.run import Run

    run_dir, tasks = harness_run
    result = lm_harness.run_lm_harness(harness_cfg(
        f"ckpt={run_dir}", f"include_path={tasks}", "tasks=[tiny_mc,tiny_rolling,tiny_gen]", "bootstrap_iters=0",
        "backend=reference"))
    saved = json.loads(open(result["path"]).read())
    assert result["path"].endswith("best.lm_harness-tiny_mc-tiny_rolling-tiny_gen.json")
    assert saved["model"]["tokenizer"]["kind"] == "byte" and saved["versions"]["lm_eval"]

    run = load_run(Run(run_dir).checkpoint(), backend="reference")
    scorer = HarnessScorer(run.model, run.tokenizer)
    # accuracy by hand: the choice with the highest log-likelihood
    correct = []
    for doc in DOCS:
        scores = [lp for lp, _ in scorer.loglikelihood([(doc["question"], c) for c in doc["choices"]])]
        correct.append(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    assert saved["results"]["tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(DOCS))
    # bits per byte by hand from the rolling log-likelihoods
    texts = [doc["question"] + doc["choices"][0] for doc in DOCS]
    nats = -sum(scorer.loglikelihood_rolling(texts))
    bpb = nats / math.log(2) / sum(len(t.encode()) for t in texts)
    assert saved["results"]["tiny_rolling"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-5)
    # exact match by hand from greedy generation
    generated = scorer.generate_until([(doc["question"], {"until": ["."], "max_gen_toks": 5}) for doc in DOCS])
    matches = [g == doc["choices"][doc["label"]] for g, doc in zip(generated, DOCS)]
    assert saved["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(sum(matches) / len(DOCS))


def test_the_model_is_registered_with_lm_eval(harness_run, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    from eval import export, harness_model

    run_dir, _ = harness_run
    adapter = get_model("attnlab")
    assert adapter is harness_model.AttnlabLM
    lm = adapter.create_from_arg_string(f"ckpt={run_dir},backend=reference", {"batch_size": 2, "device": "cpu"})
    out = export.run_export(harness_cfg_export(run_dir, tmp_path / "export"))
    from_export = adapter.create_from_arg_string(f"export={out},backend=reference", {"batch_size": 3})

    class Request:  # what the harness hands the model: Instance.args
        def __init__(self, *args):
            self.args = args

    requests = [Request("anna sees", " the cat"), Request("", "bert")]
    assert lm.loglikelihood(requests) == from_export.loglikelihood(requests)
    assert lm.loglikelihood_rolling([Request("anna sees the cat")]) == from_export.loglikelihood_rolling(
        [Request("anna sees the cat")])
    with pytest.raises(ValueError, match="exactly one of ckpt="):
        adapter.create_from_arg_string("", {})


def harness_cfg_export(run_dir, out):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("eval/export", overrides=[f"ckpt={run_dir}", f"out={out}"])


def test_bad_options_are_named(harness_run, monkeypatch, capsys):
    from eval import lm_harness

    run_dir, tasks = harness_run
    for overrides, match in [
        ([], "tasks=... is required"),
        (["tasks=[]"], "tasks must be a list of lm_eval task names"),
        (["tasks=[tiny_mc]", "limit=-1"], "limit must be"),
        (["tasks=[tiny_mc]", f"include_path={tasks / 'nope'}"], "include_path=.* is not a folder"),
        (["tasks=[no_such_task]", f"include_path={tasks}"], r"tasks: unknown lm_eval task\(s\) \['no_such_task'\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            lm_harness.run_lm_harness(harness_cfg(f"ckpt={run_dir}", *overrides))
    monkeypatch.setattr(sys, "argv", ["eval.lm_harness", f"ckpt={run_dir}", "tasks=[tiny_mc]", "num_fewshot=-2"])
    with pytest.raises(SystemExit) as exit_info:
        lm_harness.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: num_fewshot must be" in err and "Traceback" not in err


def test_lm_evals_own_hf_model_scores_an_export_as_the_attnlab_model_does(tmp_path):
    """An eval.export folder through lm_eval's standard `hf` model (transformers, trust_remote_code):
    the same accuracy and bits per byte as the attnlab model on the same folder (a BPE tokenizer,
    which has an end-of-text token for empty contexts)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import lm_eval
    import lm_eval.models  # noqa: F401  (registers "hf")
    from lm_eval.tasks import TaskManager

    from data.tokenizers import train_bpe
    from eval import export

    (tmp_path / "tasks").mkdir()
    task_manager = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")))
    tokenizer = train_bpe(["anna sees the cat and bert likes it. carl finds an old book; dora helps fred"] * 40,
                          vocab_size=300)
    cfg = GPTConfig(vocab_size=320, context=CONTEXT, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    attn=AttnConfig(name="softcap_tanh", backend="reference"))
    torch.manual_seed(0)
    export.write_export(GPT(cfg), tokenizer, tmp_path / "export")
    tasks = ["tiny_mc", "tiny_rolling"]
    results = {name: lm_eval.simple_evaluate(model=name, model_args=args, tasks=tasks, task_manager=task_manager,
                                             bootstrap_iters=0, batch_size=2)["results"]
               for name, args in [("hf", f"pretrained={tmp_path / 'export'},trust_remote_code=True,device=cpu"),
                                  ("attnlab", f"export={tmp_path / 'export'},backend=reference")]}
    assert results["hf"]["tiny_mc"]["acc,none"] == results["attnlab"]["tiny_mc"]["acc,none"]
    assert results["hf"]["tiny_rolling"]["bits_per_byte,none"] == pytest.approx(
        results["attnlab"]["tiny_rolling"]["bits_per_byte,none"], rel=1e-5)


def test_a_hub_task_offline_fails_at_once_in_one_line(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE (tests/conftest.py) and lambada_openai's data set in neither cache: refused
    before lm_eval builds its task index, naming the task, the data set and the local-task way."""
    pytest.importorskip("lm_eval")
    import huggingface_hub.constants

    from eval import lm_harness

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = harness_cfg(f"ckpt={tmp_path}", "tasks=[lambada_openai]")
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        lm_harness.run_lm_harness(cfg)
    assert time.perf_counter() - start < 2.0
    message = str(info.value)
    assert "\n" not in message
    assert re.search(r"lambada_openai needs the Hugging Face Hub data set EleutherAI/lambada_openai", message)
    assert "include_path=" in message and "HF_HUB_OFFLINE" in message

    find = lm_harness.hub_tasks_missing_offline
    assert find(["lambada_openai", "no_such_task"], None) == {"lambada_openai": "EleutherAI/lambada_openai"}
    local = tmp_path / "tasks"
    local.mkdir()
    (local / "mine.yaml").write_text("task: lambada_openai\ndataset_path: json\n")
    assert find(["lambada_openai"], str(local)) == {}  # a local task of that name
    (tmp_path / "hub" / "datasets--EleutherAI--lambada_openai").mkdir(parents=True)
    assert find(["lambada_openai"], None) == {}  # cached: lm_eval reads it offline
    (tmp_path / "hub" / "datasets--EleutherAI--lambada_openai").rmdir()
    (tmp_path / "datasets" / "EleutherAI___lambada_openai").mkdir(parents=True)
    assert find(["lambada_openai"], None) == {}  # in the datasets cache
    (tmp_path / "datasets" / "EleutherAI___lambada_openai").rmdir()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    assert find(["lambada_openai"], None) == {}  # online: lm_eval downloads it


# what the command's refusals must not wait for: each takes seconds to import
HEAVY_MODULES = {"torch", "lm_eval", "datasets", "lightning", "transformers", "numpy"}


@pytest.mark.parametrize("command", [["-m", "eval.lm_harness"],
                                     ["-c", "from eval.cli import main; main()", "lm_harness"]],
                         ids=["python -m eval.lm_harness", "attnlab-eval lm_harness"])
def test_a_hub_task_offline_is_one_error_line_from_the_command_before_its_heavy_imports(command, tmp_path):
    """The refusal comes from the command's options and lm_eval's task files read as text: the process
    imports none of torch, lm_eval, datasets, ... (python -X importtime lists every module it imports)."""
    pytest.importorskip("lm_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "ds"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-X", "importtime", *command, f"ckpt={tmp_path}", "tasks=[lambada_openai]"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    imports = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: tasks: lambada_openai needs the Hugging Face Hub"), lines
    imported = {line.split("|")[-1].strip().split(".")[0] for line in imports}
    assert "hydra" in imported  # the listing is there
    assert imported & HEAVY_MODULES == set()
