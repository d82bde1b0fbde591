"""Screens shown over the chat: reading the document, the offer of a saved memory, the help."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, ProgressBar, Static

from .memories import SavedMemory, format_budget

if TYPE_CHECKING:
    from .app import ChatApp


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(done: int, total: int, elapsed: float) -> str:
    """'1,024 / 4,096 tokens · 310 tok/s · ETA 0:10' (rate and ETA once something was read)."""
    parts = [f"{done:,} / {total:,} tokens"]
    if done > 0 and elapsed > 0:
        rate = done / elapsed
        parts.append(f"{rate:,.0f} tok/s")
        parts.append(f"ETA {format_duration((total - done) / rate)}" if done < total else "done")
    return " · ".join(parts)


class IngestScreen(Screen):
    """Reading the document (or loading a saved memory): a progress bar, tokens/s and ETA."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("r", "retry", "Read again"),
        Binding("b", "back", "Back to chat"),
        Binding("q", "quit", "Quit"),
    ]

    DEFAULT_CSS = """
    IngestScreen { align: center middle; }
    #ingest-header { dock: top; width: 100%; height: 1; background: $panel; content-align: center middle; }
    #ingest-box { width: 76; height: auto; border: round $accent; padding: 1 2; }
    #ingest-title { text-style: bold; margin-bottom: 1; }
    #ingest-bar { margin: 1 0; }
    #ingest-bar Bar { width: 1fr; }
    #ingest-stats { height: 1; }
    #ingest-note { color: $text-muted; margin-top: 1; }
    """

    def __init__(self, title: str, what: str) -> None:
        super().__init__()
        self.title_text = title
        self.what = what
        self.state = "working"  # working | cancelling | cancelled | error

    @property
    def chat_app(self) -> "ChatApp":
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        # not textual's Header: its title watchers outlive a popped screen and raise NoMatches when
        # the app retitles itself right after reading (a race seen under load)
        sub = f" — {self.app.sub_title}" if self.app.sub_title else ""
        yield Static(f"{self.app.title}{sub}", id="ingest-header")
        with Vertical(id="ingest-box"):
            yield Static(self.title_text, id="ingest-title")
            yield Static(self.what, id="ingest-what")
            yield ProgressBar(total=None, show_eta=False, id="ingest-bar")
            yield Static("", id="ingest-stats")
            yield Static("Esc cancels.", id="ingest-note")
        yield Footer()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel":
            return self.state == "working"
        if action == "retry":
            return self.state in ("cancelled", "error")
        if action == "back":
            return self.state in ("cancelled", "error") and self.chat_app.session is not None
        return True

    def _set_state(self, state: str) -> None:
        self.state = state
        self.refresh_bindings()

    def set_stage(self, text: str) -> None:
        self.query_one("#ingest-stats", Static).update(text)

    def set_progress(self, done: int, total: int, elapsed: float) -> None:
        bar = self.query_one("#ingest-bar", ProgressBar)
        bar.update(total=total, progress=done)
        self.query_one("#ingest-stats", Static).update(progress_line(done, total, elapsed))

    def set_cancelling(self) -> None:
        self._set_state("cancelling")
        self.query_one("#ingest-note", Static).update("Cancelling after the current chunk…")

    def set_cancelled(self) -> None:
        self._set_state("cancelled")
        self.query_one("#ingest-bar", ProgressBar).display = False
        self.query_one("#ingest-stats", Static).update("Reading cancelled.")
        back = " · b: back to the chat" if self.chat_app.session is not None else ""
        self.query_one("#ingest-note", Static).update(f"r: read again{back} · q: quit")

    def set_error(self, message: str, retry: str = "r: try again") -> None:
        self._set_state("error")
        self.query_one("#ingest-bar", ProgressBar).display = False
        self.query_one("#ingest-stats", Static).update(Text(message, style="bold red"))
        self.query_one("#ingest-stats", Static).styles.height = "auto"
        back = " · b: back to the chat" if self.chat_app.session is not None else ""
        self.query_one("#ingest-note", Static).update(f"{retry}{back} · q: quit")

    def action_cancel(self) -> None:
        self.chat_app.cancel_ingest()

    def action_retry(self) -> None:
        self.chat_app.retry_open()

    def action_back(self) -> None:
        self.chat_app.back_to_chat()

    async def action_quit(self) -> None:
        await self.chat_app.action_quit()


