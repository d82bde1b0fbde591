"""Reading the documents that a user chats with.

A document is plain text: ``read_document`` turns a file into a :class:`Document` whose text has
newlines normalized to ``\\n`` and no byte-order mark, and whose ``sha256`` (of that text, UTF-8)
identifies it for saved memories. Anything wrong with the file -- missing, a directory, unreadable,
empty, too large, binary, not decodable -- raises :class:`~sekv_local.errors.DocumentError` with a
message that names the file, says what is wrong and what to do; bad input never gives a traceback.

Formats that are not plain text (PDF, EPUB, HTML) come through the optional readers in
``sekv_local.converters``; this module only reads text.
"""

from __future__ import annotations

import codecs
import hashlib
import stat as stat_module
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sekv_local.errors import DocumentError

__all__ = [
    "Document",
    "read_document",
    "sample_document",
    "SUPPORTED_SUFFIXES",
    "CONVERTED_SUFFIXES",
    "DEFAULT_MAX_BYTES",
]

#: Suffixes read as text without a second thought. Other suffixes are accepted when the content is
#: text (a ``.log`` or ``.rst`` is text too); binary content is refused whatever the suffix.
SUPPORTED_SUFFIXES = (".txt", ".md", ".markdown", ".text")

#: Suffixes whose files need one of the optional readers rather than this plain-text reader.
CONVERTED_SUFFIXES = (".pdf", ".epub", ".html", ".htm", ".xhtml")

DEFAULT_MAX_BYTES = 64 * 1024 * 1024

_SNIFF_BYTES = 8 * 1024
# Fraction of control bytes in the first 8 KB above which the file is taken as binary.
_CONTROL_FRACTION = 0.10
# Control bytes that do occur in text: backspace, tab, LF, VT, FF, CR, ESC (ANSI colours in logs).
_TEXT_CONTROLS = frozenset(b"\b\t\n\x0b\x0c\r\x1b")
_CONTROL_BYTES = frozenset(range(0x20)) - _TEXT_CONTROLS | {0x7F}

