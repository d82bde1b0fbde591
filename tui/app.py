"""`sekv-local chat FILE` as a Textual app: read the document once, then chat about it.

Model calls are CPU-heavy and blocking, so reading the document, loading a saved memory and
generating an answer run in worker threads; they talk to the UI only through `call_from_thread`.
Reading is cancelled from its progress callback; an answer is stopped by closing its generator.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, Static

from sekv_local.documents import Document
from sekv_local.errors import SekvError
from sekv_local.session import Session, SessionSettings

from . import memories
from .memories import format_budget, format_bytes
from .screens import HelpScreen, IngestScreen, OfferScreen, format_duration
from .widgets import ChatMessage, DocumentMap, HistoryInput, MemoryBars

COMMANDS: dict[str, tuple[str, str]] = {
    "/save": ("[PATH]", "save the document's memory (default: the memories folder, offered at the next start)"),
    "/load": ("[PATH]", "load a saved memory of this document (default: the one for these settings, else the newest)"),
    "/budget": ("[VALUE]", "show the device budget, or set it (0.25, 25%, 64MiB) and read the document again"),
    "/method": ("[NAME]", "show the KV cache method, or switch (full, sekv, ...) and read the document again"),
    "/stats": ("", "memory, timings and zoom statistics of the last answer"),
    "/clear": ("", "forget the conversation (the document stays loaded)"),
    "/copy": ("", "copy the last answer to the clipboard"),
    "/map": ("", "open the document map"),
    "/help": ("", "keys and commands"),
    "/quit": ("", "leave (also /exit and Ctrl+Q)"),
}


#: tokens shown at least when a map cell without zoom is selected
PASSAGE_TOKENS = 64


class IngestCancelled(Exception):
    """Raised from the progress callback to abort reading the document."""


def read_document_any(path: str | Path) -> Document:
    """Text files, and HTML/PDF/EPUB through the optional readers."""
    from sekv_local.readers import read_any

    return read_any(path)


def parse_budget(value: str) -> float | int:
    """The CLI's budget syntax: 0.25, 25%, 64MiB, 123456 (bytes)."""
    import click

    from sekv_local.cli import _parse_budget

    try:
        parsed = _parse_budget(None, None, value)  # type: ignore[arg-type]
    except click.BadParameter as exc:
        raise SekvError(exc.message) from None
    assert parsed is not None
    return parsed


