"""Benchmarks that read the compressed cache: perplexity (here), RULER and lm-eval tasks (later)."""
