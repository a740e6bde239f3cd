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
- per doc, from lm-eval's logged samples: the first metric's score, the generation's length and repetition rate,
  and the gold continuation's log-probability after the compressed prompt (:func:`answer_logp`; generation tasks
  pay one more prefill per doc for it), so that the runner pairs the row with the reference's doc by doc
  (:mod:`kvcomp.benchmarks.intervals`) and the degenerate-output gate reads it (:mod:`kvcomp.benchmarks.gate`).
- ``truncation: middle`` keeps the first and last halves of an over-long context (LongBench's
  reference; lm-eval cuts on the left).
- a press (``press=...``, :mod:`kvcomp.presses`): generation tasks only (``generate_until``), each prompt pressed
  after its exact prefill. lm-eval's prompts end with the question, so the question is pressed with its context
  (a question-aware setting, easier for presses that score with the last queries than kvpress's pipeline, which
  keeps the question out: ``benchmark=ruler`` does that). Loglikelihood tasks feed context and continuation in one
  forward, which leaves nothing to press after the context: refused by name before the model loads (and tasks defined
  by a Python class, whose request types are not known until they run).

Data (``benchmark.data``), decided by :meth:`LMEvalBenchmark.check` before the model loads:

- ``hub``: online, the tasks run unchanged (``datasets`` downloads their data); the hub must answer.
  In Hugging Face offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) it means the local cache.
  ``datasets`` offline resolves a hub id only through its own prepared Arrow cache (``$HF_HOME/datasets``),
  never from the repository files that ``hf download ORG/NAME --repo-type dataset`` leaves in the hub
  cache (``$HF_HOME/hub/datasets--ORG--NAME/snapshots/<commit>/``). So a task (of a group or tag: each of
  its tasks) whose data ``datasets`` already loads offline runs unchanged, and one whose repository is in
  the hub cache is pointed at the snapshot folder: ``dataset_path`` becomes that folder in the task
  index of the run's ``TaskManager``, ``dataset_name`` stays. ``datasets`` then resolves the config's
  files from the repository's own README ``configs:`` (or its file layout) and its features from the
  README, as it does on the hub, rather than kvcomp re-deriving them for a ``parquet`` / ``json`` builder.
  A task whose data is in neither place is one error, before the model loads, naming the ``hf download``
  commands. Tasks whose data lm-eval's own code makes (``custom_dataset``, Python tasks) run unchanged:
  they may need the network.
- ``fixtures``: each task is rebuilt from its lm-eval YAML with the dataset replaced by a local JSON-lines
  file in the hub format (``kvcomp/benchmarks/fixtures/``).
- ``auto``: the hub when online and it answers; offline, the local cache when every task's data is
  there; otherwise the fixtures.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import re
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcomp.benchmarks.base import Benchmark, register
from kvcomp.benchmarks.configs import LMEvalConfig
from kvcomp.benchmarks.generation import GenerationProtocol, answer_logprob, repetition_rate
from kvcomp.benchmarks.intervals import sample_means
from kvcomp.cache import CompressedCache, with_cache
from kvcomp.data import HubUnavailableError, dataset_download_command, hub_offline
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.progress import progress

