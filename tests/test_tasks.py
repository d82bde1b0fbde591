"""Tests for the local RULER-style task generators and string-match scoring."""

from __future__ import annotations

import re

import pytest

from sekv_local.eval import tasks as T
from sekv_local.eval.scoring import score, string_match_all, string_match_part
from sekv_local.eval.tasks import (
    DEPTH_TASKS, FIT_LOW, NIAH_NEEDLE, TASKS, Question, Sample, generate_sample, generate_suite,
    parse_length, suite_seed,
)


def chars4(text: str) -> int:
    """Stand-in tokenizer: 4 characters per token."""
    return len(text) // 4


def words(text: str) -> int:
    """Stand-in tokenizer: whitespace words."""
    return len(text.split())


COUNTERS = [chars4, words]


def needle_depth(doc: str, needle: str, other_inserts: list[str] = ()) -> float:
    """Fraction of the haystack characters (document minus inserted texts) before ``needle``."""
    pos = doc.index(needle)
    before = sum(len(o) + 1 for o in other_inserts if doc.index(o) < pos)
    inserted = sum(len(o) + 1 for o in other_inserts) + len(needle) + 1
    return (pos - before) / (len(doc) - inserted)


# ------------------------------------------------------------------ generation, determinism

@pytest.mark.parametrize("task", TASKS)
def test_every_task_generates_and_answers_are_in_document(task: str) -> None:
    s = generate_sample(task, 2048, 11, chars4, 0.4)
    assert isinstance(s, Sample) and s.task == task and s.seed == 11 and s.target_tokens == 2048
    assert s.questions and all(isinstance(q, Question) for q in s.questions)
    assert s.meta["n_tokens"] == chars4(s.document)
    for q in s.questions:
        assert q.match in ("all", "part") and q.answers and q.text.endswith("only.")
        for ans in q.answers:
            assert ans in s.document, (task, ans)
            assert ans not in q.text  # the question must not give the answer away
    if task in DEPTH_TASKS:
        assert s.meta["depth"] == 0.4
        assert all("depth" in q.meta for q in s.questions)
    else:
        assert s.meta["depth"] is None
        assert all("depth" not in q.meta for q in s.questions)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_seed(task: str) -> None:
    a = generate_sample(task, 1024, 5, chars4, 0.3)
    b = generate_sample(task, 1024, 5, chars4, 0.3)
    c = generate_sample(task, 1024, 6, chars4, 0.3)
    assert a == b
    assert a.document != c.document
    assert [q.answers for q in a.questions] != [q.answers for q in c.questions]


def test_no_global_random_state_used() -> None:
    import random

    random.seed(0)
    a = generate_sample("niah_multikey", 1024, 3, chars4)
    random.seed(12345)
    b = generate_sample("niah_multikey", 1024, 3, chars4)
    assert a == b


# ------------------------------------------------------------------ length fitting

@pytest.mark.parametrize("counter", COUNTERS)
@pytest.mark.parametrize("length", [256, 1000, 4096, 32768, 65536])
@pytest.mark.parametrize("task", TASKS)
def test_length_fit_within_bounds(task: str, length: int, counter) -> None:
    s = generate_sample(task, length, 2, counter, 0.7)
    n = counter(s.document)
    assert s.meta["n_tokens"] == n
    assert FIT_LOW * length <= n <= length, (task, length, n)


def test_fit_uses_few_token_counts() -> None:
    calls = []

    def counting(text: str) -> int:
        calls.append(len(text))
        return len(text) // 4

    generate_sample("niah_single", 65536, 1, counting, 0.5)
    assert len(calls) <= 8
    calls.clear()
    generate_sample("common_words", 65536, 1, counting)
    assert len(calls) <= 9


def test_fit_too_small_target_raises() -> None:
    with pytest.raises(ValueError, match="too small"):
        generate_sample("niah_multivalue", 20, 1, chars4, 0.5)


def test_documents_up_to_32k_keep_the_pydoc_haystack() -> None:
    s = generate_sample("niah_single", T.BOOK_FROM_TOKENS, 4, chars4, 0.5)
    assert s.meta["haystack"] == "pydoc"


def test_the_book_holds_130k_tokens_of_distinct_prose(tokenizer) -> None:
    from sekv_local.eval.book import book_paragraphs, book_text

    paragraphs = book_paragraphs()
    assert len(set(paragraphs)) == len(paragraphs)
    pydoc = tuple(dict.fromkeys(T._pydoc_paragraphs()))  # the pydoc prose comes first, once each
    assert paragraphs[: len(pydoc)] == pydoc
    assert len(tokenizer.encode(book_text())) >= 130_000
    for paragraph in paragraphs[len(pydoc):][::97]:  # the docstrings' prose follows the pydoc rules
        text = " ".join(paragraph)
        assert text.endswith(".") and ">>>" not in text and "::=" not in text


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "doc_qa"])
def test_a_128k_document_is_book_prose_that_never_repeats(task: str, tokenizer) -> None:
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    s = generate_sample(task, 131072, 101, count, 0.3)
    assert s.meta["haystack"] == "book"
    assert FIT_LOW * 131072 <= s.meta["n_tokens"] <= 131072
    paragraphs = s.document.split("\n\n")
    assert len(set(paragraphs)) == len(paragraphs) > 3000
    first = s.meta["needles"][0]
    assert first["text"] in s.document and abs(first["achieved_depth"] - 0.3) < 0.01


