"""RULER generator (determinism, exact lengths, needle placement) and scoring on hand-written cases."""

import json
import random
import re

import pytest

from kvcomp.benchmarks.ruler import (
    TASKS,
    LengthError,
    RulerGenerator,
    postprocess_prediction,
    read_hotpotqa,
    read_squad,
    score,
    string_match_all,
    string_match_part,
)
from kvcomp.errors import ConfigError
from tests.helpers import ByteTokenizer, haystack


class ChatByteTokenizer(ByteTokenizer):
    chat_template = "chatml"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return f"<|user|>{messages[0]['content']}<|end|><|assistant|>"


WORDS = "alpha beta gamma delta river stone cloud field light north".split()


def _paragraph(rng, tag):
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60))) + "."


def _squad_file(path):
    """A SQuAD v2 double: 4 articles x 3 paragraphs, two questions each (one unanswerable)."""
    rng = random.Random(1)
    data = []
    for a in range(4):
        paragraphs = []
        for p in range(3):
            context = _paragraph(rng, f"[squad {a}.{p}] answer-{a}-{p}")
            paragraphs.append({"context": context, "qas": [
                {"question": f"What is the answer of {a}.{p}?", "id": f"{a}{p}", "is_impossible": False,
                 "answers": [{"text": f"answer-{a}-{p}", "answer_start": 0}, {"text": f"answer-{a}-{p}", "answer_start": 0}]},
                {"question": f"Unanswerable {a}.{p}?", "id": f"{a}{p}x", "is_impossible": True, "answers": []},
            ]})
        data.append({"title": f"article {a}", "paragraphs": paragraphs})
    path.write_text(json.dumps({"version": "v2.0", "data": data}))
    return path


def _hotpot_file(path):
    """A HotpotQA double: 6 questions with 2 supporting and 8 distracting paragraphs each."""
    rng = random.Random(2)
    data = []
    for q in range(6):
        context = [[f"title {q}-{k}", [_paragraph(rng, f"[hotpot {q}-{k}]"), " More."]] for k in range(10)]
        data.append({"_id": str(q), "question": f"Which links {q}-3 and {q}-7?", "answer": f"link-{q}",
                     "supporting_facts": [[f"title {q}-3", 0], [f"title {q}-7", 1]], "context": context})
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def qa_sets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ruler_qa")
    return {"squad": read_squad(_squad_file(folder / "squad.json")),
            "hotpotqa": read_hotpotqa(_hotpot_file(folder / "hotpotqa.json"))}


@pytest.fixture(scope="module")
def generator(qa_sets):
    return RulerGenerator(ByteTokenizer(), haystack(), seed=7, qa_sets=qa_sets)


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [2000, 4000])
def test_prompts_have_exactly_the_target_length(generator, task, length):
    sample = generator.sample(task, length, 0)
    assert len(sample.input_ids) == length - TASKS[task].tokens_to_generate
    assert sample.answers and all(sample.answers)


@pytest.mark.parametrize("task", list(TASKS))
def test_generation_is_deterministic(task, qa_sets):
    a = RulerGenerator(ByteTokenizer(), haystack(), seed=7, qa_sets=qa_sets).sample(task, 2000, 3)
    b = RulerGenerator(ByteTokenizer(), haystack(), seed=7, qa_sets=qa_sets).sample(task, 2000, 3)
    other = RulerGenerator(ByteTokenizer(), haystack(), seed=7, qa_sets=qa_sets).sample(task, 2000, 4)
    assert a.input_ids == b.input_ids and a.answers == b.answers
    assert other.input_ids != a.input_ids


@pytest.mark.parametrize("task", [t for t, spec in TASKS.items() if spec.family == "niah"])
def test_needles_sit_where_recorded_and_answer_is_in_them(generator, task):
    tok = generator.tokenizer
    sample = generator.sample(task, 3000, 1)
    spec = TASKS[task]
    assert len(sample.needle_spans) == spec.num_keys * spec.num_values
    needles = [tok.decode(sample.input_ids[a:b]) for a, b in sample.needle_spans]
    assert all("One of the special magic" in n for n in needles)
    for answer in sample.answers:  # every reference is the value of a needle of a queried key
        assert sum(answer in n for n in needles) == 1
    prompt = tok.decode(sample.input_ids)
    assert prompt.count("One of the special magic") == len(needles) or spec.haystack == "needle"


