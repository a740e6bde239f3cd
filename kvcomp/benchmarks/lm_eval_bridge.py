"""lm-eval tasks through the compressed cache (LongBench, AIME, lm-eval's RULER, or any task list).

lm-eval's ``HFLM`` never reads a custom cache: its loglikelihood path is one cache-less forward and
its ``generate`` builds its own cache. :class:`CompressedCacheLM` fixes both:

- ``generate_until``: every batch gets a fresh :class:`~kvcomp.cache.CompressedCache` (prefill, then
  greedy decoding through it; :mod:`kvcomp.benchmarks.generation`); ``max_gen_toks`` can be capped.
- loglikelihood (and rolling loglikelihood): context + continuation run through a fresh cache under
  the ``streaming`` protocol (``simulated`` if configured), so every continuation token reads the
  compressed context exactly as if the text had been fed token by token. A model-scope codec (kvtc)
  encodes a block only after the forward that completes it, so its requests are fed one compression
  event (``every`` tokens) per forward through an ``exact_prefill`` cache instead.
- ``truncation: middle`` keeps the first and last halves of an over-long context (LongBench's
  reference; lm-eval cuts on the left).

Data: ``data: hub`` uses the tasks unchanged; ``data: fixtures`` rebuilds each task from its lm-eval
YAML with the dataset replaced by a local JSON-lines file in the hub format
(``kvcomp/benchmarks/fixtures/``); ``auto`` picks the hub when it answers.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import torch

from kvcomp.benchmarks import Benchmark
from kvcomp.benchmarks.generation import GenerationProtocol
from kvcomp.cache import CompressedCache, with_cache
from kvcomp.data import HubUnavailableError
from kvcomp.errors import ConfigError, unknown_choice

FIXTURES = Path(__file__).parent / "fixtures"
DATA_SOURCES = ("auto", "hub", "fixtures")
TRUNCATIONS = ("left", "middle")

log = logging.getLogger(__name__)


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face hub answers (False when ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is set)."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    try:
        urllib.request.urlopen(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=timeout)
        return True
    except Exception:  # DNS, proxy, TLS and HTTP failures all mean "not usable here"
        return False


def _lm_class():
    """``CompressedCacheLM``, defined on first use (importing lm-eval takes seconds)."""
    from lm_eval.models.huggingface import HFLM

    class CompressedCacheLM(HFLM):
        """``HFLM`` whose every request reads a fresh compressed cache (see the module docstring)."""

        def __init__(self, model, tokenizer, codec, protocol: GenerationProtocol, *, truncation: str = "left",
                     max_gen_toks_cap: int | None = None, **kwargs):
            super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
            self.codec, self.protocol = codec, protocol
            self.truncation_side, self.max_gen_toks_cap = truncation, max_gen_toks_cap
            self.scoring_protocol = "simulated" if protocol.protocol == "simulated" else "streaming"

        def _model_call(self, inps, attn_mask=None, labels=None):
            with torch.no_grad():
                if self.codec.scope == "model":  # blocks encode after a forward: feed one compression event at a time
                    cache = CompressedCache(self.codec, "exact_prefill")
                    step = self.codec.policy("key", 0).block_size or inps.shape[1]
                    return torch.cat([self.model(part, **with_cache(self.model, cache), use_cache=True).logits
                                      for part in inps.split(step, dim=1)], dim=1)
                cache = CompressedCache(self.codec, self.scoring_protocol)
                return self.model(inps, **with_cache(self.model, cache), use_cache=True).logits

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            # lm-eval's max_length is the context plus the generation budget: the cache is preallocated for it
            generation_kwargs.update(with_cache(self.model, self.protocol.new_cache(self.codec, max_length)))
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

        def generate_until(self, requests, disable_tqdm: bool = False):
            if self.max_gen_toks_cap is not None:
                for request in requests:
                    context, kwargs = request.args
                    budget = min(kwargs.get("max_gen_toks", self.max_gen_toks), self.max_gen_toks_cap)
                    request.arguments = (context, {**kwargs, "max_gen_toks": budget})
            return super().generate_until(requests, disable_tqdm)

        def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
            if self.truncation_side != "middle" or not left_truncate_len:
                return super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
            rows = [middle_truncate(self.tok_encode(s), left_truncate_len) for s in strings]
            width = max(map(len, rows))
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            return ids, mask

    return CompressedCacheLM


def middle_truncate(ids: list[int], max_len: int) -> list[int]:
    """LongBench's truncation: the first ``max_len // 2`` and the last ``max_len - max_len // 2`` tokens."""
    if len(ids) <= max_len:
        return ids
    half = max_len // 2
    return ids[:half] + ids[len(ids) - (max_len - half):]


