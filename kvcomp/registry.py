"""The registries that map the names a config gives to the classes it builds: codecs, presses and benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvcomp.errors import unknown_choice


class Registry(dict):
    """``{name: class}`` of one kind, filled by :meth:`register`. Looking up a name it lacks raises
    :func:`~kvcomp.errors.unknown_choice` (a :class:`~kvcomp.errors.ConfigError` listing the names it holds);
    ``names`` says under which names a class is registered (default: its ``name``)."""

    def __init__(self, kind: str, names: Callable[[type], Iterable[str]] = lambda cls: (cls.name,)):
        super().__init__()
        self.kind, self.names = kind, names

    def register(self, cls: type) -> type:
        """Class decorator: make ``cls`` buildable under each of its names; a name another class holds is refused."""
        for name in self.names(cls):
            if self.get(name, cls) is not cls:
                raise TypeError(f"{self.kind} {name!r} is taken by {self[name].__qualname__}; "
                                f"give {cls.__qualname__} a name of its own")
            self[name] = cls
        return cls

    def __missing__(self, name):
        raise unknown_choice(self.kind, name, self)
