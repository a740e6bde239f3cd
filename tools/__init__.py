"""Tools that read the kernels without running a model: the static performance model of a decode step
(:mod:`tools.static_model`, run by ``python -m tools.kernel_model``) and the kernels' compiled resources on sm_90
(:mod:`tools.resources`, run by ``python -m tools.kernel_resources``).

Not part of the installed package: run from the repository root (``python -m tools.<name>``). These modules may
import :mod:`kvcomp`; :mod:`kvcomp` never imports them (``tests/usage/test_layering.py``)."""
