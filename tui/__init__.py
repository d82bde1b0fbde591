"""The Textual terminal app (importable as `sekv_local.tui`): `sekv-local chat FILE` in a terminal.

`ChatApp(document, settings)` reads the document once (or loads a saved memory of it), then chats
about it; `run_app(...)` runs it. `python -m sekv_local.tui.screenshot OUT.svg` renders the README
screenshot.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # import Textual only when the app is used
    if name in ("ChatApp", "run_app", "COMMANDS"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)


__all__ = ["ChatApp", "run_app", "COMMANDS"]
