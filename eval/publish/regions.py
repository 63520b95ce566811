"""The regions of a markdown document that `vlm results` owns: `<!-- results:NAME -->` ... `<!--
/results:NAME -->`.

A block region holds a table and the caption line naming its JSON; an inline region (both markers on
one line) holds a figure inside prose. Everything outside the markers is left as it is."""

from __future__ import annotations

import re

OPEN, CLOSE = "<!-- results:{} -->", "<!-- /results:{} -->"
REGION = re.compile(
    r"<!-- results:(?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /results:(?P=name) -->", re.S
)
MARKER = re.compile(r"<!-- (/?)results:([\w.-]+) -->")


class RegionError(ValueError):
    """A document's markers are unbalanced, repeated or name no known table."""


def regions(text: str) -> dict[str, str]:
    """NAME -> the text between its markers. Every marker must belong to exactly one pair,
    each name once."""
    found: dict[str, str] = {}
    for m in REGION.finditer(text):
        if m["name"] in found:
            raise RegionError(f"results:{m['name']} appears twice")
        found[m["name"]] = m["body"]
    opened = [m.group(2) for m in MARKER.finditer(text)]
    for name in set(opened):
        if opened.count(name) != 2 or name not in found:
            raise RegionError(f"results:{name}: unbalanced markers")
    return found


def block(body: str) -> str:
    """What a block region holds between its marker lines."""
    return "\n" + body.strip("\n") + "\n"


def replace(text: str, rendered: dict[str, str]) -> str:
    """`text` with each region NAME in `rendered` holding rendered[NAME]; a region not in it
    is an error."""
    regions(text)  # validate first

    def sub(m: re.Match) -> str:
        name = m["name"]
        if name not in rendered:
            raise RegionError(f"results:{name} is no table `vlm results` knows")
        return OPEN.format(name) + rendered[name] + CLOSE.format(name)

    return REGION.sub(sub, text)