# Byte-order marks, longest first (a UTF-32-LE BOM starts with the UTF-16-LE one).
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"),
    (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
    (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"),
)

# Leading bytes of common non-text formats, used to name what the file looks like.
_MAGIC = (
    (b"%PDF-", "a PDF file"),
    (b"PK\x03\x04", "a ZIP archive (EPUB, DOCX and ODT files are ZIP archives)"),
    (b"GGUF", "a GGUF model file"),
    (b"\x7fELF", "an executable"),
    (b"\x1f\x8b", "a gzip-compressed file"),
    (b"BZh", "a bzip2-compressed file"),
    (b"\xfd7zXZ\x00", "an xz-compressed file"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old Microsoft Office file"),
    (b"SQLite format 3\x00", "an SQLite database"),
)


@dataclass(frozen=True)
class Document:
    """A text document: its source path (None when it did not come from a file), its text and the
    SHA-256 of that text encoded UTF-8, which identifies the document for saved memories."""

    path: Path | None
    text: str
    sha256: str

    @property
    def name(self) -> str:
        """The file name, for display ("untitled document" when there is no path)."""
        return self.path.name if self.path is not None else "untitled document"

    @classmethod
    def from_text(cls, text: str, path: str | Path | None = None) -> "Document":
        """A document from text already in memory (newlines normalized, BOM stripped)."""
        text = _normalize(text)
        return cls(path=Path(path) if path is not None else None, text=text, sha256=_sha256(text))


def read_document(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Document:
    """Read a text file into a :class:`Document`.

    Decodes UTF-8 (with or without a BOM), or UTF-16/UTF-32 when the file starts with their BOM;
    normalizes newlines to ``\\n`` and strips the BOM. Raises :class:`DocumentError` with a message
    for the user when the file is missing, a directory, unreadable, empty or whitespace-only, larger
    than ``max_bytes``, binary, or not decodable.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    try:
        path = Path(path).expanduser()
    except (TypeError, RuntimeError) as exc:  # RuntimeError: "~user" that cannot be expanded
        raise DocumentError(f"Cannot use {path!r} as a document path: {exc}.") from None
    shown = _show(path)

    try:
        st = path.stat()
    except OSError as exc:
        raise _unreadable(path, shown, exc) from None

    if stat_module.S_ISDIR(st.st_mode):
        raise DocumentError(
            f"{shown} is a directory, not a document. Give the path of one text file in it "
            f"(e.g. a .txt or .md file)."
        )
    if not stat_module.S_ISREG(st.st_mode):
        raise DocumentError(
            f"{shown} is not a regular file (a device, pipe or socket). "
            f"Save the text to a file and give that file's path."
        )
    if st.st_size > max_bytes:
        raise DocumentError(_too_large(shown, st.st_size, max_bytes))

    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except PermissionError:
        raise DocumentError(
            f"Cannot read {shown}: permission denied. "
            f"Fix its permissions (e.g. chmod +r) or copy it somewhere you can read."
        ) from None
    except IsADirectoryError:
        raise DocumentError(f"{shown} is a directory, not a document. Give the path of one text file.") from None
    except OSError as exc:
        raise DocumentError(f"Cannot read {shown}: {exc.strerror or exc}.") from None
    if len(data) > max_bytes:  # the file grew since stat, or stat under-reports
        raise DocumentError(_too_large(shown, None, max_bytes))

    text = _decode(data, shown, path.suffix.lower())
    return Document(path=path, text=text, sha256=_sha256(text))


def sample_document() -> Document:
    """The sample document bundled with the package (``sekv_local/data/sample.md``)."""
    resource = resources.files("sekv_local.data").joinpath("sample.md")
    try:
        data = resource.read_bytes()
    except OSError as exc:
        raise DocumentError(
            f"The bundled sample document is missing ({exc}). Reinstall sekv-local."
        ) from None
    path = Path(str(resource)) if isinstance(resource, Path) else None
    text = _decode(data, "the bundled sample document", ".md")
    return Document(path=path, text=text, sha256=_sha256(text))


# --------------------------------------------------------------------------------------------------


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _normalize(text: str) -> str:
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _cwd() -> str:
    try:
        return str(Path.cwd())
    except OSError:
        return "which no longer exists"


def _unreadable(path: Path, shown: str, exc: OSError) -> DocumentError:
    """The user's message for a document path that cannot be looked up."""
    if "\n" in str(path) or len(str(path)) > 4096:  # no such file, and it reads like text
        return DocumentError(f"{str(path)[:60]!r}... is not a file; it looks like document text. "
                             f"Use Document.from_text(text) for text already in memory.")
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        where = "" if path.is_absolute() else f" (a relative path is taken from the current directory, {_cwd()})"
        return DocumentError(f"Document not found: {shown}. Check the path and the spelling{where}.")
    if isinstance(exc, PermissionError):
        return DocumentError(f"Cannot read {shown}: permission denied on the file or a folder above it. "
                             f"Fix its permissions (e.g. chmod +r) or copy it somewhere you can read.")
    return DocumentError(f"Cannot read {shown}: {exc.strerror or exc}.")


def _show(path: Path) -> str:
    try:
        return str(path.absolute())
    except OSError:  # the current directory was removed
        return str(path)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _too_large(shown: str, size: int | None, max_bytes: int) -> str:
    def both(n: int) -> str:
        return f"{_size(n)} ({n:,} bytes)" if n >= 1024 else f"{n:,} bytes"

    what = f"is {both(size)}" if size is not None else "is larger than the limit"
    return (
        f"{shown} {what}; the limit is {both(max_bytes)}. "
        f"Split the document into smaller files, or raise the limit if you really mean it."
    )


def _decode(data: bytes, shown: str, suffix: str) -> str:
    if not data:
        raise DocumentError(f"{shown} is empty (0 bytes). Give a file that contains text.")

    encoding, label, bom_len = "utf-8", "UTF-8", 0
    for bom, enc, name in _BOMS:
        if data.startswith(bom):
            encoding, label, bom_len = enc, name, len(bom)
            break

    if encoding == "utf-8-sig":
        encoding = "utf-8"
        data = data[bom_len:]
    if encoding == "utf-8" and data:  # without a BOM, UTF-16/32 text is not recognised (NUL bytes)
        _refuse_binary(data, shown, suffix)
    # The UTF-16/32 codecs consume the BOM themselves and pick the byte order from it.

    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        offset = exc.start + (bom_len if encoding == "utf-8" else 0)
        bad = data[exc.start : min(exc.end, exc.start + 4)].hex(" ") or "?"
        if encoding == "utf-8":
            fix = (
                "Re-save it as UTF-8: in an editor, 'Save as' with UTF-8 encoding; or, if it is "
                "Latin-1/Windows-1252 text, `iconv -f cp1252 -t utf-8 FILE > FILE.utf8.txt`."
            )
        else:
            fix = f"The file may be damaged or not really {label}; re-save it as UTF-8 in an editor."
        raise DocumentError(
            f"{shown} is not valid {label} text: the byte(s) {bad} at offset {offset:,} "
            f"cannot be decoded ({exc.reason}). {fix}"
        ) from None

    if encoding != "utf-8":  # decoded UTF-16/32 must still look like text
        sample = text[: _SNIFF_BYTES // 2]
        controls = sum(1 for ch in sample if ord(ch) in _CONTROL_BYTES)
        if "\x00" in sample or (sample and controls / len(sample) > _CONTROL_FRACTION):
            raise DocumentError(
                f"{shown} starts with a {label} byte-order mark but its content is not text. "
                f"Give a plain-text file (.txt or .md)."
            )

    text = _normalize(text)
    if not text.strip():
        raise DocumentError(
            f"{shown} contains only whitespace ({len(data):,} bytes, no text). Give a file that contains text."
        )
    return text


def _refuse_binary(data: bytes, shown: str, suffix: str) -> None:
    head = data[:_SNIFF_BYTES]
    kind = next((desc for magic, desc in _MAGIC if head.startswith(magic)), None)
    has_nul = b"\x00" in data  # anywhere: NUL never occurs in text, and the scan is cheap
    controls = sum(1 for b in head if b in _CONTROL_BYTES)
    is_binary = has_nul or controls / len(head) > _CONTROL_FRACTION or head.startswith(b"%PDF-")
    if not is_binary:
        return

    looks = f"looks like {kind}" if kind else "looks like a binary file, not text"
    why = "it contains NUL bytes" if has_nul else f"{controls / len(head):.0%} of its first bytes are control characters"
    if kind == "a PDF file" and not has_nul:
        why = "it starts with a PDF header"
    msg = f"{shown} {looks} ({why}); only plain text can be read directly."
    if suffix in CONVERTED_SUFFIXES:
        fmt = suffix.lstrip(".").upper()
        msg += (
            f" {fmt} support comes through the optional readers (sekv_local.converters); "
            f"use one of them, or convert the file to .txt first."
        )
    elif has_nul and _looks_like_bomless_utf16(head):
        msg += (
            " It may be UTF-16 text without a byte-order mark: re-save it as UTF-8 "
            "(e.g. `iconv -f utf-16le -t utf-8`)."
        )
    else:
        msg += " Give a .txt or .md file (PDF, EPUB and HTML go through the optional readers)."
    raise DocumentError(msg)


def _looks_like_bomless_utf16(head: bytes) -> bool:
    """True when nearly every other byte is NUL, as in ASCII-range UTF-16 text."""
    if len(head) < 4:
        return False
    even, odd = head[0::2], head[1::2]
    return max(even.count(0) / len(even), odd.count(0) / len(odd)) > 0.9 and min(
        even.count(0) / len(even), odd.count(0) / len(odd)
    ) < 0.1