def test_essay_needle_depth_follows_the_requested_depth(generator):
    """At depth d% the needle starts about d% into the context (sentence granularity)."""
    for index in range(6):
        sample = generator.sample("niah_single_2", 3000, index)
        (start, _), depth = sample.needle_spans[0], sample.depths[0]
        prompt = generator.tokenizer.decode(sample.input_ids)
        context_start = prompt.index("afterwards.\n") + len("afterwards.\n")
        context_end = prompt.rindex("\nWhat is")
        where = (start - context_start) / (context_end - context_start)
        assert abs(where - depth / 100) < 0.1, (depth, where)


def test_vt_chain_is_in_order_and_answer_is_the_chain():
    generator = RulerGenerator(ByteTokenizer(), haystack(), seed=1)
    sample = generator.sample("vt", 2000, 0)
    statements = [generator.tokenizer.decode(sample.input_ids[a:b]).strip() for a, b in sample.needle_spans]
    value = statements[0].split("= ")[1].rstrip(".")
    assert statements[0] == f"VAR {sample.answers[0]} = {value}."
    for previous, name, statement in zip(sample.answers, sample.answers[1:], statements[1:]):
        assert statement == f"VAR {name} = VAR {previous}."
    assert f"assigned the value {value}" in generator.tokenizer.decode(sample.input_ids)


def test_cwe_answer_words_are_the_most_frequent():
    generator = RulerGenerator(ByteTokenizer(), haystack(), seed=1)
    sample = generator.sample("cwe", 3000, 0)
    question = generator.tokenizer.decode(sample.input_ids).split("Memorize the ones that appear most often.\n")[-1]
    words = question.split("\nQuestion")[0].split()
    counts = {w: words.count(w) for w in set(words) if not w[0].isdigit()}
    assert all(counts[w] == 6 for w in sample.answers)  # below 4096 tokens: common words x6
    assert max(c for w, c in counts.items() if w not in sample.answers) == 1


def test_fwe_answers_are_ranks_two_to_four():
    generator = RulerGenerator(ByteTokenizer(), haystack(), seed=1)
    sample = generator.sample("fwe", 3000, 0)
    text = generator.tokenizer.decode(sample.input_ids).split("coded words. ")[1].split("\nQuestion")[0].split()
    ranked = sorted(set(text), key=text.count, reverse=True)
    assert ranked[0] == "...."
    assert set(ranked[1:4]) == set(sample.answers)


def test_chat_template_wraps_the_task_and_prefix_opens_the_answer():
    generator = RulerGenerator(ChatByteTokenizer(), haystack(), seed=1)
    sample = generator.sample("niah_single_1", 1500, 0)
    prompt = generator.tokenizer.decode(sample.input_ids)
    assert len(sample.input_ids) == 1500 - 128
    assert prompt.startswith("<|user|>A special magic number is hidden")
    assert prompt.endswith("<|end|><|assistant|> The special magic number for " + prompt.split("for ")[-1])
    assert prompt.endswith("mentioned in the provided text is")


def test_too_short_length_is_a_clear_error(generator):
    with pytest.raises(ConfigError, match="no room"):
        generator.sample("niah_single_2", 200, 0)
    with pytest.raises(ConfigError, match="RULER task"):
        generator.sample("qa_3", 2000, 0)
    with pytest.raises(ConfigError, match="needs its data"):
        RulerGenerator(ByteTokenizer(), haystack(), seed=7).sample("qa_1", 2000, 0)
    with pytest.raises(ConfigError, match="gold paragraphs do not fit"):
        generator.sample("qa_2", 600, 0)
    for length in (10, 40):  # vt's in-context example gets no room for its chain (an IndexError before)
        with pytest.raises(LengthError, match="cannot hold its needles"):
            generator.sample("vt", length, 0)