FIXTURES = Path(__file__).parent / "fixtures"
DATA_SOURCES = ("auto", "hub", "fixtures")
TRUNCATIONS = ("left", "middle")
SPLIT_FIELDS = ("training_split", "validation_split", "test_split", "fewshot_split")
DATASET_FIELDS = {"dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset"}
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
LIKELIHOOD_TYPES = ("loglikelihood", "multiple_choice")  # request types whose gold continuation lm-eval scores
log = logging.getLogger(__name__)


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face hub answers (False in offline mode, without asking)."""
    if hub_offline():
        return False
    try:
        urllib.request.urlopen(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=timeout)
        return True
    except Exception:  # DNS, proxy, TLS and HTTP failures all mean "not usable here"
        return False


def _lm_class():
    """``CompressedCacheLM``, defined on first use (importing lm-eval takes seconds)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import normalize_gen_kwargs

    class CompressedCacheLM(HFLM):
        """``HFLM`` whose every request reads a fresh compressed cache (see the module docstring)."""

        def __init__(self, model, tokenizer, codec, protocol: GenerationProtocol, *, truncation: str = "left",
                     max_gen_toks_cap: int | None = None, **kwargs):
            super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
            self.codec, self.protocol = codec, protocol
            self.truncation_side, self.max_gen_toks_cap = truncation, max_gen_toks_cap
            self.scoring_protocol = "simulated" if protocol.protocol == "simulated" else "streaming"

        def _model_call(self, inps, attn_mask=None, labels=None):
            if self.protocol.press is not None:  # LMEvalBenchmark.evaluate refuses such tasks before they run
                raise ConfigError("a press evicts after a prefill; loglikelihood requests score their continuation in "
                                  "the same forward as their context")
            with torch.no_grad():
                if self.codec.encodes_after_forward():  # blocks encode after a forward: feed one compression event at a time
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

        def prompt_ids(self, context: str, gen_kwargs: dict) -> torch.Tensor:
            """``context`` as :meth:`generate_until` feeds it ``[1, T]``: tokenized, truncated to leave room for the
            request's generation budget (``gen_kwargs``, as capped)."""
            budget = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)["max_gen_toks"]
            return self.tok_batch_encode([context], left_truncate_len=self.max_length - budget,
                                         truncation=self.truncation)[0]

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
    for split in SPLIT_FIELDS:
        if spec.get(split):
            spec[split] = "train"
    return spec


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of hub dataset ``repo_id`` in the local hub cache (``$HF_HOME/hub``, as
    ``hf download --repo-type dataset`` leaves it), or None when it is not there."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="dataset")
    ref = storage / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision  # a revision may name a commit
    folder = storage / "snapshots" / commit if commit else None
    return folder if folder is not None and folder.is_dir() else None


@dataclass
class TaskData:
    """Where one lm-eval task's data comes from offline (see the module docstring)."""

    task: str
    repo: str | None = None  # its hub dataset (None: lm-eval's code generates the data, or local files)
    config: str | None = None
    snapshot: Path | None = None  # the hub-cache snapshot it is pointed at (None: it runs unchanged)
    problem: str | None = None  # why it cannot run offline (None: it can)
    generated: bool = False  # lm-eval's own code makes the data (custom_dataset, Python task)


