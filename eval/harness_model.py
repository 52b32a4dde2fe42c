"""The lm_eval model "attnlab": a trained run (a checkpoint or run directory, ckpt=) or an eval.export
folder (export=) answering lm-evaluation-harness's requests. Importing this module registers it, so the
harness's own Python API works: `import eval.harness_model; lm_eval.simple_evaluate(model="attnlab",
model_args="ckpt=RUN_DIR", tasks=[...])`. `python -m eval.lm_harness` (eval/lm_harness.py) is the
command that evaluates a run with it.

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
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from data.sources import DOCUMENT_SEPARATOR
from data.tokenizers import END_OF_TEXT, Tokenizer
from eval import common
from runs.model import load_run
from runs.run import resolve_checkpoints
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
    paths = resolve_checkpoints(ckpt, which)
    if len(paths) != 1:
        raise ValueError(f"the harness evaluates one checkpoint; ckpt={ckpt} gives {len(paths)}")
    run = load_run(paths[0], device=device, backend=backend)
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
