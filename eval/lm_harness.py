"""lm-evaluation-harness on a trained run (the `eval` extra: pip install ".[eval]").

    python -m eval.lm_harness ckpt=RUN_DIR tasks=[lambada_openai,hellaswag] [num_fewshot=0] [limit=100]
        [batch_size=8] [include_path=DIR_OF_TASK_YAMLS] [max_gen_toks=256]

Writes <run>/eval/<ckpt stem>.lm_harness-<tasks>.json (common.output_path; or out=) and prints the table.
Importing this module registers the model "attnlab" with lm_eval, so the harness's own Python
API works too: `lm_eval.simple_evaluate(model="attnlab", model_args="ckpt=RUN_DIR", tasks=[...])`
(or model_args="export=EXPORT_DIR" for a folder written by eval.export).

How requests are scored (HarnessScorer):
  - loglikelihood(context, continuation): trailing spaces of the context move to the
    continuation; the continuation's tokens are those of encode(context + continuation) after
    encode(context). Context and continuation are truncated from the left to the model's
    training context; a continuation longer than the context is refused. `is_greedy`: every
    continuation token is the argmax.
  - An empty context (and the start of every rolling text) is conditioned on one prefix token,
    what precedes every document in the training token stream: the end-of-text token for
    tokenizers that have one (data/tokenizers.py), else the last token of the document separator
    (data.sources.DOCUMENT_SEPARATOR).
  - loglikelihood_rolling(text): every token scored once, windows of the training context with
    the most left context (eval.perplexity.score_tokens, stride = context).
  - generate_until(context, gen_kwargs): greedy (a request asking to sample is answered
    greedily, with a warning), up to max_gen_toks tokens, cut at the first `until` string or
    the end-of-text token (a document's end), whichever comes first.
Batches: requests sorted by length, right-padded (the model is causal, so padding after a row
changes none of its logits); generation batches rows of one context length.

Offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set): one of lm_eval's own tasks whose data set is a
Hub data set missing from the local caches is refused before lm_eval starts (its task index alone
takes half a minute), in one line naming the task, the data set and the local-task alternative
(hub_tasks_missing_offline).
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from data.sources import DOCUMENT_SEPARATOR
from data.tokenizers import END_OF_TEXT, Tokenizer
from eval import common
from eval.perplexity import score_tokens
from models.gpt import GPT

log = logging.getLogger("attnlab.eval.lm_harness")


class HarnessScorer:
    """The three request kinds of lm-evaluation-harness on one GPT and its tokenizer, on plain
    Python values (the lm_eval LM subclass below unpacks its Instances into these)."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, batch_size: int = 8, device: str | torch.device = "cpu",
                 precision: str = "auto", max_gen_toks: int = 256):
        for name, value in (("batch_size", batch_size), ("max_gen_toks", max_gen_toks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self._device = torch.device(device)
        model = model.to(self._device)
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.precision = precision
        self.max_gen_toks = max_gen_toks
        self.context = model.cfg.context
        if tokenizer.end_of_text_id is not None:
            self.prefix_ids = [tokenizer.end_of_text_id]
        else:
            self.prefix_ids = tokenizer.encode(DOCUMENT_SEPARATOR)[-1:]
        if not self.prefix_ids:
            raise ValueError("the tokenizer encodes the document separator to no tokens: no prefix for empty contexts")
        common.autocast(self.device, precision)  # checks the precision name
        self._warned_sampling = False

    @property
    def device(self) -> torch.device:
        return self._device

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits (B, L, V) of int64 ids (B, L)."""
        with common.autocast(self.device, self.precision):
            return self.model(ids.to(self.device)).float()

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return list(self.prefix_ids), self.tokenizer.encode(continuation)
        context_ids = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + continuation)
        return context_ids, whole[len(context_ids):]

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is_greedy) per (context, continuation)."""
        rows = []  # (input ids, continuation ids)
        for context, continuation in pairs:
            context_ids, continuation_ids = self.encode_pair(context, continuation)
            if len(continuation_ids) > self.context:
                raise ValueError(f"a continuation of {len(continuation_ids)} tokens is longer than the model's "
                                 f"context ({self.context}): {continuation[:40]!r}...")
            ids = (context_ids + continuation_ids)[-(self.context + 1):]
            rows.append((ids[:-1], continuation_ids))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = max(len(rows[i][0]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(rows[i][0])] = torch.tensor(rows[i][0])
            logprobs = F.log_softmax(self.logits(ids), dim=-1).cpu()
            for row, i in enumerate(batch):
                inputs, continuation_ids = rows[i]
                if not continuation_ids:
                    results[i] = (0.0, True)
                    continue
                scored = logprobs[row, len(inputs) - len(continuation_ids):len(inputs)]
                target = torch.tensor(continuation_ids)
                total = scored.gather(1, target[:, None]).sum()
                results[i] = (float(total), bool((scored.argmax(-1) == target).all()))
        return results

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """log p(text | prefix token), every token scored once with the most left context."""
        results = []
        for text in texts:
            ids = self.tokenizer.encode(text)
            if not ids:
                results.append(0.0)
                continue
            scored = score_tokens(self.logits, self.prefix_ids + ids, self.context, self.context,
                                  self.batch_size, self.device)
            results.append(-scored["nats"])
        return results

    def generate_until(self, requests: Sequence[tuple[str, dict]]) -> list[str]:
        """Greedy continuations, each cut at the first of its `until` strings."""
        jobs = []  # (index, context ids, until, max tokens)
        for index, (context, gen_kwargs) in enumerate(requests):
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            if (gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0) > 0) and not self._warned_sampling:
                log.warning("generate_until: the request asks to sample (%s); attnlab answers greedily", gen_kwargs)
                self._warned_sampling = True
            ids = (self.tokenizer.encode(context) if context else list(self.prefix_ids))[-self.context:]
            jobs.append((index, ids, until, max_tokens))
        results: list[str | None] = [None] * len(jobs)
        groups: dict[tuple, list] = {}
        for job in jobs:
            groups.setdefault((len(job[1]), tuple(job[2]), job[3]), []).append(job)
        for (_, until, max_tokens), group in groups.items():
            for start in range(0, len(group), self.batch_size):
                batch = group[start:start + self.batch_size]
                texts = self._greedy(torch.tensor([job[1] for job in batch]), list(until), max_tokens)
                for job, text in zip(batch, texts):
                    results[job[0]] = text
        return results

    def _greedy(self, ids: torch.Tensor, until: list[str], max_tokens: int) -> list[str]:
        if self.tokenizer.end_of_text_id is not None:  # decode writes the token as this text
            until = [*until, END_OF_TEXT]
        generated = [[] for _ in range(len(ids))]
        done = [False] * len(ids)
        ids = ids.to(self.device)
        for _ in range(max_tokens):
            next_ids = self.logits(ids[:, -self.context:])[:, -1].argmax(-1)
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
            for row, token in enumerate(next_ids.tolist()):
                if not done[row]:
                    generated[row].append(token)
                    done[row] = any(stop in self.tokenizer.decode(generated[row]) for stop in until)
            if all(done):
                break
        texts = []
        for tokens in generated:
            text = self.tokenizer.decode(tokens)
            cuts = [text.index(stop) for stop in until if stop in text]
            texts.append(text[:min(cuts)] if cuts else text)
        return texts


def load_for_harness(ckpt: str | None = None, export: str | None = None, which: str = "best",
                     device: str = "cpu", backend: str | None = None) -> tuple[GPT, Tokenizer, dict]:
    """(model, tokenizer, description) from one checkpoint (ckpt=) or one export folder (export=)."""
    if (ckpt is None) == (export is None):
        raise ValueError("give exactly one of ckpt= (a checkpoint or run directory) or export= (an eval.export folder)")
    if export is not None:
        from eval.export import load_exported

        model, tokenizer = load_exported(export, device=device, backend=backend)
        return model, tokenizer, {"export": str(export), "variant": model.cfg.attn.name, "tokenizer": tokenizer.describe()}
    paths = common.resolve_checkpoints(ckpt, which)
    if len(paths) != 1:
        raise ValueError(f"the harness evaluates one checkpoint; ckpt={ckpt} gives {len(paths)}")
    run = common.load_run(paths[0], device=device, backend=backend)
    tokenizer, _ = common.tokenizer_for_run(run, OmegaConf.create({}))
    return run.model, tokenizer, run.describe()


try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # the adapter needs lm-evaluation-harness; HarnessScorer does not
    LM = None

if LM is not None:

    @register_model("attnlab")
    class AttnlabLM(HarnessScorer, LM):
        """lm_eval model "attnlab": model_args ckpt=RUN_DIR (or export=DIR), which, backend,
        precision, max_gen_toks; lm_eval passes batch_size and device."""

        def __init__(self, model: GPT | None = None, tokenizer: Tokenizer | None = None, ckpt: str | None = None,
                     export: str | None = None, which: str = "best", backend: str | None = None,
                     device: str | None = None, batch_size: int | str = 8, max_batch_size: int | None = None,
                     precision: str = "auto", max_gen_toks: int | str = 256):
            LM.__init__(self)
            device = str(common.pick_device(device or "auto"))
            if model is None:
                model, tokenizer, _ = load_for_harness(ckpt, export, which, device, backend)
            elif tokenizer is None:
                raise ValueError("AttnlabLM(model=...) needs tokenizer= too")
            if isinstance(batch_size, str) and not batch_size.isdigit():
                raise ValueError(f"batch_size must be a positive int (attnlab has no 'auto' batch size), got {batch_size!r}")
            HarnessScorer.__init__(self, model, tokenizer, batch_size=int(batch_size), device=device,
                                   precision=precision, max_gen_toks=int(max_gen_toks))

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            return HarnessScorer.loglikelihood(self, [request.args for request in requests])

        def loglikelihood_rolling(self, requests) -> list[float]:
            return HarnessScorer.loglikelihood_rolling(self, [request.args[0] for request in requests])

        def generate_until(self, requests) -> list[str]:
            return HarnessScorer.generate_until(self, [request.args for request in requests])

        @property
        def max_length(self) -> int:
            return self.context

        @property
        def tokenizer_name(self) -> str:
            return f"attnlab-{self.tokenizer.kind}-{self.tokenizer.hash[:16]}"


# ---------------------------------------------------------------------------- command


def _task_list(tasks: Any) -> list[str]:
    if OmegaConf.is_list(tasks) or isinstance(tasks, (list, tuple)):
        names = [str(t) for t in tasks]
    elif isinstance(tasks, str):
        names = [t.strip() for t in tasks.split(",")]
    else:
        names = []
    if not names or not all(names):
        raise ValueError(f"tasks must be a list of lm_eval task names, e.g. tasks=[lambada_openai,hellaswag]; got {tasks!r}")
    return names


def check_options(cfg: DictConfig) -> list[str]:
    if OmegaConf.is_missing(cfg, "tasks"):
        raise ValueError("tasks=... is required: lm_eval task names, e.g. tasks=[lambada_openai]")
    tasks = _task_list(cfg.tasks)
    if cfg.num_fewshot is not None and (not isinstance(cfg.num_fewshot, int) or cfg.num_fewshot < 0):
        raise ValueError(f"num_fewshot must be an int >= 0 or null, got {cfg.num_fewshot!r}")
    limit = cfg.limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0
                              or (isinstance(limit, float) and limit > 1)):
        raise ValueError(f"limit must be a positive int (examples per task), a fraction in (0, 1] or null, got {limit!r}")
    if cfg.include_path is not None and not Path(os.path.expanduser(str(cfg.include_path))).is_dir():
        raise ValueError(f"include_path={cfg.include_path} is not a folder (of lm_eval task YAML files)")
    if not isinstance(cfg.bootstrap_iters, int) or cfg.bootstrap_iters < 0:
        raise ValueError(f"bootstrap_iters must be an int >= 0, got {cfg.bootstrap_iters!r}")
    return tasks


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
LOCAL_DATASET_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # datasets' builders that read files


def _yaml_field(text: str, key: str) -> str | None:
    """A top-level `key: value` of a task YAML, read as text (lm_eval's own loader parses every task
    file it has, tens of seconds)."""
    match = re.search(rf"^{key}:[ \t]*['\"]?([^'\"#\s]+)", text, re.M)
    return match.group(1) if match else None


def _task_files(folder: Path, names: set[str]) -> dict[str, Path]:
    """name -> the YAML file below `folder` that defines task `name` (those of `names` found). Files
    named after a task are read first (lm_eval's usual layout); the rest only for names still missing."""
    named, others = [], []
    for dirpath, _, files in os.walk(folder):
        for file in files:
            stem, suffix = os.path.splitext(file)
            if suffix in (".yaml", ".yml"):
                (named if stem in names else others).append(os.path.join(dirpath, file))
    found: dict[str, Path] = {}
    for path in sorted(named) + sorted(others):
        if len(found) == len(names):
            break
        with open(path, encoding="utf-8", errors="replace") as f:
            name = _yaml_field(f.read(), "task")
        if name in names and name not in found:
            found[name] = Path(path)
    return found


def _dataset_of(task_file: Path, depth: int = 0) -> str | None:
    """The task's dataset_path, from its file or the templates it includes."""
    text = task_file.read_text(encoding="utf-8", errors="replace")
    dataset, include = _yaml_field(text, "dataset_path"), _yaml_field(text, "include")
    if dataset is None and include is not None and depth < 4 and (task_file.parent / include).is_file():
        return _dataset_of(task_file.parent / include, depth + 1)
    return dataset


def hub_tasks_missing_offline(tasks: Sequence[str], include_path: str | None) -> dict[str, str]:
    """With the Hub switched off (OFFLINE_VARIABLES), the tasks among `tasks` that are lm_eval's own
    (not defined in include_path) and read a Hub data set that neither the datasets cache nor the
    Hub cache holds: {task: data set}. Empty when online, and for names that are not single tasks
    (groups, tags), which lm_eval resolves itself."""
    if not any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in OFFLINE_VARIABLES):
        return {}
    names = set(tasks)
    if include_path:
        names -= set(_task_files(Path(os.path.expanduser(include_path)), names))
    spec = importlib.util.find_spec("lm_eval")
    if not names or spec is None or spec.origin is None:
        return {}
    from datasets import config as datasets_config
    from huggingface_hub import constants as hub_constants

    missing = {}
    for task, task_file in _task_files(Path(spec.origin).parent / "tasks", names).items():
        dataset = _dataset_of(task_file)
        if dataset is None or dataset in LOCAL_DATASET_BUILDERS or Path(dataset).expanduser().exists():
            continue
        cached = (Path(datasets_config.HF_DATASETS_CACHE) / dataset.replace("/", "___"),
                  Path(hub_constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}")
        if not any(path.exists() for path in cached):
            missing[task] = dataset
    return {task: missing[task] for task in tasks if task in missing}


def run_lm_harness(cfg: DictConfig) -> dict:
    """Evaluate the one checkpoint named by cfg.ckpt on cfg.tasks; returns the result (also written as JSON)."""
    common.require_ckpt(cfg)
    tasks = check_options(cfg)
    if LM is None:
        raise ValueError('eval.lm_harness needs lm-evaluation-harness, the eval extra: pip install ".[eval]"')
    missing = hub_tasks_missing_offline(tasks, cfg.include_path)
    if missing:
        needs = "; ".join(f"{task} needs the Hugging Face Hub data set {dataset}" for task, dataset in missing.items())
        raise ValueError(
            f"tasks: {needs}, which is not in the local cache, and the Hub is off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): "
            "run it once online to cache the data, or evaluate a local task: include_path=DIR with a task YAML whose "
            "dataset_path is json and dataset_kwargs.data_files names your JSONL file, then tasks=[<its task name>]")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    device = common.pick_device(cfg.device)
    paths = common.resolve_checkpoints(cfg.ckpt, cfg.which)
    if len(paths) != 1:
        raise ValueError(f"eval.lm_harness evaluates one checkpoint; ckpt={cfg.ckpt} gives {len(paths)}")
    task_manager = TaskManager(include_path=os.path.expanduser(str(cfg.include_path)) if cfg.include_path else None)
    unknown = [t for t in tasks if not task_manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"tasks: unknown lm_eval task(s) {unknown} (python -m lm_eval ls tasks lists them; "
                         "include_path= adds a folder of task YAMLs)")
    run = common.load_run(paths[0], device=device, backend=cfg.backend)
    tokenizer, data_cfg = common.tokenizer_for_run(run, cfg)
    lm = AttnlabLM(model=run.model, tokenizer=tokenizer, device=str(device), batch_size=cfg.batch_size,
                   precision=cfg.precision, max_gen_toks=cfg.max_gen_toks)
    output = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit, task_manager=task_manager,
        bootstrap_iters=cfg.bootstrap_iters, log_samples=False, random_seed=cfg.seed, numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed,
    )
    result = {
        "kind": "lm_harness",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": run.describe(),
        "tasks": tasks,
        "results": output["results"],
        "groups": output.get("groups"),
        "n-shot": output.get("n-shot"),
        "n-samples": output.get("n-samples"),
        "task_versions": output.get("versions"),
        "eval": common.eval_config_record(cfg, data_cfg),
        "versions": {**common.versions(), "lm_eval": lm_eval.__version__},
    }
    path = common.output_path(paths[0], "lm_harness", "-".join(tasks), cfg.out)
    result["path"] = str(path)
    common.write_json(path, result)
    print(make_table(output))
    log.info("wrote %s", path)
    return result


@hydra.main(version_base="1.3", config_path=common.CONFIG_DIR, config_name="eval/lm_harness")
def main(cfg: DictConfig) -> None:
    with common.clean_errors():
        run_lm_harness(cfg)


if __name__ == "__main__":
    main()
