"""HTML -> text with beautifulsoup4 (the standard library's parser: no compiled dependency)."""

from __future__ import annotations

import re

from ..errors import DocumentError

EMPTY_MESSAGE = "{shown} is HTML without any text in it (only markup or scripts). Give a page that contains text."

_BLOCKS = ("p", "div", "section", "article", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre",
           "blockquote", "br", "hr", "table", "ul", "ol", "dd", "dt", "figcaption", "header", "footer")


def _soup(markup: bytes | str, shown: str):
    try:
        from bs4 import BeautifulSoup
    except ModuleNotFoundError:
        from . import missing_extra

        raise missing_extra(shown, "an HTML file", "beautifulsoup4") from None
    try:
        return BeautifulSoup(markup, "html.parser")
    except Exception as exc:  # bs4 is lenient; anything raised here means unusable input
        raise DocumentError(f"{shown} could not be parsed as HTML ({exc}).") from None


def soup_text(soup) -> str:
    """Visible text with one blank line between blocks."""
    for tag in soup(["script", "style", "noscript", "template", "head"]):
        tag.decompose()
    for tag in soup.find_all(_BLOCKS):
        tag.insert_before("\n\n")
        tag.insert_after("\n\n")
    text = soup.get_text()
    lines = [re.sub(r"[ \t\u00a0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def to_text(data: bytes, shown: str) -> str:
    if b"\x00" in data[:8192]:
        raise DocumentError(f"{shown} is named HTML but contains binary data. Give a real HTML or text file.")
    return soup_text(_soup(data, shown))
