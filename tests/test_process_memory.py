"""Memory reports against what the process really holds once an answer is done (resident memory, fresh processes).

The peak of a read is not checked here yet: the model's activations over a prefill chunk and the methods' own
transient copies are not counted by any report (docs/RESULTS.md, "What the process holds", has every method's
peak and end). Nor are the scored baselines' and Meta-Soft's end states, which hold 32-99% of full KV's bytes
beyond their reports at 3K tokens; they join this table as they are fixed.
"""

from __future__ import annotations

import pytest

from sekv_local.eval.process_memory import UNREPORTED_LIMIT, measure_in_fresh_process
from sekv_local.eval.runner import UNBUDGETED

pytestmark = pytest.mark.slow

#: methods whose report matched their resident memory at the end of an answer, within the limit
CASES = ["full", "quant-q8_0", "xkv"]


@pytest.mark.parametrize("method", CASES)
def test_after_an_answer_the_process_holds_what_the_method_reports(method):
    budget = None if method in UNBUDGETED else 0.25
    result = measure_in_fresh_process(method, "smollm2-135m", 3072, budget, "torch", threads=2)
    detail = result.as_dict()
    assert result.tokens > 3000, detail
    # freed heap blocks kept resident (glibc's defaults) put full KV's end at +18% of full KV, over the limit
    assert result.unreported_end <= UNREPORTED_LIMIT, detail
    # and the report is not larger than what exists: growth measured from reused free blocks would be
    assert result.resident_end_growth >= 0.8 * result.reported_end_bytes, detail
