"""Every cache method on the real default model: a short NIAH case answered correctly at a generous
budget, with the device tier after prefill within that budget (measured from tensor storage)."""

from __future__ import annotations

import pytest

from sekv_local.cache import available_policies
from sekv_local.documents import Document
from sekv_local.eval.scoring import score
from sekv_local.eval.tasks import generate_sample
from sekv_local.session import Session, SessionSettings

BUDGET = 0.8
UNBUDGETED = {"full", "quant", "quant-q8_0", "quant-q4_0"}
# Question-agnostic attention-score eviction keeps what the *document's* queries attended to; a planted
# needle is what they ignore. Measured on this case with full-KV SnapKV scoring (before any eviction):
# a needle digit ranks in the bottom 10% of the document in 23 of 90 (layer, KV head) rows, so these
# methods lose one digit of a mid-document needle at budgets a little under 100% - that is the methods,
# not a defect, and the comparison report shows it per depth. "Generous" is therefore set per method
# (the budget, and for H2O the depth that its recent window reaches; its accumulated scores are lowest
# just before that window, where a mid-document needle sits):
GENEROUS = {  # method: (budget, needle depth)
    "snapkv": (0.99, 0.5),
    "pyramidkv": (0.95, 0.5),
    "chunkkv": (0.9, 0.5),  # indices shared by all heads: a digit survives if any head wants it
    "h2o": (0.8, 0.9),
    "metasoft": (0.9, 0.5),  # question-agnostic like snapkv (its probe sits after the document, before the question)
}
# bytes per 32 values / f16's 64; 1.15 = the 256-token allocation steps on a ~1K context
QUANT_RATIO = {"quant-q8_0": 34 / 64, "quant-q4_0": 18 / 64}
METHODS = [m for m in available_policies() if m != "quant"]  # "quant" = its aliases with a preset type


def niah_case(tokenizer, depth: float):
    # 1K-token haystack (the suite's own generator, a seed outside the bench's)
    return generate_sample("niah_single", 900, seed=424242, count_tokens=tokenizer.count, depth=depth)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_method_answers_short_niah_within_budget(method, tokenizer, model_path) -> None:
    budget, depth = GENEROUS.get(method, (BUDGET, 0.5))
    budget = None if method in UNBUDGETED else budget
    sample = niah_case(tokenizer, depth)
    session = Session.create(Document.from_text(sample.document),
                             SessionSettings(method=method, budget=budget, threads=2, max_new_tokens=40),
                             show_progress=False, tokenizer=tokenizer)
    session.ingest()
    after_prefill = session.engine.memory()
    question = sample.questions[0]
    answer = session.answer(question.text)
    print(f"[{method}] device {after_prefill.device_fraction:.1%} (peak {after_prefill.device_peak_fraction:.1%}) "
          f"host {after_prefill.host_fraction:.1%} -> {answer.text!r}")
    if method in QUANT_RATIO:  # no budget: the blocks themselves must be the saving (f16 = 64 bytes per 32 values)
        assert after_prefill.device_bytes <= QUANT_RATIO[method] * 1.15 * after_prefill.full_kv_bytes
    if budget is not None:
        limit = budget * session.engine.config.full_kv_bytes(after_prefill.tokens)
        assert after_prefill.device_peak_bytes <= limit
        assert after_prefill.device_bytes < after_prefill.full_kv_bytes  # it really holds less than full KV
    assert score(answer.text, question) == 1.0, f"{method} answered {answer.text!r}, expected {question.answers}"
