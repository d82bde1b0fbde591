"""Documents that are not plain text: HTML, PDF and EPUB through optional, well-kept libraries.

``read_any(path)`` reads .txt/.md (and any text file) with :func:`sekv_local.documents.read_document`
and converts .html/.htm/.xhtml (beautifulsoup4), .pdf (pypdf) and .epub (ebooklib + beautifulsoup4)
to text first. The libraries come with the ``readers`` extra: ``pip install 'sekv-local[readers]'``.
Every failure is a :class:`~sekv_local.errors.DocumentError` whose message names the file and says
what to do, like the plain-text reader's.
"""

from __future__ import annotations

import stat as stat_module
from pathlib import Path

from ..documents import DEFAULT_MAX_BYTES, Document, _show, _too_large, read_document
from ..errors import DocumentError

__all__ = ["read_any", "CONVERTERS", "missing_extra"]

#: suffix -> (module, library named in messages)
CONVERTERS = {
    ".html": ("html", "beautifulsoup4"),
    ".htm": ("html", "beautifulsoup4"),
    ".xhtml": ("html", "beautifulsoup4"),
    ".pdf": ("pdf", "pypdf"),
    ".epub": ("epub", "ebooklib"),
}


def missing_extra(shown: str, fmt: str, library: str) -> DocumentError:
    return DocumentError(
        f"{shown} is {fmt}; reading it needs the optional {library} library: "
        f"pip install 'sekv-local[readers]' (or convert the file to .txt first).")


def read_any(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Document:
    """A Document from a text, HTML, PDF or EPUB file (by suffix)."""
    try:
        p = Path(path).expanduser()
    except (TypeError, RuntimeError):
        return read_document(path, max_bytes)  # raises the plain reader's message
    suffix = p.suffix.lower()
    if suffix not in CONVERTERS:
        return read_document(p, max_bytes)
    shown = _show(p)
    # Missing files, folders, permissions: the plain reader's checks and messages.
    try:
        st = p.stat()
    except OSError:
        return read_document(p, max_bytes)
    if not stat_module.S_ISREG(st.st_mode):
        return read_document(p, max_bytes)
    if st.st_size > max_bytes:
        raise DocumentError(_too_large(shown, st.st_size, max_bytes))
    if st.st_size == 0:
        raise DocumentError(f"{shown} is empty (0 bytes). Give a file that contains text.")
    try:
        with p.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError:
        return read_document(p, max_bytes)
    module_name, _library = CONVERTERS[suffix]
    from importlib import import_module

    module = import_module(f"{__name__}.{module_name}")
    text = module.to_text(data, shown)
    if not text.strip():
        raise DocumentError(module.EMPTY_MESSAGE.format(shown=shown))
    return Document.from_text(text, p)
