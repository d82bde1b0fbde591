"""Tests for sekv_local.documents: reading text files, the user-facing errors, and the sample."""

from __future__ import annotations

import codecs
import hashlib
import os
import pathlib
import socket
import struct

import pytest

from sekv_local.documents import (
    SUPPORTED_SUFFIXES,
    Document,
    read_document,
    sample_document,
)
from sekv_local.errors import DocumentError, SekvError


def write(tmp_path, name: str, data: bytes) -> pathlib.Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def error_for(path, **kwargs) -> str:
    with pytest.raises(DocumentError) as info:
        read_document(path, **kwargs)
    assert isinstance(info.value, SekvError)
    msg = str(info.value)
    assert "Traceback" not in msg
    return msg


# ------------------------------------------------------------------------------------- good files


def test_reads_plain_utf8(tmp_path):
    p = write(tmp_path, "notes.txt", "Hello, wörld — ünïcode ✓\nsecond line\n".encode("utf-8"))
    doc = read_document(p)
    assert isinstance(doc, Document)
    assert doc.text == "Hello, wörld — ünïcode ✓\nsecond line\n"
    assert doc.path == p
    assert doc.name == "notes.txt"
    assert doc.sha256 == hashlib.sha256(doc.text.encode("utf-8")).hexdigest()


def test_accepts_str_path(tmp_path):
    p = write(tmp_path, "a.md", b"# Title\n")
    doc = read_document(str(p))
    assert doc.text == "# Title\n"
    assert isinstance(doc.path, pathlib.Path)


def test_supported_suffixes():
    assert SUPPORTED_SUFFIXES == (".txt", ".md", ".markdown", ".text")


@pytest.mark.parametrize("suffix", [".log", ".rst", ".csv", "", ".weird"])
def test_unknown_suffixes_with_text_are_accepted(tmp_path, suffix):
    p = write(tmp_path, f"file{suffix}", b"just some text\n")
    assert read_document(p).text == "just some text\n"


def test_html_that_is_text_is_accepted(tmp_path):
    p = write(tmp_path, "page.html", b"<html><body><p>Hi</p></body></html>\n")
    assert "<p>Hi</p>" in read_document(p).text


def test_utf8_bom_is_stripped(tmp_path):
    p = write(tmp_path, "bom.txt", codecs.BOM_UTF8 + "caf\u00e9\r\nline two".encode("utf-8"))
    doc = read_document(p)
    assert doc.text == "caf\u00e9\nline two"
    assert not doc.text.startswith("\ufeff")


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_with_bom(tmp_path, encoding):
    bom = codecs.BOM_UTF16_LE if encoding.endswith("le") else codecs.BOM_UTF16_BE
    text = "Grüße aus Wrenmouth\r\nzweite Zeile 🌊\n"
    p = write(tmp_path, "u16.txt", bom + text.encode(encoding))
    doc = read_document(p)
    assert doc.text == "Grüße aus Wrenmouth\nzweite Zeile 🌊\n"
    assert not doc.text.startswith("\ufeff")


def test_utf16_via_python_codec(tmp_path):
    # Python's "utf-16" codec writes a BOM in native order.
    p = write(tmp_path, "u16.md", "# Title\nbody\n".encode("utf-16"))
    assert read_document(p).text == "# Title\nbody\n"


def test_utf32_with_bom(tmp_path):
    p = write(tmp_path, "u32.txt", "thirty-two\n".encode("utf-32"))
    assert read_document(p).text == "thirty-two\n"


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"a\r\nb\r\nc", "a\nb\nc"),  # Windows
        (b"a\rb\rc", "a\nb\nc"),  # old Mac
        (b"a\r\nb\rc\nd", "a\nb\nc\nd"),  # mixed
        (b"a\r\r\nb", "a\n\nb"),
        (b"a\n\nb\n", "a\n\nb\n"),  # already normalized: unchanged
    ],
)
def test_newline_normalization(tmp_path, raw, expected):
    p = write(tmp_path, "nl.txt", raw)
    assert read_document(p).text == expected


