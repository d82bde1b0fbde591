"""200-turn chat on one document with SeKV (real model): the device tier stays within the budget after
every turn, the conversation is folded back to the document (plus its latest turns, compressed again
like the document) whenever it would outgrow the budget, and the document is still answerable at the end."""

from __future__ import annotations

import time

import pytest

from sekv_local.documents import Document
from sekv_local.eval.tasks import natural_text
from sekv_local.session import Session, SessionSettings

TURNS = 200
BUDGET = 0.5


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_hundred_turns_hold_the_budget(tokenizer) -> None:
    text = natural_text(9000) + "\n\nThe keeper of the lighthouse at Port Alder is Maren Holt.\n"
    settings = SessionSettings(method="sekv", budget=BUDGET, threads=1, max_new_tokens=6)
    session = Session.create(Document.from_text(text), settings, show_progress=False, tokenizer=tokenizer)
    session.ingest()
    policy = session.engine.cache
    budget_bytes = policy.budget_bytes
    start = time.monotonic()
    sentences = natural_text(100_000)[20_000:].split(". ")  # questions of varying, realistic length
    for turn in range(TURNS):
        answer = session.answer(f"Question {turn}: {sentences[turn]}. Which word of the text above is closest to that?")
        memory = answer.memory
        assert memory["device_bytes"] <= budget_bytes, f"turn {turn}: {memory['device_bytes']} > {budget_bytes}"
        assert memory["device_peak_bytes"] <= budget_bytes, f"turn {turn}: peak over budget"
    minutes = (time.monotonic() - start) / 60
    assert session.folds >= 1  # 200 turns do not fit the budget or the context: the conversation was folded
    assert len(session.answers) == TURNS
    # the folds never touched the document's memory: without the conversation it answers as after reading
    final = session.answer("Who is the keeper of the lighthouse at Port Alder?", max_new_tokens=24,
                           keep_history=False)
    print(f"{TURNS} turns in {minutes:.1f} min, {session.folds} folds, budget {budget_bytes / 2**20:.2f} MiB, "
          f"last device {final.memory['device_bytes'] / 2**20:.2f} MiB, answer {final.text!r}")
    assert "Maren Holt" in final.text


def test_a_folded_conversation_reads_like_the_chat_template_renders_it(tokenizer) -> None:
    from sekv_local.models.prompt import _DOC, PromptBuilder, Turn

    prompt = PromptBuilder(tokenizer)
    turns = [Turn("Who keeps the light?", "Maren Holt."), Turn("Since when?", "Since 1887.")]
    ids = prompt.conversation_tokens(turns, "Is she still there?")
    rendered = prompt._render(turns, "Is she still there?", None).split(_DOC, 1)[1]
    assert tokenizer.decode(ids) == tokenizer.decode(tokenizer.encode(rendered, special=True))
    assert prompt.conversation_tokens([], "Is she still there?") == prompt.turn_tokens([], "Is she still there?")


def test_a_document_that_does_not_fit_host_ram_is_refused_before_reading(tokenizer, monkeypatch) -> None:
    from sekv_local.errors import DocumentError
    from sekv_local.resources import ENV_LIMIT

    monkeypatch.setenv(ENV_LIMIT, "20MiB")  # the user caps sekv-local's host memory
    text = natural_text(30_000)
    session = Session.create(Document.from_text(text), SessionSettings(method="sekv", budget=0.25, threads=1),
                             show_progress=False, tokenizer=tokenizer)
    with pytest.raises(DocumentError, match=r"about \d+ MiB for this document, but 20 MiB are available") as info:
        session.ingest()
    assert "tokens fits" in str(info.value) and session.engine.n_tokens == 0  # nothing was read
    monkeypatch.setenv(ENV_LIMIT, "lots")
    with pytest.raises(Exception, match="is not a size"):
        session.ingest()
    monkeypatch.delenv(ENV_LIMIT)
    plain = Session.create(Document.from_text(text[:3000]), SessionSettings(method="streaming", budget=0.25, threads=1),
                           show_progress=False, tokenizer=tokenizer)
    monkeypatch.setenv(ENV_LIMIT, "1MiB")
    plain.ingest()  # no host tier: nothing to refuse
    assert plain.document_tokens > 0
