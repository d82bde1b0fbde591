"""Render an SVG screenshot of the app for the README: the real default model reads a document,
answers a question, and the document map shows where the answer came from.

    python -m sekv_local.tui.screenshot docs/tui.svg
    python -m sekv_local.tui.screenshot OUT.svg --document FILE --question "..." --engine torch --method sekv --budget 0.25

Runs headless (no terminal needed); takes about as long as reading the document and one answer.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from sekv_local.engines.base import SamplingConfig
from sekv_local.session import SessionSettings

DEFAULT_QUESTION = "Who is the keeper of the lighthouse?"


async def _shoot(app, question: str, size: tuple[int, int], timeout: float, open_map: bool) -> str:
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.state in ("ready", "error", "cancelled"), timeout)
        if app.state != "ready":
            raise SystemExit(f"the app did not get ready: {app.state} {app.last_error or ''}")
        box = app._q("#question")
        box.focus()
        box.value = question
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.state == "ready" and bool(app.session.answers), timeout)
        if open_map:
            await pilot.press("f2")
        await pilot.pause(0.3)
        return app.export_screenshot(title="sekv-local chat")


async def wait_for(pilot, condition, timeout: float) -> None:
    """Let the app run until `condition()` holds (the workers report through the event loop)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout:.0f} s")
        await pilot.pause(0.05)


def main(argv: list[str] | None = None) -> None:
    from sekv_local.documents import sample_document
    from sekv_local.readers import read_any

    from .app import ChatApp

    parser = argparse.ArgumentParser(prog="python -m sekv_local.tui.screenshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="SVG file to write")
    parser.add_argument("--document", type=Path, help="document (default: the bundled sample)")
    parser.add_argument("--question", default=DEFAULT_QUESTION)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engine", default="auto", help="as `chat`'s --engine (default: the same as chat's)")
    parser.add_argument("--method", default="sekv")
    parser.add_argument("--budget", type=float, default=None, help="default: the method's own, as in chat")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--size", default="132x40", help="terminal COLUMNSxROWS")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    cols, rows = (int(x) for x in args.size.lower().split("x"))
    document = read_any(args.document) if args.document else sample_document()
    settings = SessionSettings(model=args.model, engine=args.engine, method=args.method,
                               budget=args.budget, threads=args.threads,
                               max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(temperature=0.0))
    with tempfile.TemporaryDirectory() as memory_dir:  # never offer/load a saved memory here
        app = ChatApp(document, settings, memory_dir=memory_dir)
        svg = asyncio.run(_shoot(app, args.question, (cols, rows), args.timeout, open_map=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg, encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
