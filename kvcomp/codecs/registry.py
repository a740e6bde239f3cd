"""Maps codec config names to codec classes."""

from kvcomp.errors import unknown_choice

CODECS: dict[str, type] = {}


def register(cls):
    """Class decorator: make ``cls`` buildable by its ``name``."""
    CODECS[cls.name] = cls
    return cls


def codec_class(name: str):
    if name not in CODECS:
        raise unknown_choice("codec", name, CODECS)
    return CODECS[name]