class ChatApp(App[None]):
    """Chat with one document. `settings` as for `Session.create`; `memory_file` as `--memory`
    (loaded when it exists, written after reading otherwise); saved memories live in `memory_dir`."""

    TITLE = "sekv-local"
    CSS = """
    #main { height: 1fr; }
    #chat-pane { width: 1fr; }
    #conversation { height: 1fr; padding: 0 1; }
    #conversation ChatMessage { margin-bottom: 1; }
    #conversation ChatMessage.system { color: $text-muted; }
    #question { dock: bottom; }
    #side { width: 44; border-left: solid $primary-darken-2; padding: 0 1; }
    .side-title { text-style: bold; color: $accent; margin-top: 1; }
    #doc-info { height: auto; }
    #memory { height: 4; }
    #docmap { margin-top: 0; }
    #docmap:focus { background: $boost; }
    #passage-box { height: 1fr; border: round $primary-darken-2; }
    #passage { color: $text; }
    """
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("f2", "open_map", "Map"),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+y", "copy_answer", "Copy answer"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, document: Document | str | Path, settings: SessionSettings = SessionSettings(), *,
                 memory_file: str | Path | None = None, memory_dir: str | Path | None = None,
                 tokenizer: Any = None, offer_saved: bool = True) -> None:
        super().__init__()
        self.document = document if isinstance(document, Document) else read_document_any(document)
        self.settings = settings
        self.memory_file = Path(memory_file) if memory_file is not None else None
        self.memory_dir = Path(memory_dir) if memory_dir is not None else memories.default_dir()
        self.tokenizer = tokenizer
        self.offer_saved = offer_saved
        self.session: Session | None = None
        #: starting | offer | reading | ready | generating | busy | cancelled | error | quitting
        self.state = "starting"
        self.last_error: str | None = None
        self._cancel = threading.Event()
        self._stop = threading.Event()
        self._pending: tuple[SessionSettings, Path | None, Path | None] | None = None
        self._answer_widget: ChatMessage | None = None
        self._initial: dict[str, Any] = {"memory": None, "observations": {}}
        self.sub_title = self.document.name

    # -- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-pane"):
                yield VerticalScroll(id="conversation")
                yield HistoryInput(placeholder=f"Ask about {self.document.name}…  (/help for commands)",
                                   id="question")
            with Vertical(id="side"):
                yield Static("Document", classes="side-title")
                yield Static("", id="doc-info")
                yield Static("Memory", classes="side-title")
                yield MemoryBars(id="memory")
                yield Static("", id="spans-info")
                yield Static("Document map (F2)", classes="side-title")
                yield DocumentMap(id="docmap")
                with VerticalScroll(id="passage-box"):
                    yield Static("", id="passage")
        yield Footer()

    def on_mount(self) -> None:
        self._main = self.screen
        self._q("#conversation", VerticalScroll).anchor()
        self._refresh_panel()
        self._start()

    # -- opening a session -------------------------------------------------------------------------
    def _start(self) -> None:
        """First open: --memory when it exists, else the offer of a saved memory, else read."""
        if self.memory_file is not None:
            if self.memory_file.exists():
                self._open(self.settings, load=self.memory_file)
            else:
                self._open(self.settings, save=self.memory_file)
            return
        saved = self._saved_memories() if self.offer_saved else []
        if not saved:
            self._open(self.settings)
            return
        exact = self._memory_path(self.settings)
        best = next((m for m in saved if m.path == exact), saved[0])
        self.state = "offer"

        def chosen(choice: str | None) -> None:
            if choice == "load":
                self._open(self.settings, load=best.path)
            elif choice == "quit":
                self.exit()
            else:
                self._open(self.settings)

        self.push_screen(OfferScreen(self.document.name, best, len(saved) - 1), chosen)

    def _saved_memories(self) -> list[memories.SavedMemory]:
        try:
            return memories.find_memories(self.memory_dir, self.document.sha256, self.settings.model)
        except SekvError:
            return []

    def _memory_path(self, settings: SessionSettings) -> Path:
        return memories.memory_path(self.memory_dir, self.document.sha256, settings.model, settings.engine,
                                    settings.method, settings.budget)

    def _describe(self, settings: SessionSettings) -> str:
        budget = f", budget {format_budget(settings.budget)}" if settings.budget is not None else ""
        return (f"{self.document.name} · model {memories.model_slug(settings.model)} · engine {settings.engine} · "
                f"method {settings.method}{budget}")

    def _open(self, settings: SessionSettings, load: Path | None = None, save: Path | None = None) -> None:
        """Show the reading screen and build a session in a worker thread (load a memory or read)."""
        self._pending = (settings, load, save)
        self._cancel.clear()
        self.state = "reading"
        title = f"Loading saved memory {load.name}" if load else f"Reading {self.document.name}"
        screen = IngestScreen(title, self._describe(settings))
        if isinstance(self.screen, IngestScreen):
            self.switch_screen(screen)
        else:
            self.push_screen(screen)
        self._open_worker(settings, load, save, screen)

    @work(thread=True, exclusive=True, group="open", exit_on_error=False)
    def _open_worker(self, settings: SessionSettings, load: Path | None, save: Path | None,
                     screen: IngestScreen) -> None:
        try:
            self._ui(screen.set_stage, f"loading model {memories.model_slug(settings.model)}…")
            if load is not None:
                session = Session.load(load, self.document, settings, show_progress=False, tokenizer=self.tokenizer)
                if self._cancel.is_set():
                    raise IngestCancelled
                how = f"Loaded saved memory {load.name} ({session.document_tokens:,} tokens)."
            else:
                session = Session.create(self.document, settings, show_progress=False, tokenizer=self.tokenizer)
                if self._cancel.is_set():
                    raise IngestCancelled
                self._ui(screen.set_stage, "tokenizing the document…")
                start = time.monotonic()

                def progress(done: int, total: int) -> None:
                    if self._cancel.is_set():
                        raise IngestCancelled
                    self._ui(screen.set_progress, done, total, time.monotonic() - start)

                session.ingest(progress=progress)
                how = f"Read {self.document.name} ({session.document_tokens:,} tokens)."
                if save is not None:
                    self._ui(screen.set_stage, f"saving memory to {save.name}…")
                    session.save(save)
                    how += f" Saved its memory to {save}."
            if session.engine.notices:  # e.g. which SeKV router runs
                how += " " + " ".join(session.engine.notices) + "."
            session.passage(0, 0)  # tokenize the document once: the map's passages are then instant
            # measured here, off the UI thread: the panel's figures before the first answer
            observations = session.engine.observations()
            initial = {"memory": session.engine.memory().as_dict(),
                       "observations": {"spans": observations["spans"]} if "spans" in observations else {}}
            self._ui(self._session_ready, session, how, initial)
        except IngestCancelled:
            self._ui(self._open_cancelled, screen)
        except SekvError as exc:
            self._ui(self._open_failed, screen, str(exc))
        except Exception as exc:  # keep the app alive and say what happened
            self._ui(self._open_failed, screen, f"{exc.__class__.__name__}: {exc}")

    def _session_ready(self, session: Session, how: str, initial: dict[str, Any]) -> None:
        first = self.session is None
        self.session = session
        self._initial = initial
        self.settings = session.settings
        if self.tokenizer is None:
            self.tokenizer = session.tokenizer
        self.state = "ready"
        while isinstance(self.screen, IngestScreen):
            self.pop_screen()
        if not first:
            self._q("#conversation", VerticalScroll).remove_children()
        self._note(f"{how} Method {self.settings.method}"
                   + (f", budget {format_budget(self.settings.budget)}" if self.settings.budget is not None else "")
                   + ". Ask a question; F1 for help.")
        self._refresh_panel()
        self._q("#question", Input).focus()

    def _open_cancelled(self, screen: IngestScreen) -> None:
        self.state = "cancelled"
        if screen.is_attached:
            screen.set_cancelled()

    def _open_failed(self, screen: IngestScreen, message: str) -> None:
        self.state = "error"
        self.last_error = message
        retry = "r: try again"
        if self._pending is not None and self._pending[1] is not None:  # a saved memory that cannot be used
            self._pending = (self._pending[0], None, None)
            retry = "r: read the document instead"
        if screen.is_attached:
            screen.set_error(message, retry)

    def cancel_ingest(self) -> None:
        if self.state == "reading":
            self._cancel.set()
            if isinstance(self.screen, IngestScreen):
                self.screen.set_cancelling()

    def retry_open(self) -> None:
        if self._pending is not None:
            self._open(*self._pending)

    def back_to_chat(self) -> None:
        if self.session is not None:
            self.state = "ready"
            while isinstance(self.screen, IngestScreen):
                self.pop_screen()
            self._note("Kept the document as it was loaded before.")
            self._q("#question", Input).focus()

    # -- helpers ---------------------------------------------------------------------------------------
    def _q(self, selector: str, expect_type: type[Any] | None = None) -> Any:
        """query_one on the chat screen, whatever screen is on top."""
        screen = getattr(self, "_main", None) or self.screen
        return screen.query_one(selector, expect_type) if expect_type else screen.query_one(selector)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.screen is getattr(self, "_main", None)
        if action in ("open_map", "copy_answer", "clear"):
            return self.screen is getattr(self, "_main", None) and self.session is not None
        return True

    def _ui(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn` on the UI thread (ignored once the app is shutting down)."""
        if self.state == "quitting":
            return
        try:
            self.call_from_thread(fn, *args)
        except Exception:  # the app is gone or going: nothing left to update
            pass

    # -- chat ----------------------------------------------------------------------------------------
    def _note(self, text: str) -> ChatMessage:
        return self._add(ChatMessage(text, "system"))

    def _add(self, message: ChatMessage) -> ChatMessage:
        self._q("#conversation", VerticalScroll).mount(message)
        return message

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "question":
            return
        text = event.value.strip()
        box = self._q("#question", HistoryInput)
        if not text:
            return
        box.remember(text)
        box.value = ""
        if text.startswith("/"):
            self.run_command(text)
        else:
            self.ask(text)

    def ask(self, question: str) -> None:
        if self.session is None or self.state != "ready":
            self.notify("Wait until the current answer or task is finished (Esc stops an answer).",
                        severity="warning")
            return
        self._add(ChatMessage(question, "question"))
        self._answer_widget = self._add(ChatMessage("", "answer"))
        self._stop.clear()
        self.state = "generating"
        self._ask_worker(self.session, question, self._answer_widget)

    @work(thread=True, group="ask", exit_on_error=False)
    def _ask_worker(self, session: Session, question: str, widget: ChatMessage) -> None:
        n_before = len(session.answers)
        stopped = False
        error: str | None = None
        stream = session.ask(question)
        try:
            for piece in stream:
                if self._stop.is_set():
                    stopped = True
                    break
                self._ui(widget.append, piece)
        except SekvError as exc:
            error = str(exc)
        except Exception as exc:
            error = f"{exc.__class__.__name__}: {exc}"
        finally:
            stream.close()  # stops generation; the session records what was generated
        recorded = session.answers[-1].text if len(session.answers) > n_before else None
        self._ui(self._answer_done, widget, recorded, stopped, error)

    def _answer_done(self, widget: ChatMessage, text: str | None, stopped: bool, error: str | None) -> None:
        self.state = "ready"
        widget.finish(text, stopped=stopped)
        if error:
            self._note(f"error: {error}")
        self._refresh_panel()

    def action_stop(self) -> None:
        """Esc: stop the answer being generated, else go back to the question box."""
        if self.state == "generating":
            self._stop.set()
        elif self.screen is getattr(self, "_main", None):
            self._q("#question", Input).focus()

    def action_copy_answer(self) -> None:
        if self.session is None or not self.session.answers:
            self.notify("No answer to copy yet.", severity="warning")
            return
        text = self.session.answers[-1].text
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last answer ({len(text)} characters).")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_open_map(self) -> None:
        if self.session is None:
            return
        self._q("#docmap", DocumentMap).focus()

    def action_clear(self) -> None:
        if self.session is None or self.state != "ready":
            self.notify("Not now: an answer or task is running.", severity="warning")
            return
        self.session.reset_conversation()
        self._q("#conversation", VerticalScroll).remove_children()
        self._note("Conversation cleared; the document stays loaded.")

    async def action_quit(self) -> None:
        self._cancel.set()
        self._stop.set()
        self.state = "quitting"
        self.exit()

    # -- commands ------------------------------------------------------------------------------------
    def run_command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ("/quit", "/exit", "/q"):
            self.call_later(self.action_quit)
            return
        if name == "/help":
            self.action_help()
            return
        if name not in COMMANDS:
            self._note(f"unknown command {name}; commands: {', '.join(COMMANDS)}")
            return
        if name == "/map":
            self.action_open_map()
            return
        if name == "/copy":
            self.action_copy_answer()
            return
        if self.session is None or self.state != "ready":
            self.notify("Not now: an answer or task is running.", severity="warning")
            return
        if name == "/clear":
            self.action_clear()
        elif name == "/stats":
            self._note(self.stats_text())
        elif name == "/save":
            path = Path(arg).expanduser() if arg else self._memory_path(self.settings)
            self.state = "busy"
            self._note(f"saving memory to {path}…")
            self._save_worker(self.session, path)
        elif name == "/load":
            self._command_load(arg)
        elif name == "/budget":
            self._command_budget(arg)
        elif name == "/method":
            self._command_method(arg)

    @work(thread=True, group="save", exit_on_error=False)
    def _save_worker(self, session: Session, path: Path) -> None:
        try:
            session.save(path)
            message = (f"Saved the memory to {path} ({format_bytes(path.stat().st_size)}). The conversation "
                       f"restarts from the document; /load or the next start offers this memory.")
        except SekvError as exc:
            message = f"error: {exc}"
        except OSError as exc:
            message = f"error: cannot write {path}: {exc.strerror or exc}"
        self._ui(self._save_done, message)

    def _save_done(self, message: str) -> None:
        self.state = "ready"
        self._note(message)
        self._refresh_panel()

    def _command_load(self, arg: str) -> None:
        if arg:
            path = Path(arg).expanduser()
            if not path.is_file():
                self._note(f"error: no saved memory at {path}")
                return
        else:
            saved = self._saved_memories()
            exact = self._memory_path(self.settings)
            path = next((m.path for m in saved if m.path == exact), saved[0].path if saved else None)
            if path is None:
                self._note(f"No saved memory of {self.document.name} with this model in {self.memory_dir} "
                           f"(/save makes one).")
                return
        self._open(self.settings, load=path)

    def _command_budget(self, arg: str) -> None:
        if not arg:
            self._note(f"budget: {format_budget(self.settings.budget)} (method {self.settings.method}). "
                       f"Set it with /budget 0.25, /budget 25% or /budget 64MiB; /budget none removes it.")
            return
        try:
            budget = None if arg.lower() in ("none", "off", "full") else parse_budget(arg)
        except SekvError as exc:
            self._note(f"error: {exc}")
            return
        if self.settings.method == "full" and budget is not None:
            self._note("note: method full keeps every token; the budget applies to compressing methods "
                       "(/method sekv).")
        self._reopen(replace(self.settings, budget=budget))

    def _command_method(self, arg: str) -> None:
        methods = self._methods()
        if not arg:
            self._note(f"method: {self.settings.method} (engine {self._engine_name()}); "
                       f"available: {', '.join(methods)}. Switch with /method NAME.")
            return
        if methods and arg not in methods:
            self._note(f"error: unknown method '{arg}' for engine {self.settings.engine}; "
                       f"available: {', '.join(methods)}")
            return
        budget = self.settings.budget
        if arg != "full" and budget is None and self.settings.engine in ("torch", "auto"):
            budget = 0.25
            self._note("using budget 25% (change it with /budget)")
        options = self.settings.method_options if arg == self.settings.method else ()  # settings are per method
        self._reopen(replace(self.settings, method=arg, budget=budget if arg != "full" else None,
                             method_options=options))

    def _engine_name(self) -> str:
        """The engine running now (`auto` resolved), or the one asked for before a session exists."""
        return self.session.engine.name if self.session is not None else self.settings.engine

    def _methods(self) -> list[str]:
        if self.settings.engine in ("torch", "auto"):  # auto runs every method (the torch engine where it must)
            from sekv_local.cache import available_policies

            return list(available_policies())
        try:
            from sekv_local.engines.llama_cpp_stock import METHODS

            return list(METHODS)
        except Exception:
            return []

    def _reopen(self, settings: SessionSettings) -> None:
        """New settings: load the saved memory for exactly them if there is one, else read again."""
        path = self._memory_path(settings)
        self._open(settings, load=path if path.is_file() else None)

    # -- side panel ----------------------------------------------------------------------------------
    def _refresh_panel(self) -> None:
        info = self._q("#doc-info", Static)
        bars = self._q("#memory", MemoryBars)
        spans = self._q("#spans-info", Static)
        dmap = self._q("#docmap", DocumentMap)
        passage = self._q("#passage", Static)
        s = self.settings
        session = self.session
        text = Text()
        text.append(f"{self.document.name}\n", style="bold")
        tokens = f"{session.document_tokens:,}" if session is not None else "…"
        text.append(f"tokens  {tokens}\n")
        text.append(f"model   {memories.model_slug(s.model)}\n")
        budget = f" · budget {format_budget(s.budget)}" if s.budget is not None else ""
        engine = session.engine.name if session is not None else s.engine
        text.append(f"engine  {engine} · {s.method}{budget}")
        info.update(text)
        if session is None:
            bars.show(None)
            spans.update(Text("reading…", style="dim"))
            dmap.set_data(0, [])
            passage.update(Text("The passages behind an answer show here.", style="dim"))
            return
        answer = session.answers[-1] if session.answers else None
        bars.show(answer.memory if answer is not None else self._initial["memory"])
        observations = answer.observations if answer is not None else self._initial["observations"]
        zoomed = observations.get("zoomed") or []
        if "spans" in observations:
            line = f"spans   {observations['spans']:,}"
            if answer is not None:
                line += f" · {len(zoomed)} zoomed"
                if observations.get("pinned"):
                    line += f" ({observations['pinned']} pinned)"
                reads = answer.memory.get("host_reads_per_step_fraction")
                if reads:  # what one decode step read back from the host tier
                    line += f" · reads {100 * reads:.1f}% of full KV/token"
            spans.update(line)
        else:
            spans.update(Text(f"no zoom data: method {s.method} keeps every token (try /method sekv)", style="dim"))
        dmap.set_data(session.document_tokens, zoomed)
        dmap.cursor = None
        if zoomed:
            hint = ("Coloured cells: where the last answer zoomed in (light grey: a trace). F2 then ←/→ or a click "
                    "shows the passage.")
        elif "spans" in observations and answer is None:
            hint = "Ask a question: the map shows where the answer zoomed in. F2 then ←/→ or a click shows a passage."
        else:
            hint = "Select a region (F2 then ←/→, or a click) to read that passage."
        passage.update(Text(hint, style="dim"))

    def on_document_map_selected(self, event: DocumentMap.Selected) -> None:
        if self.session is None:
            return
        passage = self._q("#passage", Static)
        doc_tokens = self.session.document_tokens
        out = Text()
        if event.spans:
            out.append(f"tokens {event.start:,}–{event.end:,} of {doc_tokens:,}", style="bold")
            hits = sum(int(z.get("hits", 0)) for z in event.spans)
            layers = sorted({layer for z in event.spans for layer in z.get("layers", [])})
            out.append(f"\nzoomed here: {hits} hits", style="bold yellow")
            if layers:
                out.append(f", layers {', '.join(map(str, layers[:12]))}{'…' if len(layers) > 12 else ''}",
                           style="yellow")
            for z in event.spans[:4]:
                start = int(z.get("doc_token", 0))
                length = int(z.get("length", 0))
                body = z.get("text") or self.session.passage(start, length)
                out.append(f"\n\n[{start:,}–{start + length:,}] ", style="dim")
                out.append(body.strip())
        else:
            # a cell of a short document is a few tokens: show at least a readable window around it
            n = max(event.end - event.start, PASSAGE_TOKENS)
            start = max(0, min(event.start, doc_tokens - n))
            out.append(f"tokens {start:,}–{min(start + n, doc_tokens):,} of {doc_tokens:,}", style="bold")
            out.append("\n(no zoom here)\n\n", style="dim")
            out.append(self.session.passage(start, n).strip())
        passage.update(out)
        self._q("#passage-box", VerticalScroll).scroll_home(animate=False)

    def stats_text(self) -> str:
        assert self.session is not None
        s, session = self.settings, self.session
        lines = [f"document {self.document.name}: {session.document_tokens:,} tokens, read in "
                 f"{format_duration(session.ingest_s)} ({session.ingest_s:.1f} s)",
                 f"model {memories.model_slug(s.model)} · engine {session.engine.name} · method {s.method}"
                 + (f" · budget {format_budget(s.budget)}" if s.budget is not None else "")]
        answer = session.answers[-1] if session.answers else None
        memory = (answer.memory if answer is not None else self._initial["memory"]) or {}
        full = memory.get("full_kv_bytes") or 0
        lines.append(f"memory: device {format_bytes(memory.get('device_bytes'))} "
                     f"(peak {format_bytes(memory.get('device_peak_bytes'))}), host {format_bytes(memory.get('host_bytes'))}, "
                     + (f"kept for the next question {format_bytes(memory['checkpoint_bytes'])}, "
                        if memory.get("checkpoint_bytes") else "") +
                     f"full KV {format_bytes(full)}"
                     + (f" → device {memory.get('device_bytes', 0) / full:.1%} of full" if full else "")
                     + f"; {memory.get('tokens', 0):,} tokens in the cache")
        if answer is not None:
            rate = f", {answer.n_tokens / answer.decode_s:.1f} tok/s" if answer.decode_s else ""
            lines.append(f"last answer: {answer.n_tokens} tokens, prompt {answer.prompt_tokens} tokens, "
                         f"prefill {answer.prefill_s:.2f} s, decode {answer.decode_s:.2f} s{rate}")
            obs = answer.observations
            if "spans" in obs:
                lines.append(f"zoom: {len(obs.get('zoomed') or [])} of {obs['spans']:,} spans zoomed in")
            else:
                lines.append(f"zoom: none (method {s.method} has no observations)")
        else:
            lines.append("no answer yet")
        return "\n".join(lines)


def run_app(document: Document | str | Path, settings: SessionSettings = SessionSettings(), **kwargs: Any) -> None:
    """Run the app in the terminal (what `sekv-local chat FILE` does when stdin is a terminal)."""
    ChatApp(document, settings, **kwargs).run()
