"""A low-noise tuning signal for SeKV's question-time settings: the teacher-forced log-probability of a
needle question's right answer, under full KV and under several SeKV variants, on development seeds.

Free-running answers of a 135M model flip on small perturbations, so a handful of questions per cell says
little. Here each question's reference answer ("The special magic number for KEY mentioned in the provided
text is VALUE.") is fed one decode step at a time, and the log-probability of VALUE's tokens is summed; a
variant that loses the needle's rows loses many nats. SeKV reads the document once per question; each
variant (options that act when the question arrives: select, pin_score, pin_spread, read_budget) then runs
from a rollback to the same memory.

    python scripts/forced_answer.py --task niah_single --length 7168 --seed 5 --samples 12 \\
        --variant q0='{"pin_spread": 0.0}' --variant q50='{"pin_spread": 0.5}' --out runs/forced.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from sekv_local.documents import Document
from sekv_local.engines import EngineOptions, create_engine
from sekv_local.eval.runner import prompt_overhead
from sekv_local.eval.tasks import generate_suite
from sekv_local.models.prompt import PromptBuilder
from sekv_local.models.registry import resolve_model
from sekv_local.models.tokenizer import Tokenizer
from sekv_local.session import Session, SessionSettings


def forced_value_logprob(engine, session: Session, tokenizer: Tokenizer, question: str, answer: str,
                         value: str) -> tuple[float, bool]:
    """Feed the question, then `answer` one decode step per token: (sum of log p over VALUE's tokens, whether
    each of them was the argmax)."""
    engine.feed(session.prompt.turn_tokens([], question))
    engine.finish_prefill()
    before = tokenizer.encode(answer[: answer.index(value)].rstrip())
    ids = tokenizer.encode(answer)
    if ids[: len(before)] != before:
        raise ValueError("the answer's prefix tokenizes differently on its own")
    logits, logps, top = engine._last_logits, [], []
    for i, token in enumerate(ids):
        logp = torch.log_softmax(torch.from_numpy(logits).float(), -1)
        if len(before) <= i < len(ids) - 1:  # the value's tokens, not the closing '.'
            logps.append(float(logp[token]))
            top.append(int(logp.argmax()) == token)
        logits = engine._forward([token], prefill=False)
        engine.n_tokens += 1
    return sum(logps), all(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="niah_single", choices=["niah_single", "niah_multikey"])
    ap.add_argument("--length", type=int, default=7168)
    ap.add_argument("--seed", type=int, required=True, help="a development seed (1-9)")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--variant", action="append", default=[], help="NAME=JSON of SeKV options")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not 1 <= args.seed <= 9:
        ap.error("tune on development seeds 1-9 only")
    variants = {name: json.loads(text) for name, text in (v.split("=", 1) for v in args.variant)} or {"sekv": {}}
    torch.set_num_threads(args.threads)
    model_path = resolve_model(args.model, show_progress=False)
    tokenizer = Tokenizer(model_path)
    suite = generate_suite(args.task, args.length - prompt_overhead(PromptBuilder(tokenizer)), args.samples,
                           args.seed, tokenizer.count)
    records = []
    for i, sample in enumerate(suite):
        question = sample.questions[0]
        key = question.meta["key"] if isinstance(question.meta["key"], str) else question.meta["key"][0]
        value = question.answers[0]
        answer = f"The special magic number for {key} mentioned in the provided text is {value}."
        row = {"sample": i, "depth": question.meta.get("achieved_depth")}
        for method in ("full", "sekv"):
            options = EngineOptions(method=method, budget=None if method == "full" else args.budget,
                                    threads=args.threads)
            engine = create_engine("torch", model_path, tokenizer, options)
            session = Session(engine, Document.from_text(sample.document),
                              SessionSettings(model=args.model, method=method), model_path)
            session.ingest()
            if method == "full":
                row["full"] = forced_value_logprob(engine, session, tokenizer, question.text, answer, value)
                continue
            mark, config = engine.mark(), engine.cache.cfg
            for name, overrides in variants.items():
                engine.rollback(mark)
                engine.cache.cfg = dataclasses.replace(config, **overrides)
                engine.cache._plan()
                row[name] = forced_value_logprob(engine, session, tokenizer, question.text, answer, value)
        records.append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "records": records},
                                       indent=1))
    print(f"\n{'variant':<10} {'mean log p(value)':>18} {'value argmax':>13}  (n={len(records)})")
    for name in ["full", *variants]:
        print(f"{name:<10} {np.mean([r[name][0] for r in records]):>18.2f} "
              f"{np.mean([r[name][1] for r in records]):>13.2f}")


if __name__ == "__main__":
    main()
