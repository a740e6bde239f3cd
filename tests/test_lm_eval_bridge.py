"""The lm-eval bridge: fixtures in the hub formats, middle truncation, and requests that read the cache."""

import json

import pytest
import torch

from kvcomp.benchmarks.lm_eval_bridge import FIXTURES, fixture_task_spec, hub_reachable, middle_truncate
from kvcomp.config import LMEvalConfig
from kvcomp.errors import ConfigError

@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _preset(name):
    from pathlib import Path

    from omegaconf import OmegaConf

    raw = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "benchmark" / f"{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LMEvalConfig), {k: v for k, v in raw.items() if k != "defaults"}))


def test_middle_truncation_keeps_both_ends():
    ids = list(range(10))
    assert middle_truncate(ids, 6) == [0, 1, 2, 7, 8, 9]
    assert middle_truncate(ids, 5) == [0, 1, 7, 8, 9]
    assert middle_truncate(ids, 12) == ids


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_mode_means_the_local_cache_and_never_asks_the_hub(monkeypatch, variable):
    """Offline, data=hub means the local cache (tests/test_lm_eval_offline.py): the mode is seen, the hub
    never asked."""
    import urllib.request

    from kvcomp.data import hub_offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("asked the hub while offline"))
    assert hub_offline() and hub_reachable() is False


@pytest.mark.parametrize("preset", ["longbench", "aime"])
def test_every_fixture_loads_renders_and_scores_its_gold_answer(task_manager, preset):
    """Each preset task runs on its fixture through lm-eval's own template and metric: the gold answer
    scores high and a wrong one near zero (so the fixtures exercise real scoring)."""
    config = _preset(preset)
    assert sorted(config.fixtures) == sorted(config.tasks)
    if preset == "longbench":
        assert len(config.tasks) == 16 and config.truncation == "middle"
    for task in config.tasks:
        spec = fixture_task_spec(task_manager, task, FIXTURES / config.fixtures[task])
        built = task_manager.load([spec])["tasks"][task]
        docs = list(built.test_docs())
        assert len(docs) >= 2
        for doc in docs:
            prompt = built.doc_to_text(doc)
            assert isinstance(prompt, str) and len(prompt) > 40
            target = built.doc_to_target(doc)
            gold = target[0] if isinstance(target, list) else str(target)
            gold = f"\\boxed{{{gold}}}" if preset == "aime" else gold
            right = built.process_results(doc, [gold])
            wrong = built.process_results(doc, ["zzzz qqqq"])
            key = next(iter(right))
            assert right[key] > 0.5 and wrong[key] < 0.3, (task, right, wrong)  # code_sim is fuzzy


def test_fixtures_are_in_the_hub_formats():
    record = json.loads((FIXTURES / "longbench" / "hotpotqa.jsonl").read_text().splitlines()[0])
    assert {"question", "context", "answers", "length", "dataset", "language", "all_classes", "_id"} <= set(record)
    assert set(json.loads((FIXTURES / "aime" / "aime24.jsonl").read_text().splitlines()[0])) == {"ID", "Problem", "Solution", "Answer"}
    assert set(json.loads((FIXTURES / "aime" / "aime25.jsonl").read_text().splitlines()[0])) == {"id", "problem", "answer"}


def test_a_task_without_fixture_offline_is_a_clear_error():
    from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark
    from kvcomp.config import ModelConfig

    config = LMEvalConfig(tasks=["longbench_qasper", "mmlu"], data="fixtures", fixtures={"longbench_qasper": "longbench/qasper.jsonl"})
    with pytest.raises(ConfigError, match="mmlu"):
        LMEvalBenchmark(config).prepare(None, None, ModelConfig())


# ------------------------------------------------------------------------------------------------
# on the embedded model: requests really read the compressed cache
# ------------------------------------------------------------------------------------------------
def _lm(embedded, spec, **kwargs):
    from kvcomp.benchmarks.generation import GenerationProtocol
    from kvcomp.benchmarks.lm_eval_bridge import _lm_class
    from kvcomp.codecs import ModelInfo, build_codec

    model, tokenizer = embedded
    codec = build_codec(spec, ModelInfo.from_hf_config(model.config))
    return _lm_class()(model, tokenizer, codec, GenerationProtocol(), batch_size=1, max_length=1024, device="cpu", **kwargs)


def _requests(kind, pairs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(pairs)]


CONTEXT = (
    "The Nile is a major north-flowing river in northeastern Africa. It flows into the Mediterranean Sea. "
    "The Nile is among the longest rivers in the world, and its drainage basin covers eleven countries. "
) * 4


@pytest.mark.integration
def test_loglikelihood_reads_the_compressed_cache(embedded):
    """fp16 through the cache equals lm-eval's plain cache-less forward; a 1-bit codec changes the score."""
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = embedded
    pairs = [(CONTEXT + "The Nile flows into the", " Mediterranean Sea"), (CONTEXT + "The river is in", " Africa")]
    plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=1024, device="cpu")
    expected = [ll for ll, _ in plain.loglikelihood(_requests("loglikelihood", pairs))]
    through_fp16 = [ll for ll, _ in _lm(embedded, {"name": "fp16"}).loglikelihood(_requests("loglikelihood", pairs))]
    destroyed = [ll for ll, _ in _lm(embedded, {"name": "uniform", "bits": 1}).loglikelihood(_requests("loglikelihood", pairs))]
    assert through_fp16 == pytest.approx(expected, abs=1e-3)
    assert all(abs(d - e) > 1.0 for d, e in zip(destroyed, expected)), (destroyed, expected)