def fixture_task_spec(task_manager, task: str, data_file: Path) -> dict:
    """``task``'s lm-eval config with its dataset replaced by the JSON-lines ``data_file`` (split ``train``)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = task_manager.task_index.get(task)
    if entry is None or entry.yaml_path is None:
        raise ConfigError(f"lm-eval has no YAML task named {task!r} to run on a local fixture")
    spec = load_yaml(entry.yaml_path, resolve_func=True)
    spec.pop("tag", None)
    spec.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {"train": str(data_file)}})
    for split in ("test_split", "training_split", "fewshot_split", "validation_split"):
        if spec.get(split):
            spec[split] = "train"
    return spec


class LMEvalBenchmark(Benchmark):
    """lm-eval tasks with every request through the compressed cache: one row, ``score_<task>`` (each
    task's first metric) and ``score_avg``; every metric lm-eval reports is kept under ``lm_eval``."""

    def prepare(self, model, tokenizer, model_cfg) -> None:
        from lm_eval.tasks import TaskManager

        c = self.config
        if not c.tasks:
            raise ConfigError("benchmark.tasks is empty: name the lm-eval tasks to run")
        if c.data not in DATA_SOURCES:
            raise unknown_choice("lm-eval data source", c.data, DATA_SOURCES)
        if c.truncation not in TRUNCATIONS:
            raise unknown_choice("truncation", c.truncation, TRUNCATIONS)
        self.protocol = GenerationProtocol(c.protocol, c.compress_generated)
        self.tokenizer, self.max_length = tokenizer, c.max_length or model_cfg.max_context
        self.source = c.data if c.data != "auto" else ("hub" if hub_reachable() else "fixtures")
        if c.data == "hub" and not hub_reachable():
            raise HubUnavailableError(
                f"benchmark {c.name} reads {list(c.tasks)} from the Hugging Face hub, which is unreachable; offline, "
                "use benchmark=ruler (kvcomp's RULER generator) or benchmark.data=fixtures where fixtures exist"
            )
        self.metadata = dict(c.metadata)
        if c.name == "ruler_lmeval":
            self.metadata.setdefault("pretrained", model_cfg.hub_id)
        self.task_manager = TaskManager(metadata=self.metadata or None)
        if self.source == "hub":
            self.tasks = list(c.tasks)
            return
        missing = [t for t in c.tasks if t not in c.fixtures]
        if missing:
            raise ConfigError(
                f"data=fixtures (the hub is {'not used' if c.data == 'fixtures' else 'unreachable'}) but "
                f"{missing} have no local fixture in benchmark.fixtures; run with the hub (data=hub) or add fixtures"
            )
        self.fixture_files = {t: (FIXTURES / c.fixtures[t]).resolve() for t in c.tasks}
        for task, path in self.fixture_files.items():
            if not path.is_file():
                raise ConfigError(f"fixture for {task} not found: {path}")
        self.tasks = [fixture_task_spec(self.task_manager, t, self.fixture_files[t]) for t in c.tasks]
        log.warning("%s: running the local fixtures (kvcomp/benchmarks/fixtures/), not the hub datasets: they exercise "
                    "the pipeline, their scores say nothing about the benchmark", c.name)

    def fingerprint(self) -> dict:
        files = {t: p.read_text() for t, p in getattr(self, "fixture_files", {}).items()}
        return {"source": self.source, "fixtures": files, "benchmark": asdict(self.config) | {"include_reference": None}}

    def evaluate(self, model, codec) -> list[dict]:
        import lm_eval

        c = self.config
        lm = _lm_class()(
            model, self.tokenizer, codec, self.protocol, truncation=c.truncation, max_gen_toks_cap=c.max_gen_toks,
            batch_size=c.batch_size, max_length=self.max_length, device=str(next(model.parameters()).device),
        )
        start = time.perf_counter()
        output = lm_eval.simple_evaluate(
            model=lm, tasks=self.tasks, task_manager=self.task_manager, limit=c.limit, num_fewshot=c.num_fewshot,
            apply_chat_template=c.chat_template, metadata=self.metadata or None, log_samples=False,
        )
        metrics = {
            task: {k: v for k, v in values.items() if k not in ("alias", "sample_len") and "stderr" not in k and isinstance(v, (int, float))}
            for task, values in output["results"].items()
        }
        groups = set(output.get("groups", {}))
        row = {"benchmark": f"{c.name}:{self.source} ({len(metrics) - len(groups)} tasks)", "lm_eval": metrics}
        for task, values in metrics.items():
            if values and task not in groups:
                row[f"score_{task}"] = next(iter(values.values()))
        scores = [v for k, v in row.items() if k.startswith("score_")]
        row["score_avg"] = sum(scores) / len(scores) if scores else None
        row["eval_seconds"] = round(time.perf_counter() - start, 2)
        return [row]
