"""EPUB -> text with ebooklib (chapters in reading order) and beautifulsoup4 for their XHTML."""

from __future__ import annotations

import io
import os
import tempfile
import zipfile

from ..errors import DocumentError

EMPTY_MESSAGE = "{shown} is an EPUB without any text in its chapters. Give a book that contains text."


def to_text(data: bytes, shown: str) -> str:
    try:
        import ebooklib
        from ebooklib import epub
    except ModuleNotFoundError:
        from . import missing_extra

        raise missing_extra(shown, "an EPUB file", "ebooklib") from None
    from .html import _soup, soup_text

    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise DocumentError(f"{shown} is named .epub but is not an EPUB (not a ZIP archive).")
    # ebooklib reads from a path; use a private temporary copy (the original may be on a slow mount).
    fd, tmp = tempfile.mkstemp(suffix=".epub")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            book = epub.read_epub(tmp, options={"ignore_ncx": True})
        except Exception as exc:  # ebooklib raises many kinds on broken books
            raise DocumentError(f"{shown} is a damaged or unsupported EPUB ({exc.__class__.__name__}: {exc}). "
                                f"Convert it to .txt first (e.g. with Calibre's ebook-convert).") from None
    finally:
        os.unlink(tmp)
    chapters = []
    ordered = [book.get_item_with_id(idref) for idref, _linear in book.spine]
    items = [i for i in ordered if i is not None] or list(book.get_items_of_type(ebooklib.ITEM_DOCUMENT))
    for item in items:
        if item.get_type() != ebooklib.ITEM_DOCUMENT:
            continue
        text = soup_text(_soup(item.get_content(), shown)).strip()
        if text:
            chapters.append(text)
    return "\n\n".join(chapters) + "\n"
