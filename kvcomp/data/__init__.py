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
    check_corpus_available,
    clean_wikitext,
    corpus_windows,
    dataset_download_command,
    hub_download_command,
    hub_offline,
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
    "check_corpus_available",
    "clean_wikitext",
    "corpus_windows",
    "dataset_download_command",
    "embedded_assets_ready",
    "ensure_embedded_corpora",
    "ensure_embedded_model",
    "hub_download_command",
    "hub_offline",
    "load_corpus",
    "parse_wikipedia_articles",
    "split_by_key",
    "token_windows",
    "tokenize_documents",
]