def test_sha256_stable_and_independent_of_encoding(tmp_path):
    text = "Line one\nLine two — ä\n"
    a = read_document(write(tmp_path, "a.txt", text.encode("utf-8")))
    b = read_document(write(tmp_path, "b.txt", codecs.BOM_UTF8 + text.replace("\n", "\r\n").encode("utf-8")))
    c = read_document(write(tmp_path, "c.txt", text.encode("utf-16")))
    again = read_document(tmp_path / "a.txt")
    expected = hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert a.sha256 == b.sha256 == c.sha256 == again.sha256 == expected
    assert len(a.sha256) == 64
    other = read_document(write(tmp_path, "d.txt", b"Line one\nLine two\n"))
    assert other.sha256 != a.sha256


def test_document_is_frozen(tmp_path):
    doc = read_document(write(tmp_path, "f.txt", b"x"))
    with pytest.raises(Exception):
        doc.text = "y"  # type: ignore[misc]


def test_name_without_path():
    doc = Document(path=None, text="t", sha256=hashlib.sha256(b"t").hexdigest())
    assert isinstance(doc.name, str) and doc.name


def test_from_text_normalizes_and_hashes():
    doc = Document.from_text("\ufeffa\r\nb")
    assert doc.text == "a\nb"
    assert doc.sha256 == hashlib.sha256(b"a\nb").hexdigest()
    assert doc.path is None


def test_exactly_max_bytes_is_allowed(tmp_path):
    p = write(tmp_path, "ok.txt", b"x" * 100)
    assert len(read_document(p, max_bytes=100).text) == 100


# ------------------------------------------------------------------------------------------ errors


def test_missing_file(tmp_path):
    p = tmp_path / "nope.txt"
    msg = error_for(p)
    assert str(p) in msg
    assert "not found" in msg.lower()
    assert "path" in msg.lower()


def test_missing_parent_is_not_a_directory(tmp_path):
    f = write(tmp_path, "file.txt", b"x")
    msg = error_for(f / "child.txt")
    assert "not found" in msg.lower()


def test_directory(tmp_path):
    msg = error_for(tmp_path)
    assert str(tmp_path) in msg
    assert "directory" in msg.lower()
    assert ".txt" in msg or "file" in msg.lower()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can read anything")
def test_unreadable_by_permissions(tmp_path):
    p = write(tmp_path, "secret.txt", b"hidden")
    p.chmod(0)
    try:
        msg = error_for(p)
    finally:
        p.chmod(0o644)
    assert str(p) in msg
    assert "permission" in msg.lower()


def test_unreadable_permission_error_on_open(tmp_path, monkeypatch):
    # Works as root too: simulate the PermissionError that open() raises for an unreadable file.
    p = write(tmp_path, "secret.txt", b"hidden")
    real_open = pathlib.Path.open

    def fake_open(self, *args, **kwargs):
        if self == p:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", fake_open)
    msg = error_for(p)
    assert str(p) in msg
    assert "permission denied" in msg.lower()
    assert "chmod" in msg


def test_permission_error_on_stat(tmp_path, monkeypatch):
    p = write(tmp_path, "secret.txt", b"hidden")
    real_stat = pathlib.Path.stat

    def fake_stat(self, *args, **kwargs):
        if self == p:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", fake_stat)
    msg = error_for(p)
    assert "permission denied" in msg.lower()


def test_other_os_error_on_read(tmp_path, monkeypatch):
    p = write(tmp_path, "io.txt", b"data")
    real_open = pathlib.Path.open

    def fake_open(self, *args, **kwargs):
        if self == p:
            raise OSError(5, "Input/output error")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", fake_open)
    msg = error_for(p)
    assert str(p) in msg and "Input/output error" in msg


@pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs unix sockets")
def test_not_a_regular_file(tmp_path):
    sock_path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(sock_path))
    except OSError:
        pytest.skip("cannot bind a unix socket here")
    try:
        msg = error_for(sock_path)
    finally:
        s.close()
    assert "not a regular file" in msg


def test_empty_file(tmp_path):
    p = write(tmp_path, "empty.txt", b"")
    msg = error_for(p)
    assert str(p) in msg
    assert "empty" in msg.lower()


@pytest.mark.parametrize("data", [b"   \n\t\r\n  ", b"\n", codecs.BOM_UTF8 + b"  \n", "  \n".encode("utf-16")])
def test_whitespace_only_file(tmp_path, data):
    p = write(tmp_path, "blank.md", data)
    msg = error_for(p)
    assert str(p) in msg
    assert "whitespace" in msg.lower()


