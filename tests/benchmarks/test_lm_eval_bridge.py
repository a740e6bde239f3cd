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

    raw = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "benchmark" / f"{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LMEvalConfig), {k: v for k, v in raw.items() if k != "defaults"}))


def test_middle_truncation_keeps_both_ends():
    ids = list(range(10))
    assert middle_truncate(ids, 6) == [0, 1, 2, 7, 8, 9]
    assert middle_truncate(ids, 5) == [0, 1, 7, 8, 9]
    assert middle_truncate(ids, 12) == ids


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_mode_means_the_local_cache_and_never_asks_the_hub(monkeypatch, variable):
    """Offline, data=hub means the local cache (tests/integration/test_lm_eval_offline.py): the mode is seen, the hub
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
    from tests.helpers import compose_config

    plan = check_config(compose_config("codec=fp16", "benchmark=lm_eval", "benchmark.tasks=[arc_easy]", "press=knorm"))
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


# ------------------------------------------------------------------------------------------------
# per-doc values, paired with the reference row
# ------------------------------------------------------------------------------------------------
ARC_DOCS = [  # arc_easy's hub format (allenai/ai2_arc)
    {"id": "q1", "question": "Which gas do plants take in from the air to make their food?",
     "choices": {"text": ["oxygen", "carbon dioxide", "helium"], "label": ["A", "B", "C"]}, "answerKey": "B"},
    {"id": "q2", "question": "At what temperature in degrees Celsius does water boil at sea level?",
     "choices": {"text": ["50", "100", "200"], "label": ["A", "B", "C"]}, "answerKey": "B"},
]
LAMBADA_DOCS = [  # lambada_openai's (EleutherAI/lambada_openai): its last word is the continuation
    {"text": "She opened the door and the cold wind blew into the room, so she quickly closed the door"},
    {"text": "The river flows north through the desert for many miles until it finally reaches the sea"},
]


@pytest.fixture(scope="module")
def per_doc_rows(embedded, task_manager, tmp_path_factory):
    """``(benchmark, reference, fp16, one_bit)``: rows of fp16 as the runner's reference, fp16 again and a 1-bit cache,
    on two docs each of a generation task (aime24's fixture), a multiple-choice one (arc_easy) and a loglikelihood one
    (lambada_openai, whose first metric is a perplexity), the last two on local files."""
    from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark
    from kvcomp.codecs import ModelInfo, build_codec
    from kvcomp.config import ModelConfig

    model, tokenizer = embedded
    folder = tmp_path_factory.mktemp("lm_eval_docs")
    for name, docs in (("arc_easy", ARC_DOCS), ("lambada_openai", LAMBADA_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    benchmark = LMEvalBenchmark(LMEvalConfig(
        tasks=["aime24", "arc_easy", "lambada_openai"], data="fixtures", limit=2, max_gen_toks=4, max_length=512,
        fixtures={"aime24": "aime/aime24.jsonl", "arc_easy": str(folder / "arc_easy.jsonl"),
                  "lambada_openai": str(folder / "lambada_openai.jsonl")},
    ))
    benchmark.task_manager = task_manager  # lm-eval's task index, built once for the module
    benchmark.prepare(model, tokenizer, ModelConfig())
    info = ModelInfo.from_hf_config(model.config)
    reference, fp16, one_bit = (benchmark.evaluate(model, build_codec(spec, info))[0]
                                for spec in ({"name": "fp16"}, {"name": "fp16"}, {"name": "uniform", "bits": 1}))
    return benchmark, {**reference, "reference_key": "fp16"}, fp16, one_bit


@pytest.mark.integration
def test_rows_keep_per_doc_values(per_doc_rows):
    """Per task and doc: the first metric's score where the task averages it (not lambada's perplexity), the
    generation's length and repetition rate (generation tasks), the gold's log-probability (every task); their means
    with intervals."""
    _, reference, _, one_bit = per_doc_rows
    for row in (reference, one_bit):
        assert {task: len(values) for task, values in row["scores"].items()} == {"aime24": 2, "arc_easy": 2}
        assert {task: len(values) for task, values in row["answer_logps"].items()} == {
            "aime24": 2, "arc_easy": 2, "lambada_openai": 2}
        assert row["output_lengths"].keys() == row["repetition_rates"].keys() == {"aime24"}
        for task in row["scores"]:
            assert sum(row["scores"][task]) / 2 == pytest.approx(row[f"score_{task}"])
        assert all(n > 0 for n in row["output_lengths"]["aime24"])
        assert all(0 <= r <= 1 for r in row["repetition_rates"]["aime24"])
        logps = [v for values in row["answer_logps"].values() for v in values]
        assert all(v < 0 for v in logps) and row["answer_logp"] == pytest.approx(sum(logps) / len(logps))
        for name, per_doc in (("answer_logp", "answer_logps"), ("output_tokens", "output_lengths"),
                              ("repetition_rate", "repetition_rates")):
            pooled = [v for values in row[per_doc].values() for v in values]
            low, high = row[f"{name}_ci95"]
            assert min(pooled) <= low <= row[name] <= high <= max(pooled)


@pytest.mark.integration
def test_per_doc_values_pair_with_the_reference(per_doc_rows):
    """fp16 repeats the reference doc by doc (a paired change of 0, in its interval); a 1-bit cache lowers the gold's
    log-probability, the paired interval below 0."""
    from kvcomp.benchmarks.intervals import pair_with_reference

    _, reference, fp16, one_bit = per_doc_rows
    for name in ("scores", "answer_logps", "output_lengths", "repetition_rates"):
        assert fp16[name] == reference[name]
    _, same, destroyed = pair_with_reference([reference, fp16, one_bit])
    low, high = same["answer_logp_vs_reference_ci95"]
    assert same["answer_logp_vs_reference"] == 0 and low <= 0 <= high
    assert same["score_avg_vs_reference_ci95"] == [0, 0] and same["output_tokens_vs_reference"] == 1
    low, high = destroyed["answer_logp_vs_reference_ci95"]
    assert destroyed["answer_logp_vs_reference"] == pytest.approx(one_bit["answer_logp"] - reference["answer_logp"])
    assert low <= destroyed["answer_logp_vs_reference"] <= high < 0
    assert {"score_avg_vs_reference_ci95", "repetition_rate_vs_reference_ci95",
            "output_tokens_vs_reference_ci95"} <= set(destroyed)


@pytest.mark.integration
def test_gold_answers_are_teacher_forced_after_their_prompts(per_doc_rows, embedded):
    """fp16's gold log-probabilities are those of a plain forward: aime24's answer after its prompt (and a space:
    the prompt ends in ``Answer:``), arc_easy's gold choice and lambada's last word over their tokens."""
    from kvcomp.benchmarks.lm_eval_bridge import load_tasks

    benchmark, reference, _, _ = per_doc_rows
    model, tokenizer = embedded
    _, tasks = load_tasks(benchmark.task_manager, benchmark.tasks)

    def mean_logp(context: str, continuation: str) -> float:
        ids = tokenizer(context, return_tensors="pt").input_ids
        answer = tokenizer(continuation, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(torch.cat([ids, answer], 1)).logits[:, ids.shape[1] - 1:-1]
        return logits.float().log_softmax(-1).gather(-1, answer[..., None]).mean().item()

    pairs = {
        "aime24": [(d["Problem"], f" {d['Answer']}") for d in list(tasks["aime24"].test_docs())[:2]],
        "arc_easy": [(d["question"], d["choices"]["text"][d["choices"]["label"].index(d["answerKey"])])
                     for d in ARC_DOCS],
        "lambada_openai": [tuple(d["text"].rsplit(" ", 1)) for d in LAMBADA_DOCS],
    }
    contexts = {"aime24": "Question: {}\nAnswer:", "arc_easy": "Question: {}\nAnswer:", "lambada_openai": "{}"}
    for task, docs in pairs.items():
        expected = [mean_logp(contexts[task].format(context), gold if gold[0] == " " else " " + gold)
                    for context, gold in docs]
        assert reference["answer_logps"][task] == pytest.approx(expected, abs=1e-4), task


@pytest.mark.integration
def test_gold_answers_follow_the_prompt_as_generation_truncates_it(embedded, task_manager, monkeypatch):
    """With ``truncation: middle``, the gold answer is scored after the very tokens the generation was prefilled
    with: the prompt's two ends, leaving room for the budget."""
    from lm_eval.models.huggingface import HFLM

    from kvcomp.benchmarks import lm_eval_bridge
    from kvcomp.benchmarks.lm_eval_bridge import LMEvalBenchmark
    from kvcomp.codecs import ModelInfo, build_codec
    from kvcomp.config import ModelConfig

    model, tokenizer = embedded
    prompts, generate, score = [], HFLM._model_generate, lm_eval_bridge.answer_logprob
    monkeypatch.setattr(HFLM, "_model_generate",
                        lambda self, context, *a, **k: prompts.append(context) or generate(self, context, *a, **k))
    monkeypatch.setattr(lm_eval_bridge, "answer_logprob",
                        lambda model, codec, ids, *a, **k: prompts.append(ids) or score(model, codec, ids, *a, **k))
    benchmark = LMEvalBenchmark(LMEvalConfig(tasks=["longbench_trec"], data="fixtures", limit=1, max_gen_toks=4,
                                             max_length=160, truncation="middle",
                                             fixtures={"longbench_trec": "longbench/trec.jsonl"}))
    benchmark.task_manager = task_manager
    benchmark.prepare(model, tokenizer, ModelConfig())
    (row,) = benchmark.evaluate(model, build_codec({"name": "fp16"}, ModelInfo.from_hf_config(model.config)))
    generated, scored = prompts
    assert generated.tolist() == scored.tolist() and scored.shape == (1, 156)
    assert tokenizer.decode(scored[0, :6]).startswith("Please determine")  # the prompt's start, kept
    assert len(row["answer_logps"]["longbench_trec"]) == 1


