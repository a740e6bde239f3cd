"""Speed and memory benchmarks and profilers of the compressed cache and its kernels, most of which write their
section of BENCHMARKS.md (``--write``), and :mod:`benchmarks.benchmarking`, the timing helpers they share.

Not part of the installed package: run from the repository root (``python -m benchmarks.<name>``; the GPU runs in
order: ``bash benchmarks/gpu_benchmarks.sh``). These modules may import :mod:`kvcomp`; :mod:`kvcomp` never imports
them (``tests/usage/test_layering.py``). The evaluation benchmarks a run executes (perplexity, RULER, lm-eval) are
:mod:`kvcomp.benchmarks`."""
