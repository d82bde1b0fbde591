"""The package layout: converters/ and tui/ import as sekv_local.converters / sekv_local.tui both in the
editable install used for development and in a normal (wheel) install."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_top_level_folders() -> None:
    for name, folder in (("sekv_local.converters", "converters"), ("sekv_local.tui", "tui")):
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().parent == ROOT / folder


def test_wheel_ships_them_inside_sekv_local(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("sekv_local-*.whl"))
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(target)
    for member in ("sekv_local/converters/__init__.py", "sekv_local/tui/__init__.py", "sekv_local/data/sample.md",
                   "sekv_local/cli.py"):
        assert member in names
    for package in (ROOT / "sekv_local").glob("*/__init__.py"):  # every subpackage ships (pyproject lists them)
        assert f"sekv_local/{package.parent.name}/__init__.py" in names, package.parent.name
    for params in (ROOT / "sekv_local" / "data").glob("*/*.safetensors"):  # trained parameters packaged for models
        assert f"sekv_local/data/{params.parent.name}/{params.name}" in names, params.name
    assert not any(n.startswith(("converters/", "tui/", "tests/")) for n in names)
    # import from the unpacked wheel only (cwd elsewhere, no source tree on the path)
    code = ("import sekv_local, sekv_local.converters, sekv_local.tui, sekv_local.data;"
            "print(sekv_local.__file__); print(sekv_local.tui.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=True)
    for line in proc.stdout.split():
        assert Path(line).is_relative_to(target)
