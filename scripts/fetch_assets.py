"""Fetch the embedded model and corpora into the kvcomp cache (idempotent; see kvcomp.data.assets)."""

import time

from kvcomp.data.assets import ensure_embedded_corpora, ensure_embedded_model
from kvcomp.paths import cache_dir

if __name__ == "__main__":
    start = time.perf_counter()
    model = ensure_embedded_model()
    corpora = ensure_embedded_corpora()
    print(f"kvcomp assets ready in {cache_dir()} ({time.perf_counter() - start:.1f}s): model {model.name}, corpora {', '.join(corpora)}")