def test_bom_only_file(tmp_path):
    p = write(tmp_path, "bom.txt", codecs.BOM_UTF8)
    msg = error_for(p)
    assert "whitespace" in msg.lower() or "empty" in msg.lower()


def test_too_large(tmp_path):
    p = write(tmp_path, "big.txt", b"a" * 5000)
    msg = error_for(p, max_bytes=1000)
    assert str(p) in msg
    assert "5,000" in msg and "1,000" in msg  # both sizes, in bytes
    assert "limit" in msg.lower()
    assert "split" in msg.lower()


def test_too_large_human_sizes(tmp_path):
    p = write(tmp_path, "big.txt", b"a" * (3 * 1024 * 1024))
    msg = error_for(p, max_bytes=2 * 1024 * 1024)
    assert "3.0 MiB" in msg and "2.0 MiB" in msg


def test_file_growing_past_limit_after_stat(tmp_path, monkeypatch):
    # stat says small, the read finds more: still refused, never silently truncated.
    p = write(tmp_path, "grow.txt", b"b" * 50)
    real_stat = pathlib.Path.stat

    class SmallStat:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return 10 if name == "st_size" else getattr(self._st, name)

    monkeypatch.setattr(pathlib.Path, "stat", lambda self, *a, **k: SmallStat(real_stat(self, *a, **k)))
    msg = error_for(p, max_bytes=20)
    assert "limit" in msg.lower()


def test_invalid_max_bytes(tmp_path):
    p = write(tmp_path, "x.txt", b"x")
    with pytest.raises(ValueError):
        read_document(p, max_bytes=0)


def test_binary_nul_bytes(tmp_path):
    p = write(tmp_path, "data.txt", b"some text\x00\x01\x02 more")
    msg = error_for(p)
    assert str(p) in msg
    assert "binary" in msg.lower()
    assert "NUL" in msg


def test_binary_nul_after_first_8k(tmp_path):
    p = write(tmp_path, "late.txt", b"a" * 10000 + b"\x00" + b"b" * 100)
    assert "binary" in error_for(p).lower()


def test_binary_control_characters(tmp_path):
    p = write(tmp_path, "ctl.txt", bytes([1, 2, 3, 4, 5, 6, 0x0E, 0x0F]) * 200 + b"text" * 100)
    msg = error_for(p)
    assert "binary" in msg.lower()
    assert "control characters" in msg


def test_text_with_a_few_controls_and_ansi_is_fine(tmp_path):
    data = b"\x1b[31mred\x1b[0m line\n\tindented\fpage\n" * 50 + b"one bell \x07 here\n"
    p = write(tmp_path, "app.log", data)
    assert "red" in read_document(p).text


def test_gguf_file_as_text(tmp_path):
    header = b"GGUF" + struct.pack("<I", 3) + struct.pack("<Q", 291) + struct.pack("<Q", 24)
    p = write(tmp_path, "model.txt", header + os.urandom(2048))
    msg = error_for(p)
    assert "GGUF" in msg
    assert str(p) in msg


def test_zip_file_as_text(tmp_path):
    import zipfile

    p = tmp_path / "archive.txt"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("a.txt", "hello")
    msg = error_for(p)
    assert "ZIP" in msg


@pytest.mark.parametrize("suffix, fmt", [(".pdf", "PDF"), (".epub", "EPUB"), (".html", "HTML")])
def test_binary_with_converted_suffix_mentions_optional_readers(tmp_path, suffix, fmt):
    if suffix == ".pdf":
        data = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Length 5 >>\nstream\n\x00\x01\x02\x03\nendstream\n"
    else:
        data = b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + bytes(range(256)) * 4
    p = write(tmp_path, f"book{suffix}", data)
    msg = error_for(p)
    assert fmt in msg
    assert "optional readers" in msg
    assert str(p) in msg


