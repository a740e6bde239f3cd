"""A griffe extension for the API reference: the code's docstrings cross-reference in Sphinx's roles
(``:class:`~kvcomp.cache.CompressedCache```), which Markdown would show as they are; each role becomes a code span
of the name it shows (``CompressedCache``: the last part after ``~``, the text before ``<target>``)."""

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|obj|exc|doc|ref):`([^`]+)`")


def _shown(target: str) -> str:
    text = target.split("<")[0].strip() if "<" in target else target
    return text.lstrip("~").rsplit(".", 1)[-1] if text.startswith("~") else text


def markdown_roles(text: str) -> str:
    """``:role:`~a.b.C``` -> ```C```; ``:role:`a.b.C``` -> ```a.b.C```; ``:role:`text <a.b>``` -> ```text```."""
    return ROLE.sub(lambda m: f"`{_shown(m.group(1))}`", text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_roles(obj.docstring.value)