class OfferScreen(ModalScreen[str]):
    """A saved memory of this document and model exists: load it (instant) or read the document again.
    Dismisses with "load", "read" or "quit"."""

    BINDINGS = [
        Binding("l,enter", "choose('load')", "Load saved memory"),
        Binding("r", "choose('read')", "Read again"),
        Binding("q", "choose('quit')", "Quit"),
        Binding("escape", "choose('read')", "Read again", show=False),
    ]

    DEFAULT_CSS = """
    OfferScreen { align: center middle; }
    #offer-box { width: 76; height: auto; border: round $accent; padding: 1 2; background: $surface; }
    #offer-title { text-style: bold; margin-bottom: 1; }
    #offer-buttons { height: auto; margin-top: 1; align-horizontal: center; }
    #offer-buttons Button { margin-right: 2; }
    """

    def __init__(self, document_name: str, memory: SavedMemory, n_other: int) -> None:
        super().__init__()
        self.document_name = document_name
        self.memory = memory
        self.n_other = n_other

    def compose(self) -> ComposeResult:
        m = self.memory
        budget = "" if m.budget is None else f", budget {format_budget(m.budget)}"
        more = f"\n({self.n_other} other saved memories of it: /load PATH)" if self.n_other else ""
        with Vertical(id="offer-box"):
            yield Static(f"A saved memory of {self.document_name} exists", id="offer-title")
            yield Static(f"{m.path.name}\nmethod {m.method}{budget}, engine {m.engine}, {m.size / 2**20:.1f} MiB"
                         f"{more}\n\nLoad it now (instant), or read the document again?", id="offer-text")
            with Horizontal(id="offer-buttons"):
                yield Button("Load saved memory (l)", id="offer-load", variant="primary")
                yield Button("Read again (r)", id="offer-read")
        yield Footer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss("load" if event.button.id == "offer-load" else "read")

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice)


KEYS = [
    ("Enter", "ask the question (or run the /command)"),
    ("Up / Down", "previous / next input (history)"),
    ("Esc", "stop the answer being generated; cancel reading; close this help"),
    ("Ctrl+Y", "copy the last answer to the clipboard"),
    ("F2", "open the document map (then Left/Right, Home/End or a click selects a region)"),
    ("Tab", "move between the question and the map"),
    ("Ctrl+L", "clear the conversation"),
    ("F1", "this help"),
    ("Ctrl+Q", "quit"),
]


class HelpScreen(ModalScreen[None]):
    """Keys and commands."""

    BINDINGS = [Binding("escape,q,f1", "close", "Close")]

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help-box { width: 90; max-height: 90%; height: auto; border: round $accent; padding: 1 2; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        from .app import COMMANDS

        from rich.console import Group
        from rich.table import Table

        def table(rows: list[tuple[str, str]]) -> Table:
            t = Table(box=None, show_header=False, padding=(0, 2, 0, 2), expand=True)
            t.add_column(style="bold cyan", no_wrap=True)
            t.add_column(ratio=1)
            for key, what in rows:
                t.add_row(key, what)
            return t

        text = Group(
            Text("Keys", style="bold underline"), table(KEYS), Text(""),
            Text("Commands", style="bold underline"),
            table([(f"{name} {arg}".strip(), what) for name, (arg, what) in COMMANDS.items()]), Text(""),
            Text("The side panel shows the memory of the document (device tier, host tier and the full-KV "
                 "baseline) and the document map: darker cells are where the last answer zoomed in "
                 "(method sekv; light grey: only a trace of its reads); select one to read that passage.", style="dim"))
        with VerticalScroll(id="help-box"):
            yield Static(text, id="help-text")
        yield Footer()

    def action_close(self) -> None:
        self.dismiss(None)