# ------------------------------------------------------------------ needle placement

@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
@pytest.mark.parametrize("counter", COUNTERS)
def test_niah_single_needle_at_requested_depth(depth: float, counter) -> None:
    s = generate_sample("niah_single", 8192, 21, counter, depth)
    q = s.questions[0]
    value = q.answers[0]
    needle = NIAH_NEEDLE.format(key=q.meta["key"], value=value)
    assert s.document.count(needle) == 1 and s.document.count(value) == 1
    measured = needle_depth(s.document, needle)
    assert abs(measured - depth) < 0.03
    assert abs(q.meta["achieved_depth"] - depth) < 0.03
    # at a sentence boundary: preceded by the end of a sentence (or the document start)
    pos = s.document.index(needle)
    assert pos == 0 or re.search(r"[.!?\"”)]\s+$", s.document[:pos])
    if depth == 0.0:
        assert pos == 0
    if depth == 1.0:
        assert s.document.endswith(needle)


def test_multikey_distractors_and_question() -> None:
    s = generate_sample("niah_multikey", 4096, 8, chars4, 0.6)
    needles = s.meta["needles"]
    assert len(needles) == 4 and needles[0]["depth"] == 0.6
    keys = {re.search(r"for (\S+) is", n["text"]).group(1) for n in needles}
    assert len(keys) == 4
    q = s.questions[0]
    assert q.meta["key"] in q.text and len(q.answers) == 1 and q.match == "all"
    assert NIAH_NEEDLE.format(key=q.meta["key"], value=q.answers[0]) == needles[0]["text"]
    others = [n["text"] for n in needles[1:]]
    assert abs(needle_depth(s.document, needles[0]["text"], others) - 0.6) < 0.03


def test_multivalue_and_multiquery() -> None:
    mv = generate_sample("niah_multivalue", 4096, 9, chars4, 0.2)
    q = mv.questions[0]
    assert len(q.answers) == 4 and len(set(q.answers)) == 4 and q.match == "all"
    assert all(f"for {q.meta['key']} is: {v}." in mv.document for v in q.answers)
    assert all(re.fullmatch(r"\d{7}", v) for v in q.answers)

    mq = generate_sample("niah_multiquery", 4096, 9, chars4, 0.2)
    q = mq.questions[0]
    assert len(q.meta["key"]) == 4 and all(k in q.text for k in q.meta["key"])
    for key, value in zip(q.meta["key"], q.answers):
        assert NIAH_NEEDLE.format(key=key, value=value) in mq.document


def test_multiturn_three_questions_three_depths() -> None:
    s = generate_sample("multiturn_niah", 8192, 13, chars4, 0.1)
    assert len(s.questions) == 3
    assert sorted(q.meta["turn"] for q in s.questions) == [1, 2, 3]
    assert len({q.meta["key"] for q in s.questions}) == 3
    assert sorted(round(q.meta["depth"], 6) for q in s.questions) == [0.1, round(0.1 + 1 / 3, 6),
                                                                      round(0.1 + 2 / 3, 6)]
    for q in s.questions:
        assert abs(q.meta["achieved_depth"] - q.meta["depth"]) < 0.03
        assert NIAH_NEEDLE.format(key=q.meta["key"], value=q.answers[0]) in s.document


def test_variable_tracking_chain_in_order() -> None:
    s = generate_sample("variable_tracking", 4096, 17, chars4)
    q = s.questions[0]
    names, value = q.answers, q.meta["value"]
    assert len(names) == 5 and q.match == "all" and value in q.text
    assert s.meta["haystack"] == "noise" and s.document.startswith("The grass is green.")
    positions = [s.document.index(f"VAR {names[0]} = {value}.")]
    positions += [s.document.index(f"VAR {names[i + 1]} = VAR {names[i]}.") for i in range(4)]
    assert positions == sorted(positions)
    assert positions[-1] - positions[0] > len(s.document) / 2  # spread through the text
    stripped = re.sub(r"VAR [A-Z]{5} = (VAR [A-Z]{5}|\d{5})\. ", "", s.document)
    assert set(re.split(r"(?<=\.) ", stripped)) <= set(re.split(r"(?<=\.) ", T.NOISE))


