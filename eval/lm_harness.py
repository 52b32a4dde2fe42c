"""lm-evaluation-harness on a trained run (the `eval` extra: pip install ".[eval]").

    python -m eval.lm_harness ckpt=RUN_DIR tasks=[lambada_openai,hellaswag] [num_fewshot=0] [limit=100]
        [batch_size=8] [include_path=DIR_OF_TASK_YAMLS] [max_gen_toks=256]

Writes <run>/eval/<ckpt stem>.lm_harness-<tasks>.json (runs.run.eval_result_path; or out=) and prints the
table. The model the harness evaluates is lm_eval's model "attnlab" (eval/harness_model.py, which
also describes how each kind of request is scored).

This module is the command alone and imports nothing heavy at the top: its options and the offline
check below are answered before torch, lm_eval and the checkpoint are loaded (about ten seconds).
Offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set): one of lm_eval's own tasks whose data set is a
Hub data set missing from the local caches is refused at once, in one line naming the task, the data
set and the local-task alternative (hub_tasks_missing_offline; lm_eval's task YAML files are read from
its installed folder as text, without importing lm_eval, whose task index alone takes half a minute).
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
from omegaconf import DictConfig, OmegaConf

from eval import command_line
from runs.config_dir import CONFIG_DIR

log = logging.getLogger("attnlab.eval.lm_harness")


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


def _cached_copies(dataset: str) -> tuple[Path, Path]:
    """Where a Hub data set is once cached: the datasets cache (HF_DATASETS_CACHE, else <HF_HOME>/datasets,
    as `datasets.config` decides; importing it takes seconds) and the Hub cache."""
    from huggingface_hub import constants as hub_constants  # a small module

    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(hub_constants.HF_HOME, "datasets")
    return (Path(datasets_cache).expanduser() / dataset.replace("/", "___"),
            Path(hub_constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}")


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
    missing = {}
    for task, task_file in _task_files(Path(spec.origin).parent / "tasks", names).items():
        dataset = _dataset_of(task_file)
        if dataset is None or dataset in LOCAL_DATASET_BUILDERS or Path(dataset).expanduser().exists():
            continue
        if not any(path.exists() for path in _cached_copies(dataset)):
            missing[task] = dataset
    return {task: missing[task] for task in tasks if task in missing}


def run_lm_harness(cfg: DictConfig) -> dict:
    """Evaluate the one checkpoint named by cfg.ckpt on cfg.tasks; returns the result (also written as JSON)."""
    command_line.require_ckpt(cfg)
    tasks = check_options(cfg)
    if importlib.util.find_spec("lm_eval") is None:
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

    from eval import common
    from eval.harness_model import AttnlabLM
    from runs.model import load_run
    from runs.run import eval_result_path, resolve_checkpoints

    device = common.pick_device(cfg.device)
    paths = resolve_checkpoints(cfg.ckpt, cfg.which)
    if len(paths) != 1:
        raise ValueError(f"eval.lm_harness evaluates one checkpoint; ckpt={cfg.ckpt} gives {len(paths)}")
    task_manager = TaskManager(include_path=os.path.expanduser(str(cfg.include_path)) if cfg.include_path else None)
    unknown = [t for t in tasks if not task_manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"tasks: unknown lm_eval task(s) {unknown} (python -m lm_eval ls tasks lists them; "
                         "include_path= adds a folder of task YAMLs)")
    run = load_run(paths[0], device=device, backend=cfg.backend)
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
    path = eval_result_path(paths[0], "lm_harness", "-".join(tasks), cfg.out)
    result["path"] = str(path)
    common.write_json(path, result)
    print(make_table(output))
    log.info("wrote %s", path)
    return result




@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval/lm_harness")
def main(cfg: DictConfig) -> None:
    with command_line.clean_errors():
        run_lm_harness(cfg)


if __name__ == "__main__":
    command_line.run(main)
