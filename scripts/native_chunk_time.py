"""One prefill chunk over a SeKV memory of a ~4K-token needle document (default model, 25% budget), read by
the native graph and by the torch engine: seconds each, and the native graph's compute buffer.

    python scripts/native_chunk_time.py [--model NAME] [--context N] [--library PATH] [--repeats N]

--library loads another build of the native library (to compare two graphs on the same machine)."""

from __future__ import annotations

import argparse
import time

import torch

from sekv_local.engines.base import EngineOptions
from sekv_local.engines.torch_engine import TorchEngine
from sekv_local.eval.tasks import generate_sample
from sekv_local.models.registry import resolve_model
from sekv_local.models.tokenizer import Tokenizer
from sekv_local.native import build
from sekv_local.native.bindings import NativeModel, load_library
from sekv_local.native.memory_export import native_memory, sekv_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=4100, help="tokens of the document (the chunk is its end)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_path = resolve_model(args.model, show_progress=False)
    tokenizer = Tokenizer(model_path)
    load_library(args.library or build.build())
    sample = generate_sample("niah_single", args.context, seed=7, count_tokens=tokenizer.count, depth=0.5)
    doc = tokenizer.encode(sample.document)
    engine = TorchEngine(model_path, tokenizer, EngineOptions(method="sekv", budget=0.25, threads=2))
    engine.reserve(len(doc) + 300)
    sekv = sekv_of(engine.cache)[0]  # on Gemma 3, SeKV of the global layers beside the windows
    window = engine.config.sliding_window
    chunk = min(sekv.chunk_tokens, window) if window else sekv.chunk_tokens  # the native chunk rule
    head, tail = doc[:-chunk], doc[-chunk:]
    engine.feed(head)
    cache = engine.cache
    rows = cache.score_rows(torch.tensor(tail))
    model = NativeModel(model_path, 2)
    for _ in range(args.repeats):
        started = time.perf_counter()
        memory = native_memory(model, cache, chunk + 1, zoom_k=sekv._step_zoom_k)
        made = time.perf_counter()
        memory.prefill(tail, engine.n_tokens, score_rows=None if rows is None else rows.numpy())
        done = time.perf_counter()
        compute = memory.bytes().compute
        memory.close()
        print(f"native: {chunk} tokens over {engine.n_tokens} ({sekv.span_len.length} spans, pool "
              f"{sekv._step_zoom_k}): memory made {made - started:.2f} s, graph {done - made:.2f} s, "
              f"compute buffer {compute / 2**20:.2f} MiB")
    started = time.perf_counter()
    engine._forward(tail, prefill=True)
    print(f"torch: the same chunk {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
