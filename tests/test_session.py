"""Session on the real default model: one ingest, many questions, streamed answers."""

from __future__ import annotations

import pytest

from sekv_local.documents import Document, sample_document
from sekv_local.errors import DocumentError, SekvError
from sekv_local.session import Session, SessionSettings


@pytest.fixture(scope="module")
def session(model_path, tokenizer) -> Session:
    s = Session.create(sample_document(), SessionSettings(threads=2, max_new_tokens=40), show_progress=False,
                       tokenizer=tokenizer)
    s.ingest()
    return s


def test_document_is_read_once_and_questions_reuse_its_cache(session: Session) -> None:
    session.reset_conversation()
    after_ingest = session.engine.stats.prefill_tokens
    assert after_ingest == session.engine.n_tokens > session.document_tokens > 2500

    pieces = list(session.ask("Who is the keeper of the lighthouse?"))
    assert len(pieces) > 1, "the answer should stream in several pieces"
    first = session.answers[-1]
    assert "Maren Holt" in "".join(pieces) and "Maren Holt" in first.text
    # only the question was prefilled, not the document again
    assert session.engine.stats.prefill_tokens - after_ingest == first.prompt_tokens < 40

    second = session.answer("What is the town's annual festival called?")
    assert "Lantern Regatta" in second.text
    assert session.engine.stats.prefill_tokens - after_ingest == first.prompt_tokens + second.prompt_tokens
    assert len(session.turns) == 2  # multi-turn: the conversation stays in the cache
    assert session.engine.n_tokens > after_ingest + first.n_tokens + second.n_tokens


def test_reset_conversation_gives_identical_greedy_answers(session: Session) -> None:
    session.reset_conversation()
    a = session.answer("In what year was the light first lit?")
    n_after = session.engine.n_tokens
    session.reset_conversation()
    assert session.engine.n_tokens < n_after
    b = session.answer("In what year was the light first lit?")
    assert a.text == b.text and "1887" in a.text


def test_answer_reports_memory_from_the_cache(session: Session) -> None:
    session.reset_conversation()
    answer = session.answer("Who is the keeper of the lighthouse?")
    mem = answer.memory
    cfg = session.engine.config
    assert mem["tokens"] == session.engine.n_tokens
    assert mem["full_kv_bytes"] == cfg.full_kv_bytes(mem["tokens"])
    # full f16 KV: the baseline plus growth slack (capacity grows in 256-token steps and is kept
    # after a rollback, so earlier, longer turns may leave up to two steps)
    slack = 2 * 256 * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    assert mem["full_kv_bytes"] <= mem["device_bytes"] <= mem["full_kv_bytes"] + slack
    assert mem["host_bytes"] == 0


def test_keep_history_false_leaves_no_trace(session: Session) -> None:
    session.reset_conversation()
    after_document = session.engine.n_tokens
    answer = session.answer("Who is the keeper of the lighthouse?", keep_history=False)
    assert answer.memory["tokens"] > after_document  # measured while the answer was cached
    assert not session.turns and session.engine.n_tokens == after_document


def test_stopping_a_stream_early_keeps_the_session_usable(session: Session) -> None:
    session.reset_conversation()
    stream = session.ask("Describe the town in detail.")
    next(stream)
    stream.close()
    assert session.answers[-1].n_tokens >= 1
    assert "Maren" in session.answer("Who is the keeper of the lighthouse?").text


def test_too_long_document_is_refused_with_numbers(model_path, tokenizer) -> None:
    text = "The grass is green. The sky is blue. " * 1200  # ~ 10K tokens > 8K trained context
    s = Session.create(Document.from_text(text), SessionSettings(threads=2), show_progress=False,
                       tokenizer=tokenizer)
    with pytest.raises(DocumentError) as err:
        s.ingest()
    message = str(err.value)
    assert "tokens" in message and "8192" in message
    assert s.engine.n_tokens == 0  # refused before any work
    assert "sekv@positions=bounded" in message
    bounded = Session.create(Document.from_text(text), SessionSettings(
        threads=2, method="sekv", budget=0.25, method_options=(("positions", "bounded"),)),
        show_progress=False, tokenizer=tokenizer)
    assert bounded.engine.max_context() > 2 * 8192  # SeKV re-places its memory inside the trained window


def test_empty_question_is_refused(session: Session) -> None:
    with pytest.raises(SekvError):
        list(session.ask("   "))
