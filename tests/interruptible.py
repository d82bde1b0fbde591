"""Subprocesses that Ctrl-C tests can interrupt however the test run itself was started.

A shell starts a background job (`pytest ... &`, nohup, some CI runners) with SIGINT ignored, a child
inherits that through exec, and Python then installs no KeyboardInterrupt handler: a SIGINT sent by
the test would do nothing and the test would wait for a stop that never comes.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interruptible_popen(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen with SIGINT at its default disposition in the child, so that its Python turns a
    SIGINT into KeyboardInterrupt as it would in a terminal."""
    return subprocess.Popen(args, preexec_fn=_default_sigint, **kwargs)