def test_gold_answers_of_each_target_form():
    """Generation golds as lm-eval compares them (a choice by index, the first of a list, a number as text); the gold
    choice of a multiple-choice doc (an index, a choice's text, the first of several, a context's index)."""
    from types import SimpleNamespace

    from kvcomp.benchmarks.lm_eval_bridge import choice_index, generation_gold

    plain = SimpleNamespace(config=SimpleNamespace(doc_to_choice=None))
    assert [generation_gold(plain, {}, t) for t in ("286", ["Paris", "the capital"], 8, "", " ", [], None)] == [
        "286", "Paris", "8", None, None, None, None]
    indexed = SimpleNamespace(config=SimpleNamespace(doc_to_choice="{{options}}"),
                              doc_to_choice=lambda doc: doc["options"])
    assert generation_gold(indexed, {"options": ["no", "yes"]}, 1) == "yes"
    choices = SimpleNamespace(multiple_input=0, doc_to_choice=lambda doc: ["red", "green", "blue"])
    assert [choice_index(choices, {}, t) for t in (2, "green", [1, 2], 3, "purple", [])] == [2, 1, 1, None, None, None]
    contexts = SimpleNamespace(multiple_input=2, doc_to_text=lambda doc: doc["gold"],
                               doc_to_choice=lambda doc: ["a", "b"])
    assert choice_index(contexts, {"gold": 1}, " continuation") == 1


def test_sample_means_of_what_a_row_holds():
    from kvcomp.benchmarks.intervals import sample_means

    means = sample_means({"answer_logps": {"a": [-1.0, -3.0], "b": [-2.0]}})
    assert set(means) == {"answer_logp", "answer_logp_ci95"} and means["answer_logp"] == -2.0
    assert -3.0 <= means["answer_logp_ci95"][0] <= -2.0 <= means["answer_logp_ci95"][1] <= -1.0
    assert sample_means({"scores": {"a": [1.0]}}) == {}


def test_groups_are_evaluated_whole_and_their_tasks_named(task_manager):
    from kvcomp.benchmarks.lm_eval_bridge import load_tasks

    specs = [fixture_task_spec(task_manager, t, FIXTURES / "aime" / f"{t}.jsonl") for t in ("aime24", "aime25")]
    group = {"group": "aime_both", "task": specs}
    items, tasks = load_tasks(task_manager, [group, specs[0] | {"task": "aime24_again"}])
    assert [getattr(item, "name", None) or item.task_name for item in items] == ["aime_both", "aime24_again"]
    assert list(tasks) == ["aime24", "aime25", "aime24_again"]
