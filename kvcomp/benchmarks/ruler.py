"""RULER's synthetic long-context tasks (Hsieh et al. 2024), generated offline and token-exact.

Eleven tasks, as configured in RULER's ``synthetic.yaml``: ``niah_single_1/2/3``,
``niah_multikey_1/2/3``, ``niah_multivalue``, ``niah_multiquery`` (needle in a haystack), ``vt``
(variable tracking), ``cwe`` (common words), ``fwe`` (frequent coded words). RULER's two QA tasks need
SQuAD/HotpotQA and run through lm-eval (``benchmark=ruler_lmeval``).

Differences from RULER, all deliberate:

- The essay haystack is the evaluation split of a kvcomp corpus (default: the embedded Wikipedia
  articles) instead of Paul Graham's essays; each sample starts at a random sentence.
- Prompts are assembled from token ids, so a prompt has exactly ``length - tokens_to_generate``
  tokens (RULER: at most that many, found by a search over re-tokenised text). The context is filled to
  the last token with the start of the next haystack piece, or (word lists) newline tokens.
- The in-context examples of ``vt`` and ``cwe`` sit inside the user turn, are at most a quarter of the
  length (RULER builds them at 500 tokens), and ``cwe`` below 4096 tokens uses RULER's small-length
  frequencies (common words x6, others x1; example x3 / x1).
- Keys are adjective-noun pairs from ``wonderwords`` (RULER's source); values 7-digit numbers or UUIDs.

Scoring is RULER's: ``string_match_all`` (the share of references found, case-insensitive, in the
prediction), averaged and x100.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import random
import re
import string
import time
import uuid
from dataclasses import asdict, dataclass, field
from functools import cached_property

import torch

from kvcomp.benchmarks import Benchmark, example_summary
from kvcomp.benchmarks.generation import GenerationProtocol, eos_ids, generate_greedy
from kvcomp.errors import ConfigError, unknown_choice
from kvcomp.progress import progress_bar

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
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40), rounded


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task: its family, RULER's settings and its generation budget."""

    family: str  # niah | vt | cwe | fwe
    tokens_to_generate: int
    haystack: str = "essay"  # niah: essay | noise | needle
    key_type: str = "words"  # words | uuids
    value_type: str = "numbers"  # numbers | uuids
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    metric: str = "string_match_all"


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
}


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


