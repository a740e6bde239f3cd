"""Where kvcomp keeps downloaded assets and derived files (converted model, token ids, ...)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The kvcomp cache folder, created on demand.

    ``$KVCOMP_CACHE`` if set, else ``$XDG_CACHE_HOME/kvcomp``, else ``~/.cache/kvcomp``.
    """
    override = os.environ.get("KVCOMP_CACHE")
    if override:
        path = Path(override).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
        path = base / "kvcomp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_relative(path: str | Path) -> str:
    """``path`` as ``$KVCOMP_CACHE/...`` when it lies in the cache folder (results carry no machine paths)."""
    try:
        return str(Path("$KVCOMP_CACHE") / Path(path).resolve().relative_to(cache_dir().resolve()))
    except ValueError:
        return str(path)
