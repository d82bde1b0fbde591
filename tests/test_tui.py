"""The Textual app (`sekv-local chat` in a terminal), driven headless with `App.run_test()`.

The app tests run the real default model on a short document written here; the pure helpers
(document-map binning, memory file names, config file, readers) are tested on their own first.
SVG snapshots live in tests/snapshots/test_tui/; after an intended change of the screens,
regenerate them with `pytest tests/test_tui.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from document_samples import minimal_epub, minimal_pdf

from sekv_local.engines.base import SamplingConfig
from sekv_local.errors import DocumentError, SekvError
from sekv_local.session import Session, SessionSettings
from sekv_local.tui import docmap, memories

STORY = (
    "Port Alder is a small fishing town on a rocky northern coast. Its harbour shelters a dozen boats "
    "and the ferry that calls twice a week. The town is known for smoked herring and for the storms "
    "that close the road each winter.\n\n"
    "The lighthouse keeper of Port Alder is Maren Holt. She climbs the tower every evening at dusk "
    "to light the lamp, and she keeps a logbook of every ship that passes.\n\n"
    "The baker, Tomas Reed, opens his shop at five in the morning. The school has forty pupils and "
    "one teacher, who also plays the organ in the chapel on Sundays.\n"
)
QUESTION = "Who is the lighthouse keeper of Port Alder?"
SIZE = (110, 32)


# -- pure helpers ---------------------------------------------------------------------------------------
def test_docmap_bins_cover_the_document_once():
    for doc_tokens, n_bins in [(1000, 37), (10, 40), (1, 5), (12345, 100)]:
        spans = [docmap.bin_span(i, doc_tokens, n_bins) for i in range(n_bins)]
        assert spans[0][0] == 0 and spans[-1][1] == doc_tokens
        for (a0, a1), (b0, _b1) in zip(spans, spans[1:]):
            assert a0 <= a1 <= b0 + 1
        for token in range(0, doc_tokens, max(1, doc_tokens // 50)):
            start, end = docmap.bin_span(docmap.bin_of(token, doc_tokens, n_bins), doc_tokens, n_bins)
            assert start <= token < end


def test_docmap_hits_levels_and_hottest():
    zoomed = [{"doc_token": 100, "length": 20, "hits": 30}, {"doc_token": 700, "length": 200, "hits": 10},
              {"doc_token": 400, "length": 10, "hits": 1},  # under 1/16 of the hottest cell: a trace
              {"doc_token": 5000, "length": 10, "hits": 99}]  # outside the document: ignored
    values = docmap.bin_hits(zoomed, 1000, 10)
    assert sum(values) == pytest.approx(41)
    assert values[1] == pytest.approx(30) and values[7] == pytest.approx(5) and values[8] == pytest.approx(5)
    assert docmap.levels(values) == [0, 4, 0, 0, 1, 0, 0, 2, 2, 0]  # darker = more hits; a trace still shows
    assert docmap.hottest_bin(values) == 1
    assert docmap.hottest_bin([0.0] * 4) is None and docmap.levels([0.0, 0.0]) == [0, 0]
    assert [z["doc_token"] for z in docmap.spans_in(zoomed, 95, 110)] == [100]
    assert docmap.spans_in(zoomed, 0, 50) == []
    assert docmap.bin_hits(zoomed, 0, 10) == [0.0] * 10


def test_memory_names_and_finding(tmp_path, model_path):
    name = memories.memory_path(tmp_path, "ab" * 32, "smollm2-135m", "torch", "sekv", 0.25).name
    assert name == "abababababababab-SmolLM2-135M-Instruct.Q4_1-torch-sekv-b0.25.sekv"
    # the registry name and the path of the same cached file name the same memory
    assert memories.model_slug(str(model_path)) == memories.model_slug("smollm2-135m")
    assert memories.memory_path(tmp_path, "ab" * 32, "smollm2-135m", "torch", "full", None).name.endswith("-full.sekv")
    (tmp_path / name).write_bytes(b"not a memory")  # damaged files are not offered
    assert memories.find_memories(tmp_path, "ab" * 32, "smollm2-135m") == []
    assert memories.find_memories(tmp_path / "missing", "ab" * 32, "smollm2-135m") == []
    assert memories.format_budget(0.25) == "25%" and memories.format_budget(64 << 20) == "64.0 MiB"


def test_progress_line():
    from sekv_local.tui.screens import format_duration, progress_line

    assert progress_line(0, 1000, 0.0) == "0 / 1,000 tokens"
    assert progress_line(250, 1000, 0.5) == "250 / 1,000 tokens · 500 tok/s · ETA 0:02"
    assert progress_line(1000, 1000, 2.0).endswith("done")
    assert format_duration(3725) == "1:02:05"


def test_config_file(tmp_path, monkeypatch):
    from sekv_local.config_file import ConfigError, load_config

    path = tmp_path / "config.toml"
    assert load_config(path) == {}
    path.write_text('model = "smollm2-135m"\nmethod = "sekv"\nbudget = "25%"\nmax-new-tokens = 64\n')
    assert load_config(path) == {"model": "smollm2-135m", "method": "sekv", "budget": "25%", "max_new_tokens": 64}
    monkeypatch.setenv("SEKV_LOCAL_CONFIG", str(path))
    assert load_config()["method"] == "sekv"
    path.write_text("colour = 'blue'\n")
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        load_config(path)
    path.write_text("threads = 'many'\n")
    with pytest.raises(ConfigError, match="'threads' must be int"):
        load_config(path)
    path.write_text("threads = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_chat_refuses_a_bad_config_file_and_unreadable_documents(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from sekv_local.cli import cli

    doc = tmp_path / "story.txt"
    doc.write_text(STORY)
    config = tmp_path / "config.toml"
    config.write_text("budget = 'lots'\n")
    monkeypatch.setenv("SEKV_LOCAL_CONFIG", str(config))
    result = CliRunner().invoke(cli, ["chat", str(doc), "--no-tui"], input="")
    assert isinstance(result.exception, SekvError) and "config file" in str(result.exception)
    config.write_text("")
    result = CliRunner().invoke(cli, ["chat", str(tmp_path / "missing.pdf")], input="")
    assert isinstance(result.exception, DocumentError) and "not found" in str(result.exception)


def test_readers_html_pdf_epub(tmp_path):
    from sekv_local.readers import read_any

    html = tmp_path / "page.html"
    html.write_text("<html><head><style>p{}</style><script>var x = 1;</script></head><body>"
                    "<h1>Port Alder</h1><p>The keeper is <b>Maren</b> Holt.</p></body></html>")
    doc = read_any(html)
    assert doc.text == "Port Alder\n\nThe keeper is Maren Holt.\n" and doc.name == "page.html"

    pytest.importorskip("pypdf")
    pdf = tmp_path / "book.pdf"
    pdf.write_bytes(minimal_pdf("The keeper is Maren Holt."))
    assert "Maren Holt" in read_any(pdf).text
    (tmp_path / "fake.pdf").write_text("hello")
    with pytest.raises(DocumentError, match="not a PDF"):
        read_any(tmp_path / "fake.pdf")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\n garbage")
    with pytest.raises(DocumentError, match="fake.pdf|damaged|without extractable"):
        read_any(tmp_path / "broken.pdf")

    pytest.importorskip("ebooklib.epub")
    epub_path = tmp_path / "book.epub"
    epub_path.write_bytes(minimal_epub("The keeper is Maren Holt."))
    assert "The keeper is Maren Holt." in read_any(epub_path).text
    (tmp_path / "bad.epub").write_text("plain text")
    with pytest.raises(DocumentError, match="not an EPUB"):
        read_any(tmp_path / "bad.epub")
    # text files still go through the plain reader, with its messages
    with pytest.raises(DocumentError, match="Document not found"):
        read_any(tmp_path / "nope.txt")


def test_history_input_walks_back_and_forth():
    from textual.app import App, ComposeResult

    from sekv_local.tui.widgets import HistoryInput

    class Box(App[None]):
        def compose(self) -> ComposeResult:
            yield HistoryInput(id="h")

    async def run() -> None:
        app = Box()
        async with app.run_test() as pilot:
            box = app.query_one(HistoryInput)
            for text in ("first", "second"):
                box.remember(text)
            box.value = "draft"
            await pilot.press("up")
            assert box.value == "second"
            await pilot.press("up", "up")
            assert box.value == "first"
            await pilot.press("down")
            assert box.value == "second"
            await pilot.press("down")
            assert box.value == "draft"

    asyncio.run(run())


# -- the app with the real model ---------------------------------------------------------------------
@pytest.fixture
def story(tmp_path) -> Path:
    path = tmp_path / "story.txt"
    path.write_text(STORY)
    return path


def settings_for(model_path: Path, **kw: Any) -> SessionSettings:
    base: dict[str, Any] = dict(model=str(model_path), threads=2, max_new_tokens=16, sampling=SamplingConfig(0.0))
    return SessionSettings(**{**base, **kw})


async def wait_for(pilot, condition: Callable[[], bool], timeout: float = 300, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}: state {pilot.app.state}, "
                                 f"error {pilot.app.last_error}")
        await pilot.pause(0.02)
    await pilot.pause(0.05)  # let the UI settle (removed/mounted widgets, focus)


async def type_line(pilot, text: str) -> None:
    pilot.app._q("#question").focus()
    await pilot.press(*text, "enter")
    await pilot.pause(0.05)


def screen_text(app) -> str:
    """What the terminal shows now, as plain text (the same render as export_screenshot)."""
    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system="truecolor", legacy_windows=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def ask(pilot, question: str, timeout: float = 300) -> None:
    """Type `question` and wait for the whole answer."""
    app = pilot.app
    before = len(app.session.answers)
    await type_line(pilot, question)
    await wait_for(pilot, lambda: app.state == "ready" and len(app.session.answers) > before, timeout, "the answer")


def conversation(app) -> list[tuple[str, str]]:
    from sekv_local.tui.widgets import ChatMessage

    return [(m.kind, m.body) for m in app._q("#conversation").query(ChatMessage)]


def test_app_reads_answers_streams_maps_saves_and_loads(story, tmp_path, model_path, tokenizer, monkeypatch):
    from sekv_local.tui.app import ChatApp
    from sekv_local.tui.screens import HelpScreen, IngestScreen
    from sekv_local.tui.widgets import ChatMessage, DocumentMap

    progress: list[tuple[int, int, str]] = []
    shown = IngestScreen.set_progress

    def record(screen, done: int, total: int, elapsed: float) -> None:  # observe what the screen shows
        shown(screen, done, total, elapsed)
        progress.append((done, total, str(screen.query_one("#ingest-stats").content)))

    monkeypatch.setattr(IngestScreen, "set_progress", record)
    streamed: list[str] = []
    append = ChatMessage.append

    def record_piece(message, piece: str) -> None:  # observe the answer growing in the chat view
        append(message, piece)
        streamed.append(message.body)

    monkeypatch.setattr(ChatMessage, "append", record_piece)
    memory_dir = tmp_path / "memories"
    app = ChatApp(story, settings_for(model_path, chunk_size=64), memory_dir=memory_dir, tokenizer=tokenizer)

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            # ingestion screen first, with a progress bar fed by the real reader
            assert isinstance(app.screen, IngestScreen)
            await wait_for(pilot, lambda: app.state != "reading", 300, "reading")
            assert app.state == "ready", app.last_error
            assert app.screen is app._main and app.session.document_tokens > 100
            assert f"{app.session.document_tokens:,}" in str(app._q("#doc-info").content)
            assert "Read story.txt" in conversation(app)[-1][1]

            # ask: the answer streams into the chat view token by token
            await ask(pilot, QUESTION)
            answer = app._answer_widget
            assert isinstance(answer, ChatMessage)
            assert "Maren" in answer.body, answer.body
            assert app.session.answers[-1].text == answer.body
            assert len(streamed) >= 3, "the answer did not stream"
            assert all(b.startswith(a) for a, b in zip(streamed, streamed[1:]))  # grew piece by piece
            assert streamed[-1].strip() == answer.body
            assert ("question", QUESTION) in conversation(app)
            assert "Maren" in screen_text(app)
            # side panel: memory bars and no zoom data for method full
            memory = app.session.answers[-1].memory
            assert memory["full_kv_bytes"] > 0
            bars = str(app._q("#memory").content)
            assert "device" in bars and "host" in bars and "full KV" in bars
            assert "no zoom data" in str(app._q("#spans-info").content)

            # the document map: F2 opens it and shows a passage of the source text; → / End / a click move
            await pilot.press("f2")
            await pilot.pause(0.1)
            dmap = app._q("#docmap", DocumentMap)
            assert app.focused is dmap and dmap.cursor == 0
            first = str(app._q("#passage").content)
            assert "tokens 0–" in first and "Port Alder" in first
            await pilot.press("right")
            assert dmap.cursor == 1
            await pilot.press("end")
            await pilot.pause(0.1)
            last = str(app._q("#passage").content)
            assert last != first and "Sundays" in last
            await pilot.click("#docmap", offset=(dmap.n_bins // 2, 0))
            await pilot.pause(0.1)
            assert dmap.cursor == dmap.n_bins // 2

            # copy, history, stats, help
            await pilot.press("ctrl+y")
            assert app.clipboard == answer.body
            app._q("#question").focus()
            await pilot.press("up")
            assert app._q("#question").value == QUESTION
            app._q("#question").value = ""
            await type_line(pilot, "/stats")
            assert "prefill" in conversation(app)[-1][1] and "full KV" in conversation(app)[-1][1]
            await type_line(pilot, "/help")
            assert isinstance(app.screen, HelpScreen)
            assert "/budget" in screen_text(app) and "Ctrl+Y" in screen_text(app)
            await pilot.press("escape")
            assert app.screen is app._main

            # /save, then /load it back and ask again
            await type_line(pilot, "/save")
            await wait_for(pilot, lambda: app.state == "ready", 120, "saving")
            saved = memories.memory_path(memory_dir, app.document.sha256, str(model_path), "torch", "full", None)
            assert saved.is_file() and "Saved the memory" in conversation(app)[-1][1]
            await type_line(pilot, "/load")
            await wait_for(pilot, lambda: app.state == "ready", 120, "loading")
            assert conversation(app)[0][1].startswith(f"Loaded saved memory {saved.name}")
            assert app.session.document_tokens == len(app.session.prompt.document_tokens(STORY)[1])
            await ask(pilot, QUESTION)
            assert "Maren" in conversation(app)[-1][1]

            await type_line(pilot, "/clear")
            assert conversation(app) == [("system", "Conversation cleared; the document stays loaded.")]
            await type_line(pilot, "/quit")
            await pilot.pause(0.2)

    asyncio.run(run())
    assert app.return_code == 0
    # the progress bar moved chunk by chunk through the document, with tokens/s and an ETA
    assert len(progress) >= 3 and progress[-1][0] == progress[-1][1]
    assert [p[0] for p in progress] == sorted(p[0] for p in progress)
    assert "tok/s" in progress[0][2] and "ETA" in progress[0][2] and progress[-1][2].endswith("done")


def test_app_stops_an_answer_and_survives_a_bad_method(story, tmp_path, model_path, tokenizer):
    from sekv_local.tui.app import ChatApp
    from sekv_local.tui.screens import IngestScreen

    app = ChatApp(story, settings_for(model_path, max_new_tokens=400), memory_dir=tmp_path, tokenizer=tokenizer)

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.state == "ready", 300, "reading")
            await type_line(pilot, "Tell me everything about Port Alder, in great detail.")
            await wait_for(pilot, lambda: app.state == "generating" and len(app._answer_widget.body) > 3, 60)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.state == "ready", 30, "stopping")
            answer = app.session.answers[-1]
            assert app._answer_widget.stopped and answer.n_tokens < 400
            assert "[stopped]" in str(app._answer_widget.render())

            await type_line(pilot, "/method nonsense")
            assert "unknown method 'nonsense'" in conversation(app)[-1][1]
            await type_line(pilot, "/budget lots")
            assert "is not a budget" in conversation(app)[-1][1]
            # a method that cannot hold this document: the error is shown, and Back keeps the old session
            before = app.session
            await type_line(pilot, "/method sekv")
            await wait_for(pilot, lambda: app.state in ("ready", "error"), 300, "re-reading")
            assert app.state == "error" and "budget" in app.last_error
            assert isinstance(app.screen, IngestScreen) and "budget" in screen_text(app)
            await pilot.press("b")
            await pilot.pause(0.1)
            assert app.screen is app._main and app.session is before and app.settings.method == "full"
            await pilot.press("ctrl+q")

    asyncio.run(run())


def town(n_houses: int = 30) -> str:
    """A longer document (about 1,200 tokens) with one fact in the middle, for the SeKV method."""
    colours = ["red", "blue", "green", "yellow", "white", "grey", "black", "orange"]
    paras = [f"House number {i + 1} on Harbour Street has a {colours[i % 8]} door and a garden with {i % 5 + 2} "
             f"apple trees. The family there keeps {i % 3 + 1} goats and sells cheese at the Saturday market."
             for i in range(n_houses)]
    paras.insert(n_houses // 2, "The lighthouse keeper of Port Alder is Maren Holt. She climbs the tower every "
                                "evening at dusk.")
    return "Port Alder is a small fishing town on a rocky northern coast.\n\n" + "\n\n".join(paras) + "\n"


def test_app_with_sekv_maps_where_the_answer_zoomed(tmp_path, model_path, tokenizer):
    from sekv_local.tui.app import ChatApp
    from sekv_local.tui.widgets import DocumentMap

    doc = tmp_path / "town.txt"
    doc.write_text(town())
    app = ChatApp(doc, settings_for(model_path, method="sekv", budget=0.5, chunk_size=64), memory_dir=tmp_path,
                  tokenizer=tokenizer)

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.state in ("ready", "error"), 300, "reading")
            assert app.state == "ready", app.last_error
            assert "spans" in str(app._q("#spans-info").content)
            await ask(pilot, QUESTION)
            answer = app.session.answers[-1]
            assert "Maren" in answer.text
            zoomed = answer.observations["zoomed"]
            assert zoomed and f"{len(zoomed)} zoomed" in str(app._q("#spans-info").content)
            memory = answer.memory
            assert memory["host_bytes"] > 0 and memory["device_bytes"] < memory["full_kv_bytes"]
            dmap = app._q("#docmap", DocumentMap)
            levels = docmap.levels(dmap.values())
            assert max(levels) == len(docmap.SHADES) - 1 and min(levels) >= 0
            # F2 opens the map on its hottest cell and shows the zoomed passage(s) there
            await pilot.press("f2")
            await pilot.pause(0.1)
            assert dmap.cursor == docmap.hottest_bin(dmap.values())
            shown = str(app._q("#passage").content)
            assert "zoomed here" in shown
            start, end = docmap.bin_span(dmap.cursor, app.session.document_tokens, dmap.n_bins)
            for z in docmap.spans_in(zoomed, start, end)[:4]:
                assert z["text"].strip()[:40] in shown
            # a cell without zoom shows the source text under it
            cold = next(i for i, v in enumerate(levels) if v == 0)
            await pilot.click("#docmap", offset=(cold, 0))
            await pilot.pause(0.1)
            assert "(no zoom here)" in str(app._q("#passage").content)
            # switching back to full: no observations, the panel says so
            await type_line(pilot, "/method full")
            await wait_for(pilot, lambda: app.state in ("ready", "error"), 300, "re-reading")
            assert app.state == "ready", app.last_error
            assert app.settings.method == "full" and app.settings.budget is None
            assert "no zoom data" in str(app._q("#spans-info").content)
            await pilot.press("ctrl+q")

    asyncio.run(run())


def test_app_cancels_reading(tmp_path, model_path, tokenizer):
    from sekv_local.tui.app import ChatApp
    from sekv_local.tui.screens import IngestScreen

    long_doc = tmp_path / "long.txt"
    long_doc.write_text(STORY * 12)
    app = ChatApp(long_doc, settings_for(model_path, chunk_size=16), memory_dir=tmp_path, tokenizer=tokenizer)

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            assert isinstance(screen, IngestScreen)
            bar = screen.query_one("#ingest-bar")
            await wait_for(pilot, lambda: (bar.progress or 0) > 0, 300, "the first chunk")
            stats = str(screen.query_one("#ingest-stats").content)
            assert "tok/s" in stats and "ETA" in stats, stats
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.state == "cancelled", 60, "cancel")
            assert bar.progress < bar.total  # stopped early
            assert "Reading cancelled" in str(screen.query_one("#ingest-stats").content)
            await pilot.press("q")
            await pilot.pause(0.2)

    asyncio.run(run())
    assert app.session is None


# -- SVG snapshots of the main screens ------------------------------------------------------------------
@pytest.fixture
def svg_snapshot(snapshot):
    """syrupy + pytest-textual-snapshot's SVG normalisation, stored in tests/snapshots/test_tui/."""
    from pytest_textual_snapshot import SVGImageExtension

    class Here(SVGImageExtension):
        @classmethod
        def dirname(cls, *, test_location) -> str:
            return str(Path(test_location.filepath).parent / "snapshots" / Path(test_location.filepath).stem)

    return snapshot.use_extension(Here)


