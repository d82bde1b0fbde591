"""`sekv-local chat FILE` in a real terminal (tmux): the app starts, answers a typed question on
screen, and quits cleanly with Ctrl+Q (exit status 0, terminal restored)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

STORY = (
    "Port Alder is a small fishing town on a rocky northern coast. Its harbour shelters a dozen boats.\n\n"
    "The lighthouse keeper of Port Alder is Maren Holt. She climbs the tower every evening at dusk.\n\n"
    "The baker, Tomas Reed, opens his shop at five in the morning.\n"
)


class Tmux:
    """One private tmux server (its own socket) with one window running `command`."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str], size: tuple[int, int] = (120, 36)) -> None:
        self.socket = f"sekv-test-{uuid.uuid4().hex[:8]}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # keep the window after the app exits so its exit status and the restored screen can be read
        # (-u COLUMNS/LINES: test runners export 80x24 there, and the app would believe them over the tty)
        script = (f"cd {shlex.quote(str(cwd))} && env -u COLUMNS -u LINES {exports} {command}; "
                  f"echo \"EXIT STATUS $?\"; sleep 600")
        self.tmux("new-session", "-d", "-s", "main", "-x", str(size[0]), "-y", str(size[1]), "bash", "-c", script)

    def tmux(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "main")

    def send(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "main", *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "main", "-l", text)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if text in screen:
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} did not appear within {timeout:.0f} s; the screen shows:\n{screen}")
            time.sleep(0.25)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def test_chat_app_in_a_real_terminal(tmp_path, model_path):
    doc = tmp_path / "story.txt"
    doc.write_text(STORY)
    command = (f"{shlex.quote(sys.executable)} -m sekv_local chat story.txt --model {shlex.quote(str(model_path))} "
               f"--threads 2 --max-new-tokens 16")
    env = {
        "SEKV_LOCAL_CACHE": str(tmp_path / "cache"),  # saved memories go here (the model is given by path)
        "SEKV_LOCAL_CONFIG": str(tmp_path / "no-config.toml"),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }
    term = Tmux(command, tmp_path, env)
    try:
        started = time.monotonic()
        term.wait_for("Ask about story.txt", timeout=300)
        ready_s = time.monotonic() - started
        term.type("Who is the lighthouse keeper of Port Alder?")
        term.send("Enter")
        screen = term.wait_for("Maren", timeout=180)
        assert "Who is the lighthouse keeper of Port Alder?" in screen
        # the answer, and the side panel with the default engine and memory tiers
        assert "Model" in screen and "engine  llama.cpp · sekv" in screen and "device" in screen
        term.send("F1")
        term.wait_for("/budget", timeout=30)
        term.send("Escape")
        term.send("C-q")
        screen = term.wait_for("EXIT STATUS", timeout=60)
        assert "EXIT STATUS 0" in screen, screen
        # the app left the alternate screen: its panels are gone from the terminal
        assert "engine  llama.cpp" not in screen and "Document map" not in screen, screen
        print(f"ready after {ready_s:.1f} s")
    finally:
        term.close()
