"""The native engine's GPU check, in one process: build, parity of the GPU path against the CPU path,
decode speed against stock llama.cpp at long contexts. Run by native/gpu_check.sh on a GPU machine;
`--device cpu` runs the same steps here (the scheduler path stands in for the GPU).

The GPU machine reaches no network and takes at most 64 MiB of files, so the model is a synthetic
GGUF of SmolLM2-135M's shape with random weights (synthetic_model.py): enough for engine-against-engine
parity and for speed, never for accuracy.

    python -m sekv_local.native.gpu_check --device cuda --contexts 8k,32k,128k --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from . import build, probe
from .bindings import NativeModel, load_library
from .synthetic_model import LlamaShape, write_random_llama

PARITY_STEPS = 8


def log(line: str) -> None:
    print(line, flush=True)


def set_random_router(models: list[NativeModel], routing_dim: int = 32, seed: int = 3) -> None:
    """The same random learned router on every model, its thresholds around the logits a span of 64 rows
    gets here (log 64 plus a small q'.k'), so some top-k slots are filled and some left empty."""
    info = models[0].info
    rng = np.random.default_rng(seed)
    q_proj = rng.standard_normal((info.n_layer, info.head_dim, routing_dim)) / np.sqrt(info.head_dim)
    threshold = np.log(64) + rng.uniform(-0.05, 0.15, size=(info.n_layer, info.n_head))
    for model in models:
        model.set_router(q_proj, threshold)


def parity(model_under_test: NativeModel, reference: NativeModel, scheduler: bool,
           learned_router: bool = False) -> list[dict]:
    """Same synthetic memory (seeded) and tokens on both models; per step: KL(reference || tested),
    max |dlogit|, both argmaxes, and the share of zoomed (layer, KV head, span) choices they share
    (with the learned router: a slot it left empty counts as the choice -1)."""
    shape = probe.MemoryShape(2048, zoom_k=16)
    if learned_router:
        set_random_router([model_under_test, reference])
    tested = probe.synthetic_memory(model_under_test, shape, room=PARITY_STEPS + 2, seed=1, scheduler=scheduler,
                                    learned_router=learned_router)
    ref = probe.synthetic_memory(reference, shape, room=PARITY_STEPS + 2, seed=1, learned_router=learned_router)
    tokens = np.random.default_rng(2).integers(1000, reference.info.n_vocab, size=PARITY_STEPS)
    steps = []
    for i, token in enumerate(tokens):
        a, b = ref.decode(int(token), shape.n_tokens + i), tested.decode(int(token), shape.n_tokens + i)
        p = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
        q = np.exp(b - b.max()) / np.exp(b - b.max()).sum()
        picked = {(layer, h, s) for layer in range(reference.info.n_layer)
                  for h, row in enumerate(ref.last_zoom(layer)) for s in row}
        same = {(layer, h, s) for layer in range(reference.info.n_layer)
                for h, row in enumerate(tested.last_zoom(layer)) for s in row}
        steps.append({"kl": float((p * (np.log(p + 1e-30) - np.log(q + 1e-30))).sum()),
                      "max_dlogit": float(np.abs(a - b).max()), "argmax": [int(a.argmax()), int(b.argmax())],
                      "zoom_agreement": len(picked & same) / max(len(picked), 1),
                      "empty_slots": int(sum((ref.last_zoom(layer) < 0).sum() for layer in range(reference.info.n_layer)))})
    tested.close()
    ref.close()
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--contexts", default="8k,32k,128k")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=LlamaShape().n_layer)
    parser.add_argument("--arch", default="90", help="CUDA architecture to compile for (90: H100/H200)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    args = parser.parse_args(argv)
    from ..eval.tasks import parse_length

    contexts = [parse_length(c) for c in args.contexts.split(",") if c.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": args.device, "argv": sys.argv[1:]}

    start = time.perf_counter()
    cuda = args.device == "cuda"
    library = build.build(cuda=cuda, log=lambda line: log(f"[build] {line}"),
                          cuda_archs=(args.arch,) if cuda else None)
    report["build_s"] = round(time.perf_counter() - start, 1)
    log(f"library: {library} ({report['build_s']} s)")
    load_library(library, cuda=cuda)

    gguf = write_random_llama(args.out / "synthetic-smollm2-shape.gguf", LlamaShape(n_layer=args.layers))
    tested = NativeModel(gguf, args.threads, gpu=cuda)
    reference = NativeModel(gguf, args.threads)
    log(f"model: {gguf.name}, tested on {'GPU' if tested.on_gpu else 'CPU (scheduler path)'}, reference on CPU")

    steps = []
    for learned in (False, True):
        router = "learned router" if learned else "training-free router"
        for s in parity(tested, reference, scheduler=not cuda, learned_router=learned):
            steps.append({**s, "router": router})
            log(f"parity ({router}): KL {s['kl']:.2e}, max |dlogit| {s['max_dlogit']:.4f}, argmax {s['argmax']}, "
                f"zoom agreement {s['zoom_agreement']:.3f}, empty slots {s['empty_slots']}")
    report["parity"] = steps
    reference.close()

    results = probe.probe(tested, contexts, args.new_tokens, args.repeats, zoom_k=16, progress=log)
    report["speed"] = [{**asdict(r), "summary": r.summary()} for r in results]
    summary = probe.write(results, args.out, "python -m sekv_local.native.gpu_check " + " ".join(sys.argv[1:]),
                          {"device": args.device, "model": "synthetic, SmolLM2-135M shape, f16"})
    log(summary.read_text())
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    ok = all(s["argmax"][0] == s["argmax"][1] and s["kl"] < 1e-3 for s in steps)
    log(f"parity {'OK' if ok else 'FAILED'}; total {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