def screenshot(app, before: Callable[[Any], Any], size: tuple[int, int] = SIZE, timeout: float = 600) -> str:
    """The SVG that pytest-textual-snapshot's snap_compare would take after `before(pilot)` ran, taken in
    run_test like every other app test here; a run that does not finish in `timeout` seconds fails the test
    instead of holding the whole suite."""

    async def run() -> str:
        async with app.run_test(size=size) as pilot:
            await before(pilot)
            app._q("#question").cursor_blink = False
            await pilot.pause()
            await pilot.wait_for_scheduled_animations()
            await pilot.pause()
            return app.export_screenshot(title="sekv-local chat", simplify=True)

    return asyncio.run(asyncio.wait_for(run(), timeout))


def test_snapshot_chat_after_an_answer(story, tmp_path, model_path, tokenizer, svg_snapshot):
    from sekv_local.tui.app import ChatApp

    app = ChatApp(story, settings_for(model_path), memory_dir=tmp_path, tokenizer=tokenizer)

    async def before(pilot) -> None:
        await wait_for(pilot, lambda: app.state == "ready", 300, "reading")
        await ask(pilot, QUESTION)
        await pilot.press("f2")

    assert svg_snapshot == screenshot(app, before)


def test_snapshot_help(story, tmp_path, model_path, tokenizer, svg_snapshot):
    from sekv_local.tui.app import ChatApp

    app = ChatApp(story, settings_for(model_path), memory_dir=tmp_path, tokenizer=tokenizer)

    async def before(pilot) -> None:
        await wait_for(pilot, lambda: app.state == "ready", 300, "reading")
        await pilot.press("f1")

    assert svg_snapshot == screenshot(app, before)