def test_qa_readers_keep_answerable_questions_and_their_own_paragraphs(qa_sets):
    items, docs = qa_sets["squad"]
    assert len(items) == 12 and len(docs) == 12  # unanswerable questions dropped; paragraphs distinct
    first = items[0]
    assert first.answers == ["answer-0-0", "answer-0-0"] and docs[first.gold[0]].startswith("[squad 0.0]")
    assert sorted(docs[i][:12] for i in first.related) == ["[squad 0.1] ", "[squad 0.2] "]
    items, docs = qa_sets["hotpotqa"]
    assert len(items) == 6 and len(docs) == 60
    assert [docs[i].split("\n")[0] for i in items[2].gold] == ["title 2-3", "title 2-7"]
    assert len(items[2].related) == 8 and docs[items[2].gold[0]].endswith(" More.")  # sentences joined


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
@pytest.mark.parametrize("length", [1200, 4000])
def test_qa_prompt_holds_the_gold_documents_numbered_in_order(generator, qa_sets, task, length):
    dataset = TASKS[task].dataset
    items, docs = qa_sets[dataset]
    for index in range(3):
        sample = generator.sample(task, length, index)
        item = items[index]
        prompt = generator.tokenizer.decode(sample.input_ids)
        assert sample.answers == item.answers
        assert all(docs[g] in prompt for g in item.gold)
        assert f"Question: {item.query} Answer:" in prompt and prompt.endswith(" Answer:")
        numbers = [int(n) for n in re.findall(r"Document (\d+):\n", prompt)]
        assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) > len(item.gold)
        whole = [d for d in docs if d in prompt]
        assert len(whole) >= len(numbers) - 1  # every document but the filler is whole
    if length == 4000 and task == "qa_2":  # room for all ten of the question's paragraphs
        assert all(docs[i] in prompt for i in item.related)


def test_the_essays_start_at_their_first_sentence_unless_random(qa_sets):
    texts = haystack()
    first = texts[0].split(".")[0]
    fixed = RulerGenerator(ByteTokenizer(), texts, seed=7, random_start=False)
    for index in range(3):
        assert first in fixed.tokenizer.decode(fixed.sample("niah_single_2", 1500, index).input_ids)
    moving = RulerGenerator(ByteTokenizer(), texts, seed=7)
    assert sum(first in moving.tokenizer.decode(moving.sample("niah_single_2", 1500, i).input_ids) for i in range(3)) < 3


def test_string_match_scores_hand_cases():
    refs = [["7145122"], ["ABCDE", "FGHIJ"], ["apple", "pear", "plum", "fig"]]
    preds = [" the number is 7145122.", "abcde and something", "Apple, PEAR"]
    assert string_match_all(preds, refs) == pytest.approx(100 * (1 + 0.5 + 0.5) / 3)
    assert string_match_part(preds, refs) == pytest.approx(100.0)
    assert string_match_part(["nothing"], [["a1", "b2"]]) == 0.0
    assert postprocess_prediction("  7145\x0b122 \n") == "7145\n122"
    assert score("niah_single_1", [" 7145\x0b122"], [["7145122"]]) == 0.0
    assert score("niah_multivalue", ["1111111 2222222"], [["1111111", "2222222", "3333333", "4444444"]]) == 50.0


def test_accuracy_intervals_wilson_and_paired():
    from kvcomp.benchmarks.intervals import paired_mean_change_interval, wilson_interval

    assert wilson_interval(100.0, 1) == pytest.approx([20.654, 100.0], abs=1e-3)  # one right answer says little
    assert wilson_interval(50.0, 10) == pytest.approx([23.659, 76.341], abs=1e-3)
    assert wilson_interval(0.0, 400)[1] < 1.0
    assert paired_mean_change_interval([100.0, 0.0, 50.0], [100.0, 0.0, 50.0]) == [0.0, 0.0]
    low, high = paired_mean_change_interval([0.0] * 20 + [100.0] * 20, [100.0] * 40)
    assert low < -50 < high < 0 and paired_mean_change_interval([0.0] * 20 + [100.0] * 20, [100.0] * 40) == [low, high]


# ------------------------------------------------------------------------------------------------
# on the embedded model and corpus
# ------------------------------------------------------------------------------------------------
def _ruler(tasks, lengths, num_samples, **overrides):
    from kvcomp.benchmarks.ruler import RulerBenchmark
    from kvcomp.config import ModelConfig, RulerConfig

    return RulerBenchmark(RulerConfig(tasks=tasks, lengths=lengths, num_samples=num_samples, **overrides)), ModelConfig()


@pytest.mark.integration
def test_real_tokenizer_prompts_are_exact_with_the_chat_template(embedded):
    model, tokenizer = embedded
    benchmark, model_cfg = _ruler(list(TASKS), [1024, 2048], 1)
    benchmark.prepare(model, tokenizer, model_cfg)
    for (length, task), samples in benchmark.samples.items():
        ids = samples[0].input_ids
        assert len(ids) == length - TASKS[task].tokens_to_generate
        assert tokenizer.decode(ids).startswith("<|im_start|>system")
    with pytest.raises(ConfigError, match="max_context"):
        _ruler(["vt"], [16384], 1)[0].prepare(model, tokenizer, model_cfg)


