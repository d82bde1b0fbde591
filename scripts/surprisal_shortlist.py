"""How well surprisal over a vocabulary shortlist tracks the exact surprisal, and how many of SeKV's span
boundaries it keeps: N tokens of Python's own documentation (`pydoc_data.topics`) read once with full KV,
then every token's surprisal normalised over the whole vocabulary and over several shortlists.

    python scripts/surprisal_shortlist.py --model gemma3-270m --tokens 3000
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pydoc_data.topics
import torch

from sekv_local.engines import EngineOptions, create_engine
from sekv_local.models.registry import resolve_model
from sekv_local.models.tokenizer import Tokenizer
from sekv_local.sekv.segmentation import segment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model, show_progress=False)
    tokenizer = Tokenizer(path)
    ids = tokenizer.encode("\n\n".join(list(pydoc_data.topics.topics.values())[40:100]))[: args.tokens]
    engine = create_engine("torch", path, tokenizer, EngineOptions(method="full", budget=None, threads=args.threads))
    model, hidden = engine.model, []
    scores = model._scores

    def keep_hidden(x, tokens, rows=None):  # the final-normed rows that predict the chunk's next tokens
        hidden.append(x[:-1].clone())
        return scores(x[-2:], tokens[-2:], rows)

    model._scores = keep_hidden
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(ids), 512):
            chunk = ids[first: first + 512]
            engine.cache.begin_chunk(torch.arange(first, first + len(chunk)), is_prefill=True)
            model(torch.tensor(chunk), engine.cache, logits="scores")
            engine.cache.end_chunk(None, torch.tensor(chunk))
    x = torch.cat(hidden)
    targets = torch.cat([torch.tensor(ids[a + 1: a + 512]) for a in range(0, len(ids), 512)])
    print(f"{args.model}: {len(ids)} tokens read in {time.perf_counter() - started:.1f} s, vocabulary "
          f"{model.config.vocab_size}")

    def surprisal(rows: torch.Tensor | None) -> torch.Tensor:
        out = []
        with torch.inference_mode():
            for a in range(0, x.shape[0], 256):
                logits, y = model._head(x[a: a + 256]).float(), targets[a: a + 256]
                target = logits.gather(1, y[:, None])[:, 0]
                lse = torch.logsumexp(logits if rows is None else logits[:, rows], -1)
                if rows is not None:  # a target outside the shortlist joins its normaliser
                    lse = torch.where(torch.isin(y, rows), lse, torch.logaddexp(lse, target))
                out.append(lse - target)
        return torch.cat(out)

    def cuts(s: torch.Tensor) -> set[int]:
        seg = segment(s, float(s.mean() + s.std()), 8, 64, 0, flush=True)
        return set(seg.span_start.tolist())

    exact = surprisal(None)
    exact_cuts = cuts(exact)
    text = torch.unique(torch.tensor(ids))
    noise = torch.Generator().manual_seed(0)
    variants = {f"exact + N(0, {s}) nats": exact + s * torch.randn(exact.shape, generator=noise) for s in (0.05, 0.2)}
    for k in (8192, 32768):
        variants[f"first {k} rows"] = surprisal(torch.arange(k))
    variants[f"the text's {len(text)} tokens"] = surprisal(text)
    for k in (4096, 16384):
        variants[f"first {k} rows + the text's"] = surprisal(torch.unique(torch.cat([text, torch.arange(k)])))
    print(f"exact: {len(exact_cuts)} spans")
    print("| normaliser | correlation with exact | mean abs difference (nats) | spans | span starts kept |")
    print("|---|---:|---:|---:|---:|")
    for name, s in variants.items():
        c = cuts(s)
        print(f"| {name} | {np.corrcoef(exact.numpy(), s.numpy())[0, 1]:.4f} | {float((s - exact).abs().mean()):.3f} "
              f"| {len(c)} | {len(c & exact_cuts) / len(exact_cuts):.1%} |")


if __name__ == "__main__":
    main()