def test_snapshot_offer_of_a_saved_memory_then_load(story, tmp_path, model_path, tokenizer, svg_snapshot):
    from sekv_local.tui.app import ChatApp
    from sekv_local.tui.screens import OfferScreen

    settings = settings_for(model_path)
    session = Session.create(story, settings, show_progress=False, tokenizer=tokenizer)
    session.ingest()
    session.save(memories.memory_path(tmp_path, session.document.sha256, settings.model, "torch", "full", None))
    app = ChatApp(story, settings, memory_dir=tmp_path, tokenizer=tokenizer)

    async def before(pilot) -> None:
        await wait_for(pilot, lambda: isinstance(app.screen, OfferScreen), 30, "the offer")

    assert svg_snapshot == screenshot(app, before)

    app = ChatApp(story, settings, memory_dir=tmp_path, tokenizer=tokenizer)

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, OfferScreen), 30, "the offer")
            started = time.monotonic()
            await pilot.press("l")
            await wait_for(pilot, lambda: app.state == "ready", 120, "loading")
            assert time.monotonic() - started < 60
            assert conversation(app)[0][1].startswith("Loaded saved memory")
            assert app.session.ingest_s == pytest.approx(session.ingest_s)
            await ask(pilot, QUESTION)
            assert "Maren" in conversation(app)[-1][1]

    asyncio.run(run())


def test_snapshot_cancelled_reading(tmp_path, model_path, tokenizer, svg_snapshot):
    from sekv_local.tui.app import ChatApp

    long_doc = tmp_path / "long.txt"
    long_doc.write_text(STORY * 12)
    app = ChatApp(long_doc, settings_for(model_path, chunk_size=16), memory_dir=tmp_path, tokenizer=tokenizer)

    async def before(pilot) -> None:
        await wait_for(pilot, lambda: (app.screen.query_one("#ingest-bar").progress or 0) > 0, 300, "reading")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.state == "cancelled", 60, "cancel")

    assert svg_snapshot == screenshot(app, before)