@pytest.mark.parametrize("length", [512, 8192])
def test_common_words_frequencies(length: int) -> None:
    s = generate_sample("common_words", length, 19, chars4)
    q = s.questions[0]
    entries = s.document.split("\n")
    assert [e.split(". ", 1)[0] for e in entries] == [str(i) for i in range(1, len(entries) + 1)]
    counts: dict[str, int] = {}
    for e in entries:
        w = e.split(". ", 1)[1]
        counts[w] = counts.get(w, 0) + 1
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert sorted(top) == sorted(q.answers) and len(set(q.answers)) == 10
    c, u = s.meta["freq_common"], s.meta["freq_uncommon"]
    assert all(counts[w] == c for w in q.answers)
    assert all(n == u for w, n in counts.items() if w not in q.answers)
    assert c >= 3 * u
    if length >= 8192:
        assert (c, u) == (30, 3)  # RULER's frequencies


def test_doc_qa_facts() -> None:
    s = generate_sample("doc_qa", 4096, 23, chars4, 0.5)
    q = s.questions[0]
    assert q.match == "part" and len(q.answers) == 1 and q.text.endswith("?" + " Answer with the name only.")
    facts = [n["text"] for n in s.meta["needles"]]
    assert len(facts) == 9 and len(set(facts)) == 9
    assert q.meta["entity"] in facts[0] and q.answers[0] in facts[0]
    assert sum(q.answers[0] in f for f in facts) == 1
    assert abs(needle_depth(s.document, facts[0], facts[1:]) - 0.5) < 0.03


def test_pydoc_haystack_is_prose() -> None:
    paras = T._pydoc_paragraphs()
    text = "\n".join(" ".join(p) for p in paras)
    assert len(text) > 150_000
    assert ">>>" not in text and "::=" not in text and "*" not in text
    assert not re.search(r"\w- \w", text)
    assert all(p[-1].endswith(".") for p in paras)
    assert not re.search(r"\d{7}", text)  # cannot collide with a needle value


# ------------------------------------------------------------------ suites

def test_suite_seeds_and_depths() -> None:
    suite = generate_suite("niah_single", 1024, 5, 3, chars4)
    assert [s.seed for s in suite] == [suite_seed(3, i) for i in range(5)]
    assert [s.meta["depth"] for s in suite] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [s.questions[0].meta["depth"] for s in suite] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert len({s.document for s in suite}) == 5
    assert generate_suite("niah_single", 1024, 1, 3, chars4)[0].meta["depth"] == 0.5
    assert all(s.meta["depth"] is None for s in generate_suite("common_words", 1024, 2, 3, chars4))
    other = generate_suite("niah_single", 1024, 2, 4, chars4)
    assert other[0].document != suite[0].document


# ------------------------------------------------------------------ validation, parse_length

def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        generate_sample("nope", 1024, 0, chars4)
    with pytest.raises(ValueError, match="depth"):
        generate_sample("niah_single", 1024, 0, chars4, 1.5)
    with pytest.raises(ValueError):
        generate_sample("niah_single", 0, 0, chars4)


@pytest.mark.parametrize("text,expected", [
    ("1k", 1024), ("4k", 4096), ("4K", 4096), (" 32k ", 32768), ("128k", 131072), ("1.5k", 1536),
    ("4096", 4096), ("300", 300),
])
def test_parse_length(text: str, expected: int) -> None:
    assert parse_length(text) == expected


@pytest.mark.parametrize("text", ["", "k", "4m", "-4k", "0", "0k", "4.5", "1.0001k", "four", "4kk"])
def test_parse_length_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid length"):
        parse_length(text)


# ------------------------------------------------------------------ scoring

def test_string_match_all() -> None:
    refs = ["1234567", "7654321", "Apple", "pear"]
    assert string_match_all("1234567 7654321 apple PEAR", refs) == 1.0
    assert string_match_all("the numbers are 1234567 and 7654321", refs) == 0.5
    assert string_match_all("nothing", refs) == 0.0
    assert string_match_all("x1234567x", ["1234567"]) == 1.0  # substring, like RULER
    assert string_match_all("anything", []) == 0.0
    assert string_match_all("", ["a"]) == 0.0


def test_string_match_part() -> None:
    assert string_match_part("It is OSTRAND.", ["Ostrand", "Velmora"]) == 1.0
    assert string_match_part("It is Velm.", ["Ostrand", "Velmora"]) == 0.0
    assert string_match_part("x", []) == 0.0


def test_score_dispatch() -> None:
    q_all = Question("?", ["a1", "b2"], "all", {})
    q_part = Question("?", ["a1", "b2"], "part", {})
    assert score("A1", q_all) == 0.5 and score("A1 b2", q_all) == 1.0
    assert score("A1", q_part) == 1.0 and score("zz", q_part) == 0.0
    with pytest.raises(ValueError):
        score("a", Question("?", ["a"], "fuzzy", {}))


def test_generated_answers_score_full_marks() -> None:
    for task in TASKS:
        s = generate_sample(task, 1024, 31, chars4, 0.5)
        for q in s.questions:
            assert score(" ".join(q.answers), q) == 1.0
            assert score("I don't know.", q) == 0.0