@pytest.mark.integration
def test_a_destructive_codec_collapses_niah(embedded, monkeypatch):
    """fp16 finds single needles at 512 tokens; a 1-bit cache loses them: the benchmark reads the compressed cache."""
    from kvcomp.benchmarks import ruler
    from kvcomp.benchmarks.prefill import PrefillMemo
    from kvcomp.codecs import ModelInfo, build_codec

    model, tokenizer = embedded
    # each prompt prefilled once and replayed (into both codecs' caches, and before each gold answer), as in a run
    monkeypatch.setattr(ruler, "PREFILLS", PrefillMemo(budget=10**9, by_object=True))
    benchmark, model_cfg = _ruler(["niah_single_1", "niah_single_2"], [512], 3, max_new_tokens=12, batch_size=1)  # 7 digits
    benchmark.prepare(model, tokenizer, model_cfg)
    info = ModelInfo.from_hf_config(model.config)
    (fp16,) = benchmark.evaluate(model, build_codec({"name": "fp16"}, info))
    (one_bit,) = benchmark.evaluate(model, build_codec({"name": "uniform", "bits": 1}, info))
    assert fp16["acc_niah_single_1"] >= 66 and fp16["acc_niah_single_2"] >= 66
    assert one_bit["acc_avg"] == 0.0
    assert fp16["length"] == 512 and len(fp16["predictions"]["niah_single_1"]) == 3
    # per-sample scores, a Wilson interval per task and for the average, a paired interval of the change
    from kvcomp.benchmarks.intervals import pair_with_reference, wilson_interval

    assert sum(fp16["scores"]["niah_single_1"]) / 3 == fp16["acc_niah_single_1"]
    assert fp16["acc_avg_ci95"] == wilson_interval(fp16["acc_avg"], 6) and one_bit["acc_avg_ci95"][0] == pytest.approx(0)
    _, paired = pair_with_reference([{**fp16, "reference_key": "r"}, one_bit])
    low, high = paired["acc_avg_vs_reference_ci95"]
    assert low <= one_bit["acc_avg"] - fp16["acc_avg"] <= high < 0  # a significant loss
    # the gold answer teacher-forced after each compressed prompt: a paired, graded score of the same loss
    low, high = paired["answer_logp_vs_reference_ci95"]
    assert paired["answer_logp_vs_reference"] == pytest.approx(one_bit["answer_logp"] - fp16["answer_logp"])
    assert low <= paired["answer_logp_vs_reference"] <= high < 0
    assert len(one_bit["answer_logps"]["niah_single_2"]) == len(one_bit["repetition_rates"]["niah_single_2"]) == 3
    assert all(0 <= r <= 1 for rates in one_bit["repetition_rates"].values() for r in rates)
    low, high = one_bit["output_tokens_ci95"]
    assert low <= one_bit["output_tokens"] <= high and paired["output_tokens_vs_reference"] > 0


@pytest.mark.integration
def test_a_press_evicts_from_each_context_and_keeps_the_question(embedded, monkeypatch):
    """RULER with a press: each prompt alone, its context (up to where the question starts) prefilled and pressed,
    the question and answer prefix then read uncompressed; the rows carry the output length and measured bits."""
    import kvcomp.benchmarks.generation as generation
    from kvcomp.codecs import ModelInfo, build_codec
    from kvcomp.presses import build_press

    model, tokenizer = embedded
    benchmark, model_cfg = _ruler(["niah_single_1"], [1024], 2, max_new_tokens=12, batch_size=2)
    benchmark.prepare(model, tokenizer, model_cfg)
    info = ModelInfo.from_hf_config(model.config)
    caches, original = [], generation.GenerationProtocol.new_cache
    monkeypatch.setattr(generation.GenerationProtocol, "new_cache",
                        lambda self, codec, capacity=None: caches.append(original(self, codec, capacity)) or caches[-1])
    (row,) = benchmark.evaluate(model, build_codec({"name": "fp16"}, info), build_press({"name": "knorm", "ratio": 0.5}, info))
    samples = benchmark.samples[(1024, "niah_single_1")]
    assert len(caches) == 4  # one prompt at a time, whatever the batch size, then each gold answer's scoring
    for cache, sample in zip(caches, samples + samples):
        context = sample.question_start
        assert cache.layers[0].parts[0].evicted == context - int(context * 0.5)
        assert tokenizer.decode(sample.input_ids[context:]).lstrip().startswith("What")  # the question is not pressed
    assert row["output_tokens"] > 0 and row["bits_per_value_measured"] == pytest.approx(32.0)
