"""Embedded assets, text corpora and token windows."""

from kvcomp.data.assets import (
    AssetError,
    embedded_assets_ready,
    ensure_embedded_corpora,
    ensure_embedded_model,
)
from kvcomp.data.corpora import (
    CORPORA,
    SPLITS,
    HubUnavailableError,
    clean_wikitext,
    corpus_windows,
    load_corpus,
    parse_wikipedia_articles,
    split_by_key,
    token_windows,
    tokenize_documents,
)

__all__ = [
    "AssetError",
    "CORPORA",
    "HubUnavailableError",
    "SPLITS",
    "clean_wikitext",
    "corpus_windows",
    "embedded_assets_ready",
    "ensure_embedded_corpora",
    "ensure_embedded_model",
    "load_corpus",
    "parse_wikipedia_articles",
    "split_by_key",
    "token_windows",
    "tokenize_documents",
]
