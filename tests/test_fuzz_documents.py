"""Fuzz target for the document readers (plain text, HTML, PDF, EPUB): a valid file of each kind,
damaged at the byte level (flips, truncation, splices, foreign prefixes), is either read into a
Document or refused with DocumentError — never another exception, never a hang. Fixed seed and
bounded examples, so CI runs it the same way every time."""

from __future__ import annotations

from pathlib import Path

import pytest
from byte_damage import apply_damage, damage
from document_samples import minimal_epub, minimal_pdf
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sekv_local.documents import Document
from sekv_local.errors import DocumentError
from sekv_local.readers import read_any

TEXT = "The keeper of the lighthouse is Maren Holt.\n\nShe lights the lamp at dusk. — «Port Alder» ✓\n"
HTML = ("<html><head><style>p{}</style><script>var x = 1;</script></head><body><h1>Port Alder</h1>"
        "<p>The keeper is <b>Maren</b> Holt.</p><table><tr><td>lamp</td></tr></table></body></html>")


@pytest.fixture(scope="module")
def seeds() -> dict[str, bytes]:
    pytest.importorskip("pypdf")
    pytest.importorskip("ebooklib")
    return {".txt": TEXT.encode(), ".md": ("# Title\n\n" + TEXT).encode("utf-16"), ".html": HTML.encode(),
            ".pdf": minimal_pdf("The keeper is Maren Holt."), ".epub": minimal_epub("The keeper is Maren Holt.")}


DAMAGE = damage(st.sampled_from([b"%PDF-1.7\n", b"PK\x03\x04", b"\xef\xbb\xbf", b"\xff\xfe", b"GGUF", b"<html>"])
                .map(lambda b: ("prefix", b)), max_flips=6)


@seed(20261130)
@settings(database=None, max_examples=800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([".txt", ".md", ".html", ".pdf", ".epub"]), DAMAGE)
def test_damaged_documents_are_read_or_refused(seeds: dict[str, bytes], tmp_path: Path, suffix: str, change) -> None:
    path = tmp_path / f"book{suffix}"
    path.write_bytes(apply_damage(seeds[suffix], change))
    try:
        doc = read_any(path)
    except DocumentError as exc:
        assert str(exc) and "book" in str(exc)  # the message names the file
        return
    assert isinstance(doc, Document) and doc.text.strip()


def test_regression_a_pdf_whose_resources_are_a_number(seeds: dict[str, bytes], tmp_path: Path) -> None:
    # found by the fuzzer: a flipped byte turned /Resources into a number; pypdf raised AttributeError
    path = tmp_path / "book.pdf"
    path.write_bytes(apply_damage(seeds[".pdf"], ("flip", [(553, 56)])))
    with pytest.raises(DocumentError, match="damaged or unsupported PDF"):
        read_any(path)