# ------------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------------
def postprocess_prediction(text: str) -> str:
    """RULER's clean-up: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(predictions: list[str], references: list[list[str]]) -> float:
    """Mean over samples of the share of references contained (case-insensitive) in the prediction, x100."""
    scores = [
        sum(ref.lower() in pred.lower() for ref in refs) / len(refs) for pred, refs in zip(predictions, references)
    ]
    return 100 * sum(scores) / len(scores)


def string_match_part(predictions: list[str], references: list[list[str]]) -> float:
    """Mean over samples of 1 if any reference is contained in the prediction, x100 (RULER's QA metric)."""
    scores = [max(ref.lower() in pred.lower() for ref in refs) for pred, refs in zip(predictions, references)]
    return 100 * sum(scores) / len(scores)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


# ------------------------------------------------------------------------------------------------
# generation
# ------------------------------------------------------------------------------------------------
def _word_list(*names: str) -> list[str]:
    assets = importlib.resources.files("wonderwords") / "assets"
    words = []
    for name in names:
        words += [w.strip() for w in (assets / f"{name}.txt").read_text().splitlines() if w.strip()]
    return sorted(set(words))


class RulerGenerator:
    """Builds :class:`RulerSample` s for one tokenizer and haystack, deterministically from ``seed``.

    ``haystack_texts``: documents whose sentences replace RULER's essays. ``chat_template``: wrap the
    task in the tokenizer's chat template (the assistant turn starts with the answer prefix), as RULER
    does with its per-family model templates; otherwise the plain (base-model) template.
    """

    def __init__(self, tokenizer, haystack_texts: list[str], *, seed: int = 42, chat_template: bool = True):
        self.tokenizer, self.seed = tokenizer, seed
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
            raise ConfigError(f"RULER length {prompt_len} leaves no room for a context ({budget} tokens)")
        context, spans = fill_context(budget)
        assert len(context) == budget, (len(context), budget)
        offset = len(head_ids)
        ids = head_ids + context + tail_ids
        return RulerSample("", 0, 0, ids, [], [(offset + a, offset + b) for a, b in spans])

    def _pieces(self, budget: int, haystack: list[list[int]], needles: list[list[int]], positions) -> tuple[list[int], list]:
        """Interleave needle ids into haystack pieces (``positions(n)`` -> insertion index per needle,
        ascending) and fill exactly ``budget`` tokens with the start of the next haystack piece."""
        room = budget - sum(map(len, needles))
        count, used = 0, 0
        while count < len(haystack) - 1 and used + len(haystack[count]) <= room:
            used += len(haystack[count])
            count += 1
        if used + len(haystack[count]) <= room:
            raise ConfigError(f"the haystack is too short for a {budget}-token context")
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
        start = rng.randrange(len(self.sentences))
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
            raise ConfigError(f"cwe: {budget} tokens cannot hold 10 common words x{freq_common}")
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


def _random_slots(rng: random.Random, count: int, n: int) -> list[int]:
    """``n`` ascending insertion slots among ``count`` haystack pieces (distinct while there is room)."""
    slots = range(count + 1)
    return sorted(rng.sample(slots, n) if len(slots) >= n else rng.choices(slots, k=n))


def score(task: str, predictions: list[str], references: list[list[str]]) -> float:
    """RULER's metric of ``task`` over cleaned predictions."""
    cleaned = [postprocess_prediction(p) for p in predictions]
    return METRICS[TASKS[task].metric](cleaned, references)



class RulerBenchmark(Benchmark):
    """RULER on the configured tasks and lengths: one row per length, ``acc_<task>`` and ``acc_avg``."""

    def prepare(self, model, tokenizer, model_cfg) -> None:
        from kvcomp.data import load_corpus

        c = self.config
        for task in c.tasks:
            if task not in TASKS:
                raise unknown_choice("RULER task", task, TASKS)
        too_long = [n for n in c.lengths if n > model_cfg.max_context]
        if too_long:
            raise ConfigError(f"RULER lengths {too_long} exceed {model_cfg.name}'s max_context={model_cfg.max_context}")
        if c.num_samples < 1 or c.batch_size < 1:
            raise ConfigError("benchmark.num_samples and benchmark.batch_size must be >= 1")
        self.protocol = GenerationProtocol(c.protocol, c.compress_generated)
        self.tokenizer, self.eos = tokenizer, eos_ids(tokenizer, model)
        generator = RulerGenerator(tokenizer, load_corpus(c.haystack, "evaluation"), seed=c.seed, chat_template=c.chat_template)
        self.samples = {
            (length, task): [generator.sample(task, length, i) for i in range(c.num_samples)]
            for length in c.lengths
            for task in c.tasks
        }

    def fingerprint(self) -> dict:
        ids = json.dumps({f"{k[0]}/{k[1]}": [s.input_ids for s in v] for k, v in self.samples.items()})
        return {"prompts": hashlib.sha256(ids.encode()).hexdigest(), "benchmark": asdict(self.config) | {"include_reference": None}}

    def evaluate(self, model, codec) -> list[dict]:
        c = self.config
        rows = []
        bar = progress_bar(len(self.samples) * c.num_samples, f"RULER {codec.name}", "sample")
        for length in c.lengths:
            start = time.perf_counter()
            row = {"benchmark": f"ruler:{c.haystack} {length} tokens x{c.num_samples}", "length": length}
            examples: list[dict] = []
            for task in c.tasks:
                samples = self.samples[(length, task)]
                budget = min(TASKS[task].tokens_to_generate, c.max_new_tokens or TASKS[task].tokens_to_generate)
                predictions = []
                for batch in [samples[i : i + c.batch_size] for i in range(0, len(samples), c.batch_size)]:
                    new = generate_greedy(
                        model, codec, torch.tensor([s.input_ids for s in batch]),
                        max_new_tokens=budget, eos_token_ids=self.eos, protocol=self.protocol, metrics=examples,
                    )
                    predictions += [self.tokenizer.decode(_until_eos(row_ids, self.eos), skip_special_tokens=True) for row_ids in new.tolist()]
                    bar.update(len(batch))
                row[f"acc_{task}"] = score(task, predictions, [s.answers for s in samples])
                row.setdefault("predictions", {})[task] = predictions
            row["acc_avg"] = sum(row[f"acc_{t}"] for t in c.tasks) / len(c.tasks)
            row.update(example_summary(examples))
            row["eval_seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
        bar.close()
        return rows


def _until_eos(ids: list[int], eos: list[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos:
            return ids[:i]
    return ids
