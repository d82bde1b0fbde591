"""PDF -> text with pypdf (pure Python). Scanned PDFs have no text layer: they are refused clearly."""

from __future__ import annotations

import io

from ..errors import DocumentError

EMPTY_MESSAGE = ("{shown} is a PDF without extractable text (probably scanned page images). "
                 "Run OCR on it first (e.g. ocrmypdf) or give a text version.")


def to_text(data: bytes, shown: str) -> str:
    try:
        from pypdf import PdfReader
    except ModuleNotFoundError:
        from . import missing_extra

        raise missing_extra(shown, "a PDF file", "pypdf") from None
    if not data.lstrip()[:5] == b"%PDF-":
        raise DocumentError(f"{shown} is named .pdf but is not a PDF file (no %PDF- header).")
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                if not reader.decrypt(""):
                    raise DocumentError(f"{shown} is a password-protected PDF. Remove the password first "
                                        f"(e.g. qpdf --decrypt) or give a text version.")
            except DocumentError:
                raise
            except Exception:
                raise DocumentError(f"{shown} is an encrypted PDF that cannot be opened without its password "
                                    f"(or pypdf needs the cryptography package: pip install cryptography).") from None
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
    except DocumentError:
        raise
    except Exception as exc:  # pypdf raises assorted types on damaged files (AttributeError, IndexError, ...)
        raise DocumentError(f"{shown} is a damaged or unsupported PDF ({exc.__class__.__name__}: {exc}). "
                            f"Re-export it, or convert it to .txt first.") from None
    return "\n\n".join(p for p in pages if p) + "\n"