def test_ascii_only_pdf_is_still_refused(tmp_path):
    p = write(tmp_path, "plain.pdf", b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog >>\nendobj\ntrailer\n%%EOF\n")
    msg = error_for(p)
    assert "PDF" in msg and "optional readers" in msg


def test_bomless_utf16_gets_a_hint(tmp_path):
    p = write(tmp_path, "u16le.txt", "hello world, this is text\n".encode("utf-16-le"))
    msg = error_for(p)
    assert "UTF-16" in msg
    assert "UTF-8" in msg


def test_undecodable_reports_offset(tmp_path):
    data = b"caf\xc3\xa9 ok\n" + b"x" * 20 + b"\xe9t\xe9 latin-1\n"  # \xe9 is latin-1, not UTF-8
    p = write(tmp_path, "latin1.txt", data)
    offset = data.index(b"\xe9t")
    msg = error_for(p)
    assert str(p) in msg
    assert "UTF-8" in msg
    assert f"offset {offset}" in msg
    assert "e9" in msg


def test_undecodable_offset_counts_the_bom(tmp_path):
    data = codecs.BOM_UTF8 + b"abc\xffdef"
    p = write(tmp_path, "bad.txt", data)
    msg = error_for(p)
    assert "offset 6" in msg  # the offset in the file, BOM included
    assert data[6] == 0xFF


def test_undecodable_large_offset_is_formatted(tmp_path):
    data = b"a" * 12345 + b"\xff"
    p = write(tmp_path, "bad.txt", data)
    assert "offset 12,345" in error_for(p)


def test_undecodable_utf16(tmp_path):
    # A lone high surrogate followed by a normal character is invalid UTF-16.
    data = codecs.BOM_UTF16_LE + "ok".encode("utf-16-le") + b"\x00\xd8" + "A".encode("utf-16-le")
    p = write(tmp_path, "bad16.txt", data)
    msg = error_for(p)
    assert "UTF-16" in msg
    assert "offset" in msg


def test_truncated_utf8_at_end(tmp_path):
    p = write(tmp_path, "trunc.txt", b"hello \xe2\x82")
    msg = error_for(p)
    assert "offset 6" in msg


# ------------------------------------------------------------------------------------------ sample


def test_sample_document_loads():
    doc = sample_document()
    assert isinstance(doc, Document)
    assert doc.sha256 == hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
    assert "\r" not in doc.text
    assert doc.text.startswith("# ")
    words = len(doc.text.split())
    assert 1500 <= words <= 2600, words
    assert doc.name == "sample.md"


def test_sample_document_contains_the_three_facts():
    text = sample_document().text
    assert "The keeper of the lighthouse is Maren Holt." in text
    assert "The light was first lit in 1887." in text
    assert "The town's annual festival is called the Lantern Regatta." in text


def test_sample_facts_are_not_at_the_top():
    text = sample_document().text
    n = len(text)
    for fact in ("Maren Holt", "1887", "Lantern Regatta"):
        assert text.index(fact) > n // 4, fact


def test_sample_document_is_stable():
    assert sample_document().sha256 == sample_document().sha256


def test_sample_is_readable_with_read_document():
    doc = sample_document()
    if doc.path is None:
        pytest.skip("sample not on the filesystem")
    assert read_document(doc.path).sha256 == doc.sha256


def test_utf8_bom_then_binary_is_refused(tmp_path):
    p = write(tmp_path, "bombin.txt", codecs.BOM_UTF8 + b"abc\x00\x00\x01def")
    assert "binary" in error_for(p).lower()


def test_small_sizes_are_not_repeated(tmp_path):
    p = write(tmp_path, "two.txt", b"ab")
    msg = error_for(p, max_bytes=1)
    assert "is 2 bytes" in msg and "limit is 1 bytes" in msg
    assert "(2 bytes)" not in msg


def test_missing_relative_path_mentions_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = error_for("nowhere.md")
    assert str(tmp_path / "nowhere.md") in msg
    assert "current directory" in msg and str(tmp_path) in msg


def test_utf16_with_bom_then_binary_is_refused(tmp_path):
    p = write(tmp_path, "u16bin.txt", codecs.BOM_UTF16_LE + bytes([1, 0, 2, 0, 3, 0, 4, 0]) * 100)
    msg = error_for(p)
    assert "UTF-16" in msg and "not text" in msg


def test_text_passed_as_a_path_gets_a_hint_not_an_echo():
    text = "Chapter 1\nIt was a dark and stormy night. " * 400
    with pytest.raises(DocumentError) as err:
        read_document(text)
    message = str(err.value)
    assert "looks like document text" in message and "Document.from_text" in message
    assert len(message) < 300  # the text itself is not echoed back
