"""Fetch the embedded model and corpora into the kvcomp cache (idempotent; see kvcomp.data.assets).

    python scripts/fetch_assets.py          # what the default run needs: SmolLM2-135M, enwiki, lee
    python scripts/fetch_assets.py --all    # also the assets otherwise fetched on first use (Qwen2.5-Coder-0.5B,
                                            # Gemma-3-270M, PTB, exllamav2's wiki / c4, RULER's essays and QA sets)
"""

import argparse
import time

from kvcomp.data.assets import (
    ensure_embedded_corpora,
    ensure_embedded_model,
    ensure_exllama_corpora,
    ensure_ptb,
    ensure_ruler_data,
)
from kvcomp.paths import cache_dir

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also fetch the assets otherwise fetched on first use")
    args = parser.parse_args()
    start = time.perf_counter()
    models = [ensure_embedded_model().name]
    corpora = list(ensure_embedded_corpora())
    if args.all:
        models += [ensure_embedded_model(key).name for key in ("qwen25_coder_05b", "gemma3_270m")]
        ensure_ptb()
        corpora += ["ptb", *ensure_exllama_corpora(), *ensure_ruler_data()]
    print(f"kvcomp assets ready in {cache_dir()} ({time.perf_counter() - start:.1f}s): models {', '.join(models)}, "
          f"corpora {', '.join(corpora)}")
