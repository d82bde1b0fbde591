"""Widgets of the chat screen: input with history, chat messages, memory bars, the document map."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Input, Static

from . import docmap
from .memories import format_bytes


class HistoryInput(Input):
    """An Input that remembers what was submitted: up/down walk through it."""

    BINDINGS = [
        Binding("up", "history(-1)", "Previous", show=False),
        Binding("down", "history(1)", "Next", show=False),
    ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history: list[str] = []
        self._pos = 0
        self._draft = ""

    def remember(self, text: str) -> None:
        if text and (not self.history or self.history[-1] != text):
            self.history.append(text)
        self._pos = len(self.history)
        self._draft = ""

    def action_history(self, step: int) -> None:
        if not self.history:
            return
        if self._pos == len(self.history):
            self._draft = self.value
        self._pos = min(max(self._pos + step, 0), len(self.history))
        self.value = self._draft if self._pos == len(self.history) else self.history[self._pos]
        self.cursor_position = len(self.value)


class ChatMessage(Static):
    """One entry of the conversation: a question, an answer (streamed) or a note from the app."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__(classes=kind)
        self.kind = kind
        self.body = text
        self.stopped = False
        self.update(self._render_text())

    def _render_text(self) -> Text:
        if self.kind == "system":
            return Text(self.body, style="dim")
        label = {"question": "You  ", "answer": "Model"}[self.kind]
        style = {"question": "bold cyan", "answer": "bold green"}[self.kind]
        out = Text.assemble((label, style), " ", self.body or "…")
        if self.stopped:
            out.append(" [stopped]", style="italic yellow")
        return out

    def append(self, piece: str) -> None:
        self.body += piece
        self.update(self._render_text())

    def finish(self, text: str | None = None, stopped: bool = False) -> None:
        if text is not None:
            self.body = text
        self.stopped = stopped
        self.update(self._render_text())


def bar(fraction: float, width: int) -> Text:
    width = max(width, 1)
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    blocks = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part and full < width else "")
    return Text(blocks.ljust(width), style="on grey23")


class MemoryBars(Static):
    """Device tier, host tier and full-KV bytes, each as a bar scaled to the largest."""

    def show(self, memory: dict[str, Any] | None) -> None:
        self._memory = memory
        self.refresh_bars()

    def on_resize(self, _event: events.Resize) -> None:
        self.refresh_bars()

    def refresh_bars(self) -> None:
        memory = getattr(self, "_memory", None)
        if not memory:
            self.update(Text("memory: not measured yet", style="dim"))
            return
        device, host = memory.get("device_bytes", 0), memory.get("host_bytes", 0)
        # the copies that let each question start again from the document (a ring buffer cannot truncate)
        kept = memory.get("checkpoint_bytes", 0)
        # on a CPU both tiers are the same RAM: their sum is what the process holds; full KV as it is held
        # (a model's sliding-window layers keep only their window)
        rows = [("device", device, "green"), ("host", host, "cyan")] + ([("kept", kept, "blue")] if kept else []) \
            + [("total", device + host + kept, "yellow"),
               ("full KV", memory.get("full_kv_held_bytes") or memory.get("full_kv_bytes", 0), "magenta")]
        top = max(max(v for _, v, _ in rows), 1)
        width = max(self.size.width - 19, 4) if self.size.width else 12
        out = Text()
        for i, (name, value, colour) in enumerate(rows):
            b = bar(value / top, width)
            b.stylize(colour)
            out.append(f"{name:<8}")
            out.append_text(b)
            out.append(f" {format_bytes(value):>9}")
            if i < len(rows) - 1:
                out.append("\n")
        self.update(out)


class DocumentMap(Widget, can_focus=True):
    """A strip over the whole document: denser/darker cells = more zoom hits in the last answer.

    Left/right (or a click) moves the cursor over the cells; the app shows the passage under it.
    """

    DEFAULT_CSS = """
    DocumentMap { height: 3; }
    """
    BINDINGS = [
        Binding("left", "move(-1)", "Left", show=False),
        Binding("right", "move(1)", "Right", show=False),
        Binding("home", "jump(0)", "Start", show=False),
        Binding("end", "jump(-1)", "End", show=False),
        Binding("enter", "select", "Show passage", show=False),
    ]

    cursor: reactive[int | None] = reactive(None)

    class Selected(Message):
        """A cell was chosen: document tokens [start, end) and the zoomed spans in it."""

        def __init__(self, index: int, start: int, end: int, spans: list[dict[str, Any]]) -> None:
            super().__init__()
            self.index = index
            self.start = start
            self.end = end
            self.spans = spans

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.doc_tokens = 0
        self.zoomed: list[dict[str, Any]] = []

    @property
    def n_bins(self) -> int:
        return max(self.content_size.width, 1)

    def set_data(self, doc_tokens: int, zoomed: list[dict[str, Any]] | None) -> None:
        self.doc_tokens = doc_tokens
        self.zoomed = list(zoomed or [])
        self.refresh()

    def values(self) -> list[float]:
        return docmap.bin_hits(self.zoomed, self.doc_tokens, self.n_bins)

    def render(self) -> Text:
        n = self.n_bins
        lv = docmap.levels(self.values())
        colours = ["grey35", "grey62", "yellow", "dark_orange", "red"]
        strip = Text()
        for i, level in enumerate(lv):
            style = colours[level]
            if self.cursor == i and self.has_focus:
                style += " reverse"
            strip.append(docmap.SHADES[level], style=style)
        marker = Text(" " * n)
        if self.cursor is not None and 0 <= self.cursor < n:
            marker = Text(" " * self.cursor + "▲", style="bold")
        return Text("\n").join([strip, strip.copy(), marker])

    def on_focus(self) -> None:
        if self.cursor is None:
            hot = docmap.hottest_bin(self.values())
            self.cursor = hot if hot is not None else 0
            self.action_select()
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def on_resize(self, _event: events.Resize) -> None:
        if self.cursor is not None:
            self.cursor = min(self.cursor, self.n_bins - 1)

    def on_click(self, event: events.Click) -> None:
        self.focus()
        self.cursor = min(max(event.x - self.gutter.left, 0), self.n_bins - 1)
        self.action_select()

    def action_move(self, step: int) -> None:
        self.cursor = min(max((self.cursor or 0) + step, 0), self.n_bins - 1)
        self.action_select()

    def action_jump(self, where: int) -> None:
        self.cursor = 0 if where == 0 else self.n_bins - 1
        self.action_select()

    def action_select(self) -> None:
        if self.cursor is None or self.doc_tokens <= 0:
            return
        start, end = docmap.bin_span(self.cursor, self.doc_tokens, self.n_bins)
        self.post_message(self.Selected(self.cursor, start, end, docmap.spans_in(self.zoomed, start, end)))
