"""Saved memories: identical answers after reload; corrupt, tampered or mismatched files refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sekv_local.documents import Document
from sekv_local.persistence import FORMAT_VERSION, MemoryFileError, read_header
from sekv_local.session import Session, SessionSettings

DOC = Document.from_text(" ".join(
    f"Entry {i}: the harbour master logged {i * 7 % 23} boats and calm seas." for i in range(150))
    + " The lighthouse keeper of Port Alder is Maren Holt. "
    + " ".join(f"Entry {i}: rain fell for {i % 5} hours." for i in range(150, 260)))
QUESTION = "Who is the lighthouse keeper of Port Alder?"


@pytest.fixture(scope="module", params=["sekv", "full"])
def saved(request, tmp_path_factory, tokenizer, model_path):
    settings = SessionSettings(method=request.param, budget=0.3 if request.param == "sekv" else None, threads=2,
                               max_new_tokens=16)
    session = Session.create(DOC, settings, show_progress=False, tokenizer=tokenizer)
    session.ingest()
    before = session.answer(QUESTION, keep_history=False).text
    path = tmp_path_factory.mktemp("mem") / f"{request.param}.sekv"
    session.save(path)
    return path, before, settings


def test_reload_gives_identical_answers(saved, tokenizer) -> None:
    path, before, settings = saved
    reopened = Session.load(path, DOC, SessionSettings(threads=2, max_new_tokens=16), show_progress=False,
                            tokenizer=tokenizer)
    assert reopened.settings.method == settings.method and reopened.settings.budget == settings.budget
    assert reopened.engine.stats.prefill_tokens == 0  # nothing was recomputed
    assert reopened.answer(QUESTION, keep_history=False).text == before
    header = read_header(path)
    assert header["document"]["sha256"] == DOC.sha256 and header["format_version"] == FORMAT_VERSION


def _copy(path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / path.name
    shutil.copyfile(path, dst)
    return dst


def test_truncated_file_is_refused(saved, tmp_path, tokenizer) -> None:
    path = _copy(saved[0], tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(MemoryFileError, match="truncated or corrupt"):
        Session.load(path, DOC, show_progress=False, tokenizer=tokenizer)


def test_tampered_tensor_bytes_fail_the_checksum(saved, tmp_path, tokenizer) -> None:
    path = _copy(saved[0], tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(MemoryFileError, match="checksum"):
        Session.load(path, DOC, show_progress=False, tokenizer=tokenizer)


def test_not_a_memory_file_and_other_document_are_refused(saved, tmp_path, tokenizer) -> None:
    junk = tmp_path / "junk.sekv"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(MemoryFileError, match="not a sekv-local memory file"):
        Session.load(junk, DOC, show_progress=False, tokenizer=tokenizer)
    other = Document.from_text(DOC.text + " One more line.")
    with pytest.raises(MemoryFileError, match="different document"):
        Session.load(saved[0], other, show_progress=False, tokenizer=tokenizer)


def test_memory_for_another_model_file_is_refused(saved, tmp_path, model_path, tokenizer) -> None:
    other_model = tmp_path / "other.gguf"
    shutil.copyfile(model_path, other_model)
    with open(other_model, "r+b") as fh:  # flip one byte of tensor data: another model file
        fh.seek(-10, 2)
        byte = fh.read(1)
        fh.seek(-10, 2)
        fh.write(bytes([byte[0] ^ 1]))
    with pytest.raises(MemoryFileError, match="another model file"):
        Session.load(saved[0], DOC, SessionSettings(model=str(other_model)), show_progress=False, tokenizer=tokenizer)


def test_header_edits_are_caught(saved, tmp_path, tokenizer) -> None:
    """Changing the method in the JSON header (keeping the tensors) must not load silently."""
    path = _copy(saved[0], tmp_path)
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + size])
    inner = json.loads(header["__metadata__"]["sekv_local"])
    inner["method"] = "full" if inner["method"] == "sekv" else "sekv"
    header["__metadata__"]["sekv_local"] = json.dumps(inner)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + size:])
    with pytest.raises(MemoryFileError, match="checksum"):
        Session.load(path, DOC, show_progress=False, tokenizer=tokenizer)
