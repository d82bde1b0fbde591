"""Small valid documents in each format the readers take, built locally (tests and fuzz seeds)."""

from __future__ import annotations

import io
import re
import tempfile
import zipfile
from pathlib import Path


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF with `text` in Helvetica (hand-written objects, correct xref offsets)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def minimal_epub(text: str) -> bytes:
    """A one-chapter EPUB whose chapter says `text` (written by ebooklib)."""
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("port-alder")
    book.set_title("Port Alder")
    book.set_language("en")
    chapter = epub.EpubHtml(title="One", file_name="one.xhtml", lang="en")
    chapter.content = f"<html><body><h1>One</h1><p>{text}</p></body></html>"
    book.add_item(chapter)
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = [chapter]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "book.epub"
        epub.write_epub(str(path), book)
        return _fixed_zip_dates(path.read_bytes())


def _fixed_zip_dates(data: bytes) -> bytes:
    """The same ZIP with every entry dated 1980-01-01 and a fixed modification stamp in the package file,
    so the bytes do not depend on when it was written."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            fixed = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            fixed.compress_type, fixed.external_attr = info.compress_type, info.external_attr
            body = src.read(info.filename)
            if info.filename.endswith(".opf"):  # ebooklib stamps the write time into the package file
                body = re.sub(rb'(<meta property="dcterms:modified">)[^<]*', rb"\g<1>2000-01-01T00:00:00Z", body)
            dst.writestr(fixed, body)
    return out.getvalue()
