"""Config dataclasses from mappings, and the range checks their ``__post_init__`` run.

This module sits at the bottom of the package (beside :mod:`kvcomp.errors`), so that every layer can
describe its settings as a dataclass next to the code that uses them (codec configs beside their codecs,
benchmark configs beside their benchmarks) and :mod:`kvcomp.config` only gathers them for Hydra.
omegaconf is imported by :func:`structured` when it is called: the codecs, the cache and the kernels
import without it.
"""

from __future__ import annotations

from kvcomp.errors import ConfigError


def at_least(config, minimum: int, *names: str, optional: bool = False) -> None:
    """Raise :class:`ConfigError` naming the field when one of ``names`` of ``config`` is below ``minimum``
    (``optional``: ``None`` is allowed too)."""
    for name in names:
        value = getattr(config, name)
        if optional and value is None:
            continue
        if not isinstance(value, int) or value < minimum:
            valid = f"an integer >= {minimum}" + (" or null" if optional else "")
            raise ConfigError(f"{name}={value!r} is out of range; valid: {valid}")


def one_of(config, name: str, choices) -> None:
    """Raise :class:`ConfigError` when field ``name`` of ``config`` is not among ``choices``."""
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; valid choices: {', '.join(map(str, choices))}")


def structured(schema: type, config, label: str, group: str = ""):
    """``config`` (DictConfig or mapping) merged onto ``schema``'s defaults, as a ``schema`` instance.

    Unknown or mistyped fields raise :class:`ConfigError` naming ``label`` and the field; a value out of
    range (the dataclass' ``__post_init__``) names it as ``<group>.<field>``."""
    from omegaconf import DictConfig, OmegaConf  # a dependency of this function only (see the module docstring)

    raw = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))
    except ConfigError as exc:  # a range check of the dataclass (__post_init__)
        raise ConfigError(f"{group}.{exc}" if group else f"{label}: {exc}") from exc
    except Exception as exc:  # omegaconf's several error types become one clear error
        field_name = getattr(exc, "full_key", None)
        where = f" field {field_name!r}" if field_name else ""
        raise ConfigError(f"{label}{where}: {str(exc).splitlines()[0]}") from exc
