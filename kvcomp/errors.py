"""Errors raised for bad input. Each names the problem and, where there is a list, the valid choices."""


class KVCompError(Exception):
    """Base class of every error kvcomp raises on purpose."""


class ConfigError(KVCompError, ValueError):
    """A configuration value that cannot work (unknown name, bit width a codec cannot do, ...)."""


class CalibrationMismatchError(KVCompError, ValueError):
    """A saved calibration state was fitted for another model, codec config or calibration set."""


class DamagedPayloadError(KVCompError, ValueError):
    """A stored payload does not hold what its plan implies (a damaged or crafted stored cache)."""


class NonFiniteKVError(KVCompError, FloatingPointError):
    """NaN or Inf reached the KV cache."""


class NonFiniteStateError(KVCompError, FloatingPointError):
    """A fitted or loaded codec state (codebooks, statistics, predictors) holds NaN or Inf."""


def first_line(err: BaseException) -> str:
    """``Type: first line of the message`` of an exception, for one-line errors that wrap it."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def unknown_choice(kind: str, name: str, choices) -> ConfigError:
    """An error for an unknown name among known ones, listing the valid choices."""
    return ConfigError(f"unknown {kind} {name!r}; valid choices: {', '.join(sorted(choices))}")
