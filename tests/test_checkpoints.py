"""Checkpoints (a chat session's mark after the document) count in a method's memory report while they are held."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from sekv_local.cache import create_policy
from sekv_local.models.rope import Rope

from test_baselines_scored import CFG, feed, make_stream

torch.set_num_threads(1)

#: methods that overwrite rows in place: a checkpoint must copy them
COPYING = {"streaming": {}, "snapkv": {}, "h2o": {}, "sekv": {"l_min": 4, "l_max": 32, "recent": 32, "zoom_k": 4}}


def read(method: str, options: dict, n: int = 600):
    budget = None if method == "full" else 0.5 if method == "sekv" else 0.3
    policy = create_policy(method, CFG, Rope(CFG), budget=budget, **options)
    policy.reserve(n)
    feed(policy, make_stream(n), 0, n, policy.max_chunk_tokens() or 128)
    policy.finish_prefill()
    return policy


@pytest.mark.parametrize("method", sorted(COPYING))
@torch.inference_mode()
def test_a_held_checkpoint_is_counted_and_a_dropped_one_is_not(method: str) -> None:
    policy = read(method, COPYING[method])
    before = policy.memory()
    assert before.checkpoint_bytes == 0
    mark = policy.mark()
    held = policy.memory()
    assert held.checkpoint_bytes > 0
    assert held.total_bytes == held.device_bytes + held.host_bytes + held.checkpoint_bytes
    assert held.as_dict()["checkpoint_bytes"] == held.checkpoint_bytes
    # the copies are not larger than what the method holds (they copy its rows, never more)
    assert held.checkpoint_bytes <= before.device_bytes + before.host_bytes
    policy.rollback(mark)  # rolling back keeps the checkpoint (the next question starts from it again)
    assert policy.memory().checkpoint_bytes == held.checkpoint_bytes
    del mark
    assert policy.memory().checkpoint_bytes == 0


@torch.inference_mode()
def test_full_kv_checkpoint_is_a_count_and_costs_nothing() -> None:
    policy = read("full", {})
    mark = policy.mark()
    assert policy.memory().checkpoint_bytes == 0
    policy.rollback(mark)


def test_rollback_refuses_what_mark_did_not_make() -> None:
    policy = read("streaming", {})
    with pytest.raises(Exception, match="checkpoint"):
        policy.rollback((0, 0))


def test_an_engine_reset_frees_its_old_policy_without_the_garbage_collector(model_path, tokenizer) -> None:
    from sekv_local.engines.base import EngineOptions
    from sekv_local.engines.factory import create_engine

    engine = create_engine("torch", model_path, tokenizer, EngineOptions(method="metasoft", budget=0.25, threads=1))
    old = weakref.ref(engine.cache)
    gc.disable()
    try:
        engine.reset()
        # a reference cycle (the probe pass closing over its policy) kept 45 MiB of buffers until gc ran
        assert old() is None
    finally:
        gc.enable()
