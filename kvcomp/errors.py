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


def at_least(least: int, kind: type = int):
    """An argparse ``type`` for a script's counts: a ``kind`` of at least ``least``, else argparse's usage
    error (``argument --reps: must be at least 1, got 0``, exit status 2) before any work starts."""
    from argparse import ArgumentTypeError

    def parse(text: str):
        value = kind(text)  # a ValueError: argparse's "invalid int value"
        if value < least:
            raise ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    parse.__name__ = kind.__name__
    return parse


def existing_directory(text: str):
    """An argparse ``type`` for a script's input folder: a :class:`~pathlib.Path` that is a directory, else
    argparse's usage error before any work starts."""
    from argparse import ArgumentTypeError
    from pathlib import Path

    path = Path(text)
    if not path.is_dir():
        raise ArgumentTypeError(f"{text} is not a directory")
    return path
