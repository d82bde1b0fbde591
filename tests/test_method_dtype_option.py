"""Every registered method takes its storage type by one table and refuses a misspelt one with a clear error."""

from __future__ import annotations

import pytest

from sekv_local.cache import available_policies, create_policy
from sekv_local.errors import SekvError
from sekv_local.models.config import ModelConfig
from sekv_local.models.rope import Rope

TINY = ModelConfig(architecture="llama", n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=64, context_length=512, rms_eps=1e-5, rope_base=10000.0, rope_dim=16, rope_scale=1.0,
                   rope_interleaved=True)
#: methods whose rows are stored in a block-quantized type of their own instead of a `dtype` option
NO_DTYPE_OPTION = {"quant", "quant-q8_0", "quant-q4_0"}
BUDGET = {"full": None, "quant": None, "quant-q8_0": None, "quant-q4_0": None}


@pytest.mark.parametrize("method", available_policies())
def test_a_misspelt_dtype_is_refused_by_name(method):
    budget = BUDGET.get(method, 0.5)
    if method in NO_DTYPE_OPTION:
        with pytest.raises(SekvError):  # not a raw TypeError from the constructor
            create_policy(method, TINY, Rope(TINY), budget=budget, dtype="f16")
        return
    with pytest.raises(SekvError, match=r"dtype must be one of f16, bf16, f32, got 'f61'"):
        create_policy(method, TINY, Rope(TINY), budget=budget, dtype="f61")

