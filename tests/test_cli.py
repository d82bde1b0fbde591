"""The `sekv-local` command as a user runs it: real subprocesses, real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHORT_DOC = ("Port Alder is a small fishing town on a windy coast. The lighthouse keeper of Port Alder is Maren Holt. "
             "The harbour has forty boats. The bakery on the square sells rye bread every morning.\n")


def run_cli(*args: str, stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "sekv_local", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture()
def short_doc(tmp_path: Path) -> Path:
    path = tmp_path / "port_alder.txt"
    path.write_text(SHORT_DOC)
    return path


def test_ask_json_answers_from_the_document(short_doc: Path, model_path) -> None:
    """The default path: SeKV in the llama.cpp engine (the install builds its native library)."""
    proc = run_cli("ask", str(short_doc), "Who is the lighthouse keeper of Port Alder?", "--json", "--threads", "2",
                   "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Maren" in out["answer"]
    assert out["document_tokens"] > 30 and out["answer_tokens"] >= 2
    assert out["engine"] == "llama.cpp" and out["method"] == "sekv" and out["method_options"] == {}
    assert out["memory"]["full_kv_bytes"] > 0 and out["memory"]["host_reads_steps"] >= 1
    assert not any(n.startswith("engine torch") for n in out["notices"])


def test_auto_engine_says_why_it_runs_the_torch_engine(short_doc: Path, tmp_path: Path, model_path) -> None:
    """A method the llama.cpp engine does not run, and a missing native library, fall back to the torch engine
    with one line that says why."""
    proc = run_cli("ask", str(short_doc), "Who is the lighthouse keeper of Port Alder?", "--method", "full",
                   "--threads", "2", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert "Maren" in proc.stdout
    assert "engine torch: method 'full' runs in the torch engine" in proc.stderr
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "SEKV_NATIVE_LIBRARY": str(tmp_path / "missing.so")}
    proc = subprocess.run([sys.executable, "-m", "sekv_local", "ask", str(short_doc), "Who is the lighthouse keeper?",
                           "--json", "--threads", "2", "--max-new-tokens", "24"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["engine"] == "torch" and out["method"] == "sekv" and "Maren" in out["answer"]
    assert any(n.startswith("engine torch: the llama.cpp engine's native library is not built") for n in out["notices"])


def test_ask_streams_plain_text_for_the_bundled_sample(model_path) -> None:
    sample = Path(__file__).parents[1] / "sekv_local" / "data" / "sample.md"
    proc = run_cli("ask", str(sample), "Who is the keeper of the lighthouse?", "--threads", "2",
                   "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert "Maren Holt" in proc.stdout
    assert "reading sample.md" in proc.stderr  # the ingestion progress bar


def test_chat_reads_questions_piped_on_stdin(short_doc: Path, model_path) -> None:
    questions = "Who is the lighthouse keeper of Port Alder?\n/reset\nHow many boats does the harbour have?\n"
    proc = run_cli("chat", str(short_doc), "--threads", "2", "--max-new-tokens", "24", stdin=questions)
    assert proc.returncode == 0, proc.stderr
    assert "Maren" in proc.stdout
    assert "forty" in proc.stdout.lower() or "40" in proc.stdout
    assert proc.stdout.count("> ") == 2  # each piped question is echoed before its answer
    assert "conversation cleared" in proc.stderr


@pytest.mark.parametrize("content, expected", [
    (None, "not found"),
    (b"", "empty"),
    (b"\x00\x01\x02GGUF\x00" * 100, "binary"),
    (b"caf\xe9 \xff\xfe broken", "utf-8"),
])
def test_bad_documents_give_clear_errors(tmp_path: Path, content: bytes | None, expected: str) -> None:
    path = tmp_path / "doc.txt"
    if content is not None:
        path.write_bytes(content)
    proc = run_cli("ask", str(path), "anything?", timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error:") and expected in proc.stderr.lower()


def test_too_long_document_says_how_long(tmp_path: Path, model_path) -> None:
    path = tmp_path / "long.txt"
    path.write_text("The grass is green. The sky is blue. " * 1200)
    proc = run_cli("ask", str(path), "What colour is the sky?", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "tokens" in proc.stderr and "8192" in proc.stderr
    assert "--method sekv@positions=bounded" in proc.stderr  # the one method that holds it on this model


def test_method_settings_on_the_command_line_are_checked(short_doc: Path) -> None:
    proc = run_cli("ask", str(short_doc), "q?", "--method", "sekv@positions", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "must look like METHOD@KEY=VALUE" in proc.stderr
    proc = run_cli("ask", str(short_doc), "q?", "--method", "sekv@positions=sideways", "--budget", "0.25",
                   timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "positions must be one of" in proc.stderr


def test_unknown_model_and_bad_budget_are_clear_errors(short_doc: Path) -> None:
    proc = run_cli("ask", str(short_doc), "q?", "--model", "no-such-model", timeout=120)
    assert proc.returncode == 2 and "unknown model 'no-such-model'" in proc.stderr
    proc = run_cli("ask", str(short_doc), "q?", "--budget", "lots", timeout=120)
    assert proc.returncode == 2 and "is not a budget" in proc.stderr and "Traceback" not in proc.stderr


def test_models_list_and_path(model_path) -> None:
    listed = run_cli("models", "list", timeout=120)
    assert listed.returncode == 0 and "smollm2-135m (default)\tpulled" in listed.stdout
    path = run_cli("models", "path", "smollm2-135m", timeout=120)
    assert path.returncode == 0 and Path(path.stdout.strip()) == Path(model_path)


def test_methods_lists_every_method_with_what_it_does() -> None:
    proc = run_cli("methods", timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(None, 1) for line in proc.stdout.strip().splitlines())
    for name in ("full", "sekv", "sekv+xkv", "xkv", "streaming", "h2o", "snapkv"):
        assert len(lines[name].strip()) > 20, name  # a description, not only the name
    assert lines["h2o"].startswith("Heavy-Hitter Oracle:")
