"""Saving a memory is atomic: a writer killed (SIGKILL) at random moments while it saves, again and
again, always leaves a file that loads and passes its checksum — the previous version or the new
one, never a mix."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sekv_local.persistence import load_memory, save_memory

#: kills that must land inside a save (a temporary file left behind), and the most kills tried to get there
MID_SAVE_KILLS = 10
MAX_KILLS = 300
WRITER = """
import sys, torch
from sekv_local.persistence import save_memory
path, first = sys.argv[1], int(sys.argv[2])
print("started", flush=True)
for version in range(first, first + 10**6):
    # 8 MiB per save: long enough that most kills land inside safetensors' write or the fsync
    save_memory(path, {"x": torch.full((1 << 21,), float(version))}, {"version": version})
"""


def _check(path: Path) -> int:
    tensors, header = load_memory(path)
    version = int(header["version"])
    assert torch.all(tensors["x"] == float(version)), "tensor data from one save, header from another"
    return version


@pytest.mark.slow
def test_a_writer_killed_mid_save_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    path = tmp_path / "book.sekv"
    save_memory(path, {"x": torch.full((1 << 21,), 0.0)}, {"version": 0})
    rng = random.Random(7)
    version, advanced, mid_save = 0, 0, 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    kills = 0
    while mid_save < MID_SAVE_KILLS and kills < MAX_KILLS:  # how often a kill lands mid-save depends on disk speed
        kills += 1
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(version + 1)], stdout=subprocess.PIPE,
                                  text=True, env=env)
        assert writer.stdout is not None and writer.stdout.readline().strip() == "started"
        time.sleep(rng.uniform(0.0, 0.4))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        mid_save += any(tmp_path.glob(".book.sekv.*.tmp"))  # the kill hit a save in progress
        now = _check(path)
        assert now >= version  # never an older file than the last complete one
        advanced += now > version
        version = now
    assert advanced > 0  # the writer did complete saves between kills, so kills hit a live writer
    assert mid_save >= MID_SAVE_KILLS  # and many kills landed inside a save, which is what is being tested
    save_memory(path, {"x": torch.full((4,), 1.0)}, {"version": -1})
    assert not list(tmp_path.glob(".book.sekv.*.tmp"))  # the next save clears what dead writers left