@pytest.mark.integration
def test_generate_until_reads_the_compressed_cache(embedded):
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = embedded
    request = [(CONTEXT + "In short, the Nile", {"until": ["\n\n"], "max_gen_toks": 12})]
    plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=1024, device="cpu")
    expected = plain.generate_until(_requests("generate_until", request))
    assert _lm(embedded, {"name": "fp16"}).generate_until(_requests("generate_until", request)) == expected
    assert expected[0].strip()
    destroyed = _lm(embedded, {"name": "uniform", "bits": 1}).generate_until(_requests("generate_until", request))
    assert destroyed != expected


@pytest.mark.integration
def test_middle_truncation_reaches_the_model(embedded):
    lm = _lm(embedded, {"name": "fp16"}, truncation="middle")
    ids, mask = lm.tok_batch_encode(["a " * 300 + "END", "short"], left_truncate_len=100)
    assert ids.shape == (2, 100) and mask[1].sum() < 10 and mask[0].all()
    assert lm.tok_decode(ids[0, -3:].tolist()).endswith("END") and lm.tok_decode(ids[0, :3].tolist()).startswith("a")
    with torch.no_grad():
        assert lm._model_call(ids[:1]).shape[:2] == (1, 100)


def test_a_press_takes_generation_tasks_and_names_the_likelihood_ones(task_manager):
    """lm-eval tasks scored by likelihood run context and continuation in one forward: with a press they are named
    and refused (the runner asks before the model loads), and so are tasks of a Python class (request types unknown);
    generation tasks (LongBench) are not."""
    from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark
    from kvcomp.codecs import ModelInfo
    from kvcomp.presses import build_press

    benchmark = LMEvalBenchmark(LMEvalConfig(name="lm_eval", tasks=["arc_easy", "longbench_trec", "squadv2"]))
    benchmark.task_manager = task_manager
    assert benchmark.scored_by_likelihood() == ["arc_easy", "squadv2"]  # squadv2: a Python task class
    with pytest.raises(ConfigError, match="arc_easy, squadv2 score likelihoods"):
        benchmark.check_press("knorm")
    press = build_press({"name": "knorm", "ratio": 0.5}, ModelInfo("tiny", 1, 1, 8))
    with pytest.raises(ConfigError, match="arc_easy, squadv2 score likelihoods"):
        benchmark.evaluate(None, None, press)
    benchmark.config.tasks = ["longbench_trec"]
    benchmark.check_press("knorm")


def test_the_runner_refuses_a_press_on_likelihood_tasks_before_loading_the_model(task_manager, monkeypatch):
    from kvcomp.benchmarks import build_benchmark
    from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark
    from kvcomp.runner import check_config, check_data
    from tests.test_config import _compose

    plan = check_config(_compose("codec=fp16", "benchmark=lm_eval", "benchmark.tasks=[arc_easy]", "press=knorm"))
    benchmark = build_benchmark(plan.benchmark)
    monkeypatch.setattr(LMEvalBenchmark, "check", lambda self, model_cfg: setattr(self, "task_manager", task_manager))
    with pytest.raises(ConfigError, match="arc_easy score likelihoods"):
        check_data(plan, benchmark, None)


@pytest.mark.integration
def test_generation_tasks_press_each_prompt(embedded, monkeypatch):
    """With a press, every generation request's cache evicts from its prompt after the exact prefill."""
    from kvcomp.benchmarks.generation import GenerationProtocol
    from kvcomp.benchmarks.lm_eval_bridge import _lm_class
    from kvcomp.codecs import ModelInfo, build_codec
    from kvcomp.presses import build_press

    model, tokenizer = embedded
    info = ModelInfo.from_hf_config(model.config)
    caches, new_cache = [], GenerationProtocol.new_cache
    monkeypatch.setattr(GenerationProtocol, "new_cache", lambda self, *a, **k: caches.append(new_cache(self, *a, **k))
                        or caches[-1])
    protocol = GenerationProtocol(press=build_press({"name": "streaming_llm", "ratio": 0.5}, info))
    lm = _lm_class()(model, tokenizer, build_codec({"name": "fp16"}, info), protocol, batch_size=1, max_length=1024,
                     device="cpu")
    out = lm.generate_until(_requests("generate_until", [(CONTEXT + "In short, the Nile", {"until": ["\n\n"],
                                                                                          "max_gen_toks": 6})]))
    assert out[0].strip() and len(caches) == 1 and caches[0].layers[0].parts[0].evicted > 0


def test_hub_only_benchmark_offline_is_a_clear_error(monkeypatch):
    from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark
    from kvcomp.config import ModelConfig
    from kvcomp.data import HubUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailableError, match="benchmark=ruler"):
        LMEvalBenchmark(_preset("ruler_lmeval")).prepare(None, None, ModelConfig())