def _shorten(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def leaf_tasks(task_manager, name: str) -> list[tuple[str, dict, bool]]:
    """``(task, config, redirectable)`` for each task ``name`` runs: itself, or the members of a tag or a
    group (recursively). Configs are the task index's (includes merged, functions unresolved);
    ``redirectable``: a YAML task of the index, whose dataset :func:`point_task_at` can replace."""
    from lm_eval.tasks._index import Kind

    entry = task_manager.task_index.get(name)
    if entry is None:
        raise ConfigError(f"lm-eval has no task, group or tag named {name!r}")
    if entry.kind is Kind.TAG:
        return [leaf for task in sorted(entry.tags) for leaf in leaf_tasks(task_manager, task)]
    if entry.kind is Kind.GROUP:
        return _group_members(task_manager, name, (entry.cfg or {}).get("task", []))
    return [(name, entry.cfg or {}, entry.kind is Kind.TASK and entry.yaml_path is not None)]


def _group_members(task_manager, group: str, members) -> list[tuple[str, dict, bool]]:
    """:func:`leaf_tasks` of a group's ``task:`` list: names, or dicts (a reference with overrides, an inline
    task or group)."""
    leaves = []
    for member in members if isinstance(members, list) else [members]:
        if isinstance(member, str):
            leaves += leaf_tasks(task_manager, member)
            continue
        ref = member.get("group") or member.get("task")
        entry = task_manager.task_index.get(ref)
        if entry is not None and not DATASET_FIELDS & member.keys():
            leaves += leaf_tasks(task_manager, ref)
        elif "group" in member:
            leaves += _group_members(task_manager, f"{group}::{ref}", member.get("task", []))
        else:  # an inline task, or one whose dataset the group overrides: its data is defined in the group's file
            base = entry.cfg if entry is not None and entry.cfg else {}
            leaves.append((f"{group}::{ref}", {**base, **member}, False))
    return leaves


def find_offline_data(task: str, config: dict, redirectable: bool) -> TaskData:
    """Where ``task`` (its index ``config``) reads its data offline: the Arrow cache of ``datasets`` (the task
    runs unchanged), a hub-cache snapshot (it is to be pointed there), or nowhere (``problem`` says why)."""
    import datasets

    if config.get("custom_dataset") or "class" in config:
        return TaskData(task, generated=True)
    path = config.get("dataset_path")
    if not isinstance(path, str) or not HUB_ID.fullmatch(path) or Path(path).exists():
        return TaskData(task)  # a packaged builder (json, csv, ...) or local files: unchanged
    name = config.get("dataset_name") or None
    kwargs = {k: v for k, v in (config.get("dataset_kwargs") or {}).items() if k != "trust_remote_code"}
    found = TaskData(task, path, name)
    try:  # offline, datasets resolves a hub id through its prepared Arrow cache only
        datasets.load_dataset_builder(path, name, **kwargs)
        return found
    except Exception:  # not prepared (datasets raises ConnectionError, FileNotFoundError or ValueError)
        pass
    found.snapshot = hub_snapshot(path, kwargs.pop("revision", None))
    if found.snapshot is None:
        found.problem = f"not in the local cache; download it with `{dataset_download_command(path)}`"
    elif not redirectable:
        found.problem = ("its dataset is defined inside a group's file, which kvcomp cannot point at the local "
                         f"cache {found.snapshot}; run it once online so that datasets prepares its Arrow cache")
    else:
        found.problem = _snapshot_problem(found, kwargs, [config.get(f) for f in SPLIT_FIELDS])
    return found


def _snapshot_problem(found: TaskData, kwargs: dict, splits: list) -> str | None:
    """Why ``datasets`` cannot read ``found.config`` (the task's ``splits``) from ``found.snapshot``, or None."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(str(found.snapshot), found.config, **kwargs)
    except Exception as err:  # unknown config, no data files: datasets raises ValueError, FileNotFoundError, ...
        return f"datasets cannot read the local copy {found.snapshot}: {type(err).__name__}: {err}"
    files = {str(split): paths for split, paths in (builder.config.data_files or {}).items()}
    empty = [s for s in dict.fromkeys(splits) if isinstance(s, str) and files and not files.get(s)]
    if empty:
        return (f"the local copy {found.snapshot} has no files for split(s) {empty} (a partial download?); "
                f"download the whole repository with `{dataset_download_command(found.repo)}`")
    return None


def point_task_at(task_manager, task: str, snapshot: Path) -> None:
    """Make ``task_manager`` build ``task`` from the local hub-cache ``snapshot`` of its dataset: its index
    entry becomes its YAML config with ``dataset_path`` = the snapshot folder (``dataset_name`` stays: datasets
    reads the repository's README ``configs:`` from the folder as from the hub; ``revision`` is dropped)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = task_manager.task_index[task]
    spec = load_yaml(entry.yaml_path, resolve_func=True)
    kwargs = {k: v for k, v in (spec.get("dataset_kwargs") or {}).items() if k != "revision"}
    spec.update(dataset_path=str(snapshot), dataset_kwargs=kwargs or None)
    task_manager.task_index[task] = dataclasses.replace(entry, yaml_path=None, cfg=spec)


def load_tasks(task_manager, specs: list) -> tuple[list, dict]:
    """lm-eval's tasks built once from ``specs`` (names or configs): what to evaluate (each spec's groups and the tasks
    outside them, in order) and every task by name, the objects the evaluation runs (:func:`per_doc_values` reads
    their gold answers)."""
    items, tasks = [], {}
    for spec in specs:
        loaded = task_manager.load(spec)
        inner = {name for group in loaded["groups"].values() for name in group.child_names}
        items += [item for name, item in (*loaded["groups"].items(), *loaded["tasks"].items()) if name not in inner]
        tasks |= loaded["tasks"]
    return items, tasks


def per_doc_values(lm, task, samples: list[dict], metric_key: str, *, answers: bool) -> dict[str, list[float]]:
    """One task's per-doc values, in doc order, from lm-eval's logged ``samples`` (those of the filter of
    ``metric_key``, lm-eval's ``metric,filter``):

    - ``scores``: the metric's value per doc, when every doc has a number and the task averages them (their mean is
      ``score_<task>``; a corpus-level metric such as BLEU has none);
    - ``output_lengths``, ``repetition_rates`` (generation tasks): the raw generation (lm-eval's ``resps``, before any
      filter) in tokens, and its :func:`~kvcomp.benchmarks.generation.repetition_rate`;
    - ``answer_logps`` (with ``answers``): :func:`answer_logp` of each doc that has one (absent when none has)."""
    from lm_eval.api.metrics import mean

    metric, filter_key = metric_key.split(",", 1)
    docs = sorted((s for s in samples if s["filter"] == filter_key), key=lambda s: s["doc_id"])
    values, out = [s.get(metric) for s in docs], {}
    if task.aggregation().get(metric, mean) is mean and all(isinstance(v, numbers.Real) for v in values):
        out["scores"] = [float(v) for v in values]
    if task.OUTPUT_TYPE == "generate_until":
        outputs = [lm.tok_encode(s["resps"][0][0], add_special_tokens=False) for s in docs]
        out["output_lengths"] = [len(ids) for ids in outputs]
        out["repetition_rates"] = [repetition_rate(ids) for ids in outputs]
    logps = [logp for s in docs if (logp := answer_logp(lm, task, s)) is not None] if answers else []
    return out | ({"answer_logps": logps} if logps else {})


def answer_logp(lm, task, sample: dict) -> float | None:
    """A doc's gold continuation, its mean log-probability per token after the prompt as the compressed cache holds
    it; None where there is none (a rolling-loglikelihood task, an empty context, no usable gold).

    - generation: :func:`~kvcomp.benchmarks.generation.answer_logprob` of :func:`generation_gold` after the
      request's context, tokenized and truncated as for its generation (``lm.prompt_ids``) and prefilled under the
      same protocol and press; the gold after a space (as RULER's golds follow its answer prefixes) unless either
      brings its own whitespace, cut to what fits in ``max_length``. One more prefill per doc.
    - likelihood (``loglikelihood``, ``multiple_choice``): lm-eval's own log-likelihood of the gold continuation
      (:func:`choice_index`), read through the compressed cache, over its tokens as lm-eval split them."""
    if task.OUTPUT_TYPE == "generate_until":
        context, gen_kwargs = sample["arguments"][0]
        gold = generation_gold(task, sample["doc"], sample["target"])
        if gold is None:
            return None
        ids = lm.prompt_ids(context, gen_kwargs)
        text = gold if context[-1:].isspace() or gold[:1].isspace() else " " + gold
        answer = lm.tok_encode(text, add_special_tokens=False)[: lm.max_length - ids.shape[1]]
        return answer_logprob(lm.model, lm.codec, ids, answer, protocol=lm.protocol)
    if task.OUTPUT_TYPE not in LIKELIHOOD_TYPES:
        return None
    gold = 0 if task.OUTPUT_TYPE == "loglikelihood" else choice_index(task, sample["doc"], sample["target"])
    if gold is None or not sample["arguments"][gold][0]:
        return None
    (loglikelihood, _), *_ = sample["resps"][gold]
    return loglikelihood / len(lm._encode_pair(*sample["arguments"][gold])[1])


def generation_gold(task, doc: dict, target) -> str | None:
    """The gold answer of a generation doc (``target``: lm-eval's ``doc_to_target``), as lm-eval compares it: the
    choice it indexes when the task has choices, the first of several, a number as text; None when empty."""
    if task.config.doc_to_choice is not None and isinstance(target, int):
        target = task.doc_to_choice(doc)[target]
    if isinstance(target, list):
        target = target[0] if target else None
    text = str(target) if isinstance(target, (str, int)) else None
    return text if text and text.strip() else None


def choice_index(task, doc: dict, target) -> int | None:
    """The gold choice of a multiple-choice doc as lm-eval finds it (the first of several); None when out of range."""
    gold = task.doc_to_text(doc) if task.multiple_input else target
    if isinstance(gold, list):
        gold = gold[0] if gold else None
    choices = task.doc_to_choice(doc)
    if isinstance(gold, str):
        gold = choices.index(gold) if gold in choices else None
    return gold if isinstance(gold, int) and 0 <= gold < len(choices) else None


@register
class LMEvalBenchmark(Benchmark):
    """lm-eval tasks with every request through the compressed cache: one row, ``score_<task>`` (each
    task's first metric) and ``score_avg``; every metric lm-eval reports is kept under ``lm_eval``. Per task and doc
    (:func:`per_doc_values`): ``scores``, ``output_lengths``, ``repetition_rates`` and ``answer_logps``, and over
    every doc ``answer_logp``, ``repetition_rate`` and ``output_tokens`` with their ``_ci95``, as RULER's rows."""

    names = ("lm_eval", "longbench", "aime", "ruler_lmeval")  # lm_eval and its presets (conf/benchmark/)
    config_class = LMEvalConfig

    def check(self, model_cfg) -> None:
        """Settings, the data source, and offline that every task's data is in the local cache (the module
        docstring): raises before the model loads. Builds lm-eval's task index once, for :meth:`prepare` too."""
        if getattr(self, "source", None) is not None:
            return  # checked already
        from lm_eval.tasks import TaskManager

        c = self.config
        if not c.tasks:
            raise ConfigError("benchmark.tasks is empty: name the lm-eval tasks to run")
        if c.data not in DATA_SOURCES:
            raise unknown_choice("lm-eval data source", c.data, DATA_SOURCES)
        if c.truncation not in TRUNCATIONS:
            raise unknown_choice("truncation", c.truncation, TRUNCATIONS)
        self.protocol = GenerationProtocol(c.protocol, c.compress_generated)
        offline = c.data != "fixtures" and hub_offline()
        source = "hub_cache" if offline else "hub" if c.data != "fixtures" and hub_reachable() else "fixtures"
        if source == "fixtures" and c.data == "hub":
            raise HubUnavailableError(
                f"benchmark {c.name} reads {list(c.tasks)} from the Hugging Face hub, which is unreachable; to read "
                f"datasets downloaded before (`{dataset_download_command('ORG/NAME')}`), set HF_HUB_OFFLINE=1; or use "
                "benchmark=ruler (kvcomp's RULER generator), or benchmark.data=fixtures where fixtures exist"
            )
        if source == "fixtures":
            self._check_fixtures()
        elif source == "hub_cache" and c.name == "ruler_lmeval":
            raise HubUnavailableError(
                f"benchmark {c.name}: lm-eval's RULER downloads its essays, SQuAD and HotpotQA at run time, which "
                "offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) forbids; offline, use benchmark=ruler "
                "(kvcomp's RULER generator)"
            )
        self.metadata = dict(c.metadata)
        if c.name == "ruler_lmeval":
            self.metadata.setdefault("pretrained", model_cfg.hub_id)
        self.task_manager = getattr(self, "task_manager", None) or TaskManager(metadata=self.metadata or None)
        self.local_data: dict[str, TaskData] = {}
        if source == "hub_cache" and not self._use_local_cache():
            source = "fixtures"  # data=auto, some task's data missing offline: all run on their fixtures
            self._check_fixtures()
        self.source = source

    def _use_local_cache(self) -> bool:
        """Offline: point every task at its local data. When some is missing: False (``auto``, every task
        has a fixture), else one error listing the missing datasets."""
        c = self.config
        has_fixtures = all(t in c.fixtures for t in c.tasks)
        leaves = {task: leaf for name in c.tasks for task, *leaf in leaf_tasks(self.task_manager, name)}
        found = [find_offline_data(task, *leaf) for task, leaf in leaves.items()]
        if missing := [d for d in found if d.problem]:
            lines = {}  # one line per dataset and problem
            for d in missing:
                lines.setdefault((d.repo, d.problem), []).append(d.task)
            listing = "".join(f"  - {repo} (task{'s' * (len(tasks) > 1)} {_shorten(tasks)}): {problem}\n"
                              for (repo, problem), tasks in lines.items())
            if c.data == "auto" and has_fixtures:
                log.warning("%s: offline, some data is not in the local cache, so every task runs on its fixture:\n%s",
                            c.name, listing)
                return False
            from huggingface_hub import constants

            raise HubUnavailableError(
                f"benchmark {c.name}: Hugging Face offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and "
                f"{len(missing)} task(s) cannot read their data from the local cache ({constants.HF_HUB_CACHE}):\n"
                f"{listing}Download where the hub is reachable, into this HF_HOME (or copy its hub/ folder here)"
                + ("; or set benchmark.data=fixtures" if has_fixtures else "")
            )
        for data in found:
            if data.snapshot is not None:
                point_task_at(self.task_manager, data.task, data.snapshot)
                log.info("%s: %s reads %s from the local hub cache (%s)", c.name, data.task, data.repo, data.snapshot)
            elif data.generated:
                log.warning("%s: %s runs unchanged offline: lm-eval's own code makes its data (it may need the "
                            "network)", c.name, data.task)
        self.local_data = {d.task: d for d in found}
        return True

    def _check_fixtures(self) -> None:
        c = self.config
        missing = [t for t in c.tasks if t not in c.fixtures]
        if missing:
            raise ConfigError(
                f"data=fixtures (the hub is {'not used' if c.data == 'fixtures' else 'unavailable'}) but "
                f"{missing} have no local fixture in benchmark.fixtures; run with the hub (data=hub) or add fixtures"
            )
        self.fixture_files = {t: (FIXTURES / c.fixtures[t]).resolve() for t in c.tasks}
        for task, path in self.fixture_files.items():
            if not path.is_file():
                raise ConfigError(f"fixture for {task} not found: {path}")

    def prepare(self, model, tokenizer, model_cfg) -> None:
        self.check(model_cfg)
        c = self.config
        self.tokenizer, self.max_length = tokenizer, c.max_length or model_cfg.max_context
        if self.source != "fixtures":
            self.tasks = list(c.tasks)  # hub_cache: the task manager's index points them at the local copies
            return
        self.tasks = [fixture_task_spec(self.task_manager, t, self.fixture_files[t]) for t in c.tasks]
        log.warning("%s: running the local fixtures (kvcomp/benchmarks/fixtures/), not the hub datasets: they exercise "
                    "the pipeline, their scores say nothing about the benchmark", c.name)

    def fingerprint(self) -> dict:
        files = {t: p.read_text() for t, p in getattr(self, "fixture_files", {}).items()}
        out = {"source": self.source, "fixtures": files, "benchmark": asdict(self.config) | {"include_reference": None}}
        if self.source == "hub_cache":  # a snapshot folder is named after its commit
            out["local"] = {t: f"{d.repo}@{d.snapshot.name}" if d.snapshot else d.repo
                            for t, d in self.local_data.items()}
        return out

    def scored_by_likelihood(self) -> list[str]:
        """The tasks whose requests may not all be generation: lm-eval's ``output_type`` other than ``generate_until``
        (its default), or a task defined by a Python class, whose request types its code decides."""
        return [name for task in self.config.tasks for name, config, _ in leaf_tasks(self.task_manager, task)
                if "class" in config or config.get("output_type", "generate_until") != "generate_until"]

    def check_press(self, press_name: str) -> None:
        """A press takes generation tasks only (the module docstring); the others are named here, before the model
        loads (after :meth:`check`, which builds the task index)."""
        if scored := self.scored_by_likelihood():
            raise ConfigError(f"press {press_name}: lm-eval tasks {_shorten(scored)} score likelihoods (or may: a Python "
                              "task class), whose context and continuation run in one forward, nothing to press after "
                              "the context; choose generation tasks (LongBench, AIME) or press=none")

    def evaluate(self, model, codec, press=None, reference=None) -> list[dict]:
        """One row (the class docstring); lm-eval's logged samples give each task's per-doc values
        (:func:`per_doc_values`), paired with the reference row's by the runner, and their means
        (:func:`~kvcomp.benchmarks.intervals.sample_means`)."""
        import lm_eval

        c = self.config
        if press is not None:
            self.check_press(press.name)
        protocol = dataclasses.replace(self.protocol, press=press)
        lm = _lm_class()(
            model, self.tokenizer, codec, protocol, truncation=c.truncation, max_gen_toks_cap=c.max_gen_toks,
            batch_size=c.batch_size, max_length=self.max_length, device=str(next(model.parameters()).device),
        )
        start = time.perf_counter()
        items, tasks = load_tasks(self.task_manager, self.tasks)
        output = lm_eval.simple_evaluate(
            model=lm, tasks=items, task_manager=self.task_manager, limit=c.limit, num_fewshot=c.num_fewshot,
            apply_chat_template=c.chat_template, metadata=self.metadata or None, log_samples=True,
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
        answers = c.score_answers
        for task, samples in progress(output["samples"].items(), f"{c.name} per-doc values", unit="task"):
            if metrics.get(task):
                first = next(iter(metrics[task]))
                for name, values in per_doc_values(lm, tasks[task], samples, first, answers=answers).items():
                    row.setdefault(name, {})[task] = values
        row |= sample_means(row)
        row["eval_seconds"] = round(time.perf_counter() - start, 2)
        return [row]
