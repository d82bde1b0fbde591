"""Which spans SeKV zooms for one bench question, under several SeKV variants.

Rebuilds question `--sample` of the bench suite (task, length, `--samples`, `--seed` as in `sekv-local
bench`), answers it with the torch engine once per variant, and prints the prediction, the score and the
zoomed spans within 80 tokens of the needle (span start, length, how many layer x step choices hit it).
With `--steps`, for every number-bearing sentence of the document (the needle and the distractors), the
global layers in which a span overlapping it was zoomed, step by step (step 0 is the question's prefill,
then one step per answer token).

    python scripts/zoom_diagnostic.py -m gemma3-270m --task niah_single --length 16384 --sample 0 \\
        --variant '{"rank_gate": false}' --variant '{"trained": false}'
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from sekv_local.engines import EngineOptions, create_engine
from sekv_local.eval.runner import prompt_overhead, run_sample
from sekv_local.eval.tasks import generate_suite
from sekv_local.models.prompt import PromptBuilder
from sekv_local.models.registry import resolve_model
from sekv_local.models.tokenizer import Tokenizer
from sekv_local.session import SessionSettings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="gemma3-270m")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", action="store_true", help="per step, where each numbered sentence was zoomed")
    ap.add_argument("--variant", action="append", default=[], help="SeKV options as JSON (repeatable; {} = default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tokenizer = Tokenizer(path)
    suite = generate_suite(args.task, args.length - prompt_overhead(PromptBuilder(tokenizer)), args.samples,
                           args.seed, tokenizer.count)
    sample = suite[args.sample]
    answer = sample.questions[0].answers[0]
    needle = len(tokenizer.encode(sample.document[: sample.document.find(answer)]))
    print(f"{args.task} {args.length} sample {args.sample}: answer {answer}, about document token {needle}")
    for variant in args.variant or ["{}"]:
        options = json.loads(variant)
        engine = create_engine("torch", path, tokenizer, EngineOptions(
            method="sekv", budget=args.budget, threads=args.threads, method_options=options))
        settings = SessionSettings(model=args.model, engine="torch", method="sekv", budget=args.budget,
                                   threads=args.threads, method_options=tuple(sorted(options.items())))
        records, session = run_sample(engine, sample, settings, path, 32)
        zoomed = engine.cache.observations().get("zoomed", [])
        near = [z for z in zoomed if z["start"] - 80 <= needle <= z["start"] + z["length"] + 80]
        rec = records[0]
        inner = getattr(engine.cache, "inner", engine.cache)
        print(f"{variant}: {rec['prediction'][:40]!r} score {rec['score']}, host {rec['host_bytes'] / 2**20:.1f} MiB, "
              f"{len(zoomed)} spans zoomed (pool {inner.zoom_k} planned, {inner._step_zoom_k} at the last step, "
              f"device peak {rec['device_peak_bytes'] / 2**20:.1f} MiB), near the needle: {near}", flush=True)
        if args.steps:
            print_steps(inner, sample.document, tokenizer, answer,
                        session._prefix_tokens)  # spans carry positions in the prompt, not the document


def print_steps(cache, document: str, tokenizer: Tokenizer, answer: str, offset: int) -> None:
    """Per numbered sentence: at each step, the layers in which a span overlapping its number was zoomed
    ('-': none). `offset`: prompt tokens before the document."""
    events = cache._zoom_events
    n_layers = len(cache.layers)
    starts, lengths = cache.span_pos.view(), cache.span_len.view()
    for m in re.finditer(r"\b(\d{7})\b", document):
        at = len(tokenizer.encode(document[: m.start()])) + offset
        spans = torch.nonzero((starts <= at + 8) & (starts + lengths > at - 12)).flatten()  # key and number
        rows = []
        for i, (layer, chosen) in enumerate(events):
            if torch.isin(chosen, spans).any():
                rows.append((i // n_layers, layer))
        steps: dict[int, list[int]] = {}
        for step, layer in rows:
            steps.setdefault(step, []).append(layer)
        mark = "needle" if m.group(1) == answer else "other"
        n_steps = -(-len(events) // n_layers)
        line = " ".join("".join(str(l) for l in steps.get(t, [])) or "-" for t in range(n_steps))
        print(f"  {mark:6} {m.group(1)} at token {at} (spans {spans.tolist()}): {line}")


if __name__ == "__main__":
    main()
