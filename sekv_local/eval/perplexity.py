"""`sekv-local perplexity`: how well a compressed context still predicts held-out text.

Each sample is a window of natural text (CPython's pydoc prose: the same source as the bench's
haystacks, never used in training): the first `context` tokens are read as a document (chunked
prefill, the method compresses them within its budget), then the next `continuation` tokens are fed
as one more turn and scored. Reported: perplexity = exp(mean negative log-likelihood of the
continuation tokens), per method and budget, all methods on the same windows in one run.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..engines import EngineOptions, create_engine
from ..errors import SekvError
from ..models.registry import resolve_model
from ..models.tokenizer import Tokenizer
from ..method_variant import split_variant
from .runner import method_budgets
from .tasks import natural_text


@dataclass
class PerplexityConfig:
    methods: list[str]
    budgets: list[float | int | None] = field(default_factory=lambda: [None])
    context: int = 4096
    continuation: int = 256
    samples: int = 5
    model: str = "smollm2-135m"
    seed: int = 1
    threads: int | None = None
    chunk_size: int = 1024
    out: str = "runs/perplexity"
    command: str = ""

    def __post_init__(self) -> None:
        if not self.methods:
            raise SekvError("perplexity needs at least one method")
        if self.context < 64 or self.continuation < 2 or self.samples < 1:
            raise SekvError("perplexity needs context >= 64, continuation >= 2 and samples >= 1")
        for method in self.methods:
            split_variant(method)

    def runs(self) -> list[tuple[str, float | int | None]]:
        return list(method_budgets(self.methods, self.budgets))


def text_windows(tokenizer: Tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """n windows of `length` tokens at seeded offsets in the pydoc prose (non-overlapping when it can)."""
    ids = tokenizer.encode(natural_text(10**8))
    if len(ids) < length:
        raise SekvError(f"the text holds {len(ids)} tokens, fewer than one window of {length}")
    slots = len(ids) // length
    rng = random.Random(seed)
    picks = rng.sample(range(slots), n) if n <= slots else [rng.randrange(slots) for _ in range(n)]
    return [ids[s * length: (s + 1) * length] for s in picks]


def run_perplexity(config: PerplexityConfig, show_progress: bool = True) -> dict[str, Path]:
    from tqdm import tqdm

    model_path = resolve_model(config.model, show_progress=show_progress)
    tokenizer = Tokenizer(model_path)
    windows = text_windows(tokenizer, config.samples, config.context + config.continuation, config.seed)
    runs = config.runs()
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(runs) * len(windows), unit="sample", desc="perplexity", file=sys.stderr,
               dynamic_ncols=True, disable=not show_progress)
    for method, budget in runs:
        base, options = split_variant(method)
        engine = create_engine("torch", model_path, tokenizer,
                               EngineOptions(method=base, budget=budget, threads=config.threads,
                                             chunk_size=config.chunk_size, method_options=options))
        for i, window in enumerate(windows):
            engine.reset()
            engine.reserve(len(window))
            engine.feed(window[: config.context])
            engine.finish_prefill()
            logprobs = engine.continuation_logprobs(window[config.context:])
            nll = float(-logprobs.mean())
            memory = engine.memory()  # fractions of the full KV of the whole window (what the budget is of)
            records.append({"method": method, "budget": budget, "sample": i, "nll": nll,
                            "device_peak_fraction": memory.device_peak_fraction,
                            "device_fraction": memory.device_fraction,
                            "observations": engine.observations(), "prefill_s": engine.stats.prefill_s})
            bar.set_postfix_str(f"{method} {budget}: ppl {math.exp(nll):.2f}")
            bar.update(1)
    bar.close()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": asdict(config), "records": records}, indent=1))
    (out / "summary.md").write_text(summary(config, records))
    return {"results": out / "results.json", "summary": out / "summary.md"}


def summary(config: PerplexityConfig, records: list[dict[str, Any]]) -> str:
    lines = [f"# Perplexity of a {config.continuation}-token continuation after a {config.context}-token context",
             "", "```bash", config.command, "```", "",
             "| method | budget | n | perplexity | mean NLL | device peak % of full KV |", "|---|---|---:|---:|---:|---:|"]
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["method"], r["budget"]), []).append(r)
    for (method, budget), rows in groups.items():
        nll = sum(r["nll"] for r in rows) / len(rows)
        peak = max(r["device_peak_fraction"] for r in rows)
        label = "-" if budget is None else (f"{budget:.1%}" if isinstance(budget, float) else f"{budget} B")
        lines.append(f"| {method} | {label} | {len(rows)} | {math.exp(nll):.3f} | {nll:.4f} | {100 * peak:.1f} |")
    return "\n".join(lines) + "\n"
