"""Ctrl-C on the real CLI (a subprocess and a real SIGINT): during ingestion it stops with a message
and no traceback (and no saved memory is left half-written); during an answer in the chat REPL it
stops that answer and the session goes on to answer the next question."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from interruptible import interruptible_popen

from sekv_local.eval.tasks import natural_text

CLI = [sys.executable, "-m", "sekv_local.cli"]


def _read_until(proc: subprocess.Popen, stream, marker: str, timeout: float = 300) -> str:
    """Read the pipe `stream` until `marker` shows up; returns what was read (the rest stays in the pipe)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while marker.encode() not in seen:
        assert proc.poll() is None, f"process ended early: {seen[-2000:]!r}"
        assert time.monotonic() < deadline, f"'{marker}' did not appear: {seen[-2000:]!r}"
        ready, _, _ = select.select([stream], [], [], 0.2)
        if ready:
            seen += os.read(stream.fileno(), 65536)
    return seen.decode(errors="replace")


@pytest.mark.slow
def test_ctrl_c_during_ingestion_stops_cleanly(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text(natural_text(30_000))  # ~6K tokens: ingestion takes seconds
    memory = tmp_path / "book.sekv"
    proc = interruptible_popen(CLI + ["ask", str(book), "What is a frame?", "--threads", "1", "--chunk-size", "256",
                                      "--memory", str(memory)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _read_until(proc, proc.stderr, "reading book.txt")
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode(errors="replace")
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    assert not memory.exists() and not list(tmp_path.glob(".book.sekv.*"))


@pytest.mark.slow
def test_ctrl_c_during_an_answer_stops_it_and_the_chat_goes_on(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text("The keeper of the lighthouse at Port Alder is Maren Holt. She lights the lamp at dusk.\n")
    proc = interruptible_popen(CLI + ["chat", str(book), "--no-tui", "--threads", "1", "--max-new-tokens", "300",
                                      "--temperature", "1.0"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"Write a very long story about the lighthouse, chapter after chapter.\n")
    proc.stdin.flush()
    _read_until(proc, proc.stdout, "> Write a very long story")
    time.sleep(3.0)  # some tokens of the long answer
    proc.send_signal(signal.SIGINT)
    _read_until(proc, proc.stdout, "[stopped]")
    proc.stdin.write(b"Who is the keeper of the lighthouse?\n/quit\n")
    proc.stdin.flush()
    out, err = (part.decode(errors="replace") for part in proc.communicate(timeout=300))
    assert proc.returncode == 0, err[-2000:]
    assert "> Who is the keeper of the lighthouse?" in out
    answer = out.split("> Who is the keeper of the lighthouse?")[1]
    assert answer.strip(), "no answer after the interrupted one"
    assert "Traceback" not in err
