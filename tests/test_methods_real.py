"""Every cache method on the real default model: a short NIAH case answered correctly at a generous
budget, with the device tier after prefill within that budget (measured from tensor storage)."""

from __future__ import annotations

import pytest

from sekv_local.cache import available_policies
from sekv_local.documents import Document
from sekv_local.eval.scoring import score
from sekv_local.eval.tasks import generate_sample
from sekv_local.session import Session, SessionSettings

BUDGET = 0.8  # generous: question-agnostic eviction may drop a mid-document needle at lower budgets
UNBUDGETED = {"full", "quant", "quant-q8_0", "quant-q4_0"}
# Known failure, tracked in the baselines issue: the attention-score methods (shared cache/scoring.py)
# lose a mid-document needle on the real model even at 80% of full KV (toy-model tests pass), which
# points at their scoring or position handling. strict=True: the marker fails the run once fixed.
_SCORED = {"h2o", "snapkv", "pyramidkv", "chunkkv"}
METHODS = [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason="scored methods lose the needle: open bug"))
           if m in _SCORED else m
           for m in available_policies() if m != "quant"]  # "quant" = its aliases with a preset type


@pytest.fixture(scope="module")
def sample(tokenizer):
    # 1K-token haystack, needle in the middle (the suite's own generator, a seed outside the bench's)
    return generate_sample("niah_single", 900, seed=424242, count_tokens=tokenizer.count, depth=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_method_answers_short_niah_within_budget(method, sample, tokenizer, model_path) -> None:
    budget = None if method in UNBUDGETED else BUDGET
    session = Session.create(Document.from_text(sample.document),
                             SessionSettings(method=method, budget=budget, threads=2, max_new_tokens=40),
                             show_progress=False, tokenizer=tokenizer)
    session.ingest()
    after_prefill = session.engine.memory()
    question = sample.questions[0]
    answer = session.answer(question.text)
    print(f"[{method}] device {after_prefill.device_fraction:.1%} (peak {after_prefill.device_peak_fraction:.1%}) "
          f"host {after_prefill.host_fraction:.1%} -> {answer.text!r}")
    if budget is not None:
        limit = budget * session.engine.config.full_kv_bytes(after_prefill.tokens)
        assert after_prefill.device_peak_bytes <= limit
        assert after_prefill.device_bytes < after_prefill.full_kv_bytes  # it really holds less than full KV
    assert score(answer.text, question) == 1.0, f"{method} answered {answer.text!r}, expected {question.answers}"
