"""Token eviction stages ("presses"), one per file, orthogonal to the codec (:mod:`kvcomp.presses.base`); this
package imports every module beside ``base``."""

import importlib
import pkgutil

from kvcomp.presses.base import PRESSES, Prefill, Press, PressConfig, build_press, press_config

for _module in pkgutil.iter_modules(__path__):  # importing a module registers the presses it defines
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["PRESSES", "Prefill", "Press", "PressConfig", "build_press", "press_config"]
