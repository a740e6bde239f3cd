"""Maps codec config names to codec classes."""

from kvcomp.registry import Registry

CODECS = Registry("codec")


def register(cls):
    """Class decorator: make ``cls`` buildable by its config's ``name`` default, the one place a codec's name is
    written, and set ``cls.name`` from it."""
    if "name" in vars(cls):
        raise TypeError(f"{cls.__qualname__} sets name; a registered codec is named by its config's name default "
                        f"({cls.config_class.__qualname__}.name) only")
    cls.name = cls.config_class.name
    return CODECS.register(cls)


def codec_class(name: str):
    """The codec class registered as ``name`` (an unknown name is a :class:`~kvcomp.errors.ConfigError`)."""
    return CODECS[name]
