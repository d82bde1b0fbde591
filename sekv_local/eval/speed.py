"""Prefill and decode speed of engine/method pairs on one long document, side by side in one run.

Every run reads the same natural-English document (prefill), then decodes a fixed number of tokens
greedily with no stop token. Runs alternate (A B A B ...) so slow drifts of the machine hit all of them
alike; the median over repeats is reported. The first decode step is timed apart: the llama.cpp engine
imports the torch-built memory there.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..engines.base import EngineOptions
from ..engines.factory import create_engine
from ..errors import SekvError
from ..models.registry import resolve_model
from ..models.tokenizer import Tokenizer
from ..method_variant import split_variant
from .tasks import natural_text


@dataclass(frozen=True)
class SpeedRun:
    engine: str
    method: str

    @classmethod
    def parse(cls, text: str) -> "SpeedRun":
        engine, _, method = text.partition(":")
        if not engine or not method:
            raise SekvError(f"a run is ENGINE:METHOD (e.g. llama.cpp-stock:full), got {text!r}")
        return cls(engine.strip(), method.strip())

    @property
    def label(self) -> str:
        return f"{self.engine}:{self.method}"


@dataclass
class SpeedResult:
    run: str
    context_tokens: int
    new_tokens: int
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)  # steps 2..n (steady state)
    first_step_s: list[float] = field(default_factory=list)
    answer_s: list[float] = field(default_factory=list)  # every decode step of the answer, the first included
    question_s: list[float] = field(default_factory=list)  # reading QUESTION after the document
    device_peak_bytes: int = 0
    full_kv_bytes: int = 0
    # host bytes gathered per decode step (None: the engine keeps a host tier but does not count its reads)
    reads_per_step_bytes: float | None = None

    def medians(self) -> dict[str, float]:
        return {"prefill_tok_s": statistics.median(self.prefill_tok_s),
                "decode_tok_s": statistics.median(self.decode_tok_s),
                "first_step_s": statistics.median(self.first_step_s),
                "answer_s": statistics.median(self.answer_s),
                "question_s": statistics.median(self.question_s) if self.question_s else 0.0}


#: read after the document, as a user's question is: methods that act at question time (SeKV's select=question)
#: do it here, and every run pays for it alike
QUESTION = "\n\nQuestion: What is the text above about? Answer in one sentence.\nAnswer:"


def document_tokens(tokenizer: Tokenizer, n_tokens: int) -> list[int]:
    ids = tokenizer.encode(natural_text())
    if len(ids) < n_tokens:
        raise SekvError(f"the built-in text has only {len(ids)} tokens; ask for fewer than {n_tokens}")
    return ids[:n_tokens]


def measure_once(run: SpeedRun, model: Path, tokenizer: Tokenizer, ids: list[int], new_tokens: int,
                 budget: float | int | None, threads: int, chunk_size: int
                 ) -> tuple[float, float, float, int, int, float | None, float, float]:
    """(prefill tok/s, steady decode tok/s, first decode step s, device peak bytes, full-KV bytes, host bytes read
    per decode step or None where the engine does not count them, seconds to read the question, seconds of
    the whole answer's decode steps)."""
    method, method_options = split_variant(run.method)
    options = EngineOptions(method=method, budget=budget if method != "full" else None, threads=threads,
                            chunk_size=chunk_size, method_options=method_options)
    engine = create_engine(run.engine, model, tokenizer, options)
    try:
        engine.reserve(len(ids) + new_tokens)
        start = time.perf_counter()
        engine.feed(ids)
        engine.finish_prefill()
        prefill_s = time.perf_counter() - start
        engine.reset_observations()
        start = time.perf_counter()
        engine.feed(tokenizer.encode(QUESTION))
        engine.finish_prefill()
        question_s = time.perf_counter() - start
        stamps = [time.perf_counter()]
        for _ in engine.generate(new_tokens + 1, stop_ids=frozenset()):
            stamps.append(time.perf_counter())
        steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # each: one _forward of a generated token
        if len(steps) < 2:
            raise SekvError("too few decode steps to time")
        memory = engine.memory()
        # a method without a host tier reads nothing from it; one with a tier but no count says so (None)
        reads = memory.host_reads.per_step if memory.host_reads.steps or not memory.host_bytes else None
        return (len(ids) / prefill_s, (len(steps) - 1) / sum(steps[1:]), steps[0], memory.device_peak_bytes,
                memory.full_kv_bytes, reads, question_s, sum(steps))
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def measure(runs: list[SpeedRun], model_name: str, context_tokens: int, new_tokens: int, budget: float | int | None,
            threads: int, repeats: int, chunk_size: int = 1024,
            progress: Callable[[str], None] = lambda _: None) -> list[SpeedResult]:
    model = resolve_model(model_name)
    tokenizer = Tokenizer(model)
    ids = document_tokens(tokenizer, context_tokens)
    results = {r.label: SpeedResult(r.label, len(ids), new_tokens) for r in runs}
    for rep in range(repeats):
        for run in runs:
            progress(f"repeat {rep + 1}/{repeats}: {run.label}")
            prefill, decode, first, peak, full, reads, question, answer = measure_once(
                run, model, tokenizer, ids, new_tokens, budget, threads, chunk_size)
            res = results[run.label]
            res.prefill_tok_s.append(prefill)
            res.decode_tok_s.append(decode)
            res.first_step_s.append(first)
            res.answer_s.append(answer)
            res.device_peak_bytes, res.full_kv_bytes = max(res.device_peak_bytes, peak), full
            res.reads_per_step_bytes = reads
            res.question_s.append(question)
            progress(f"  prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s, first step {first:.2f} s")
    return list(results.values())


def write(results: list[SpeedResult], out: Path, command: str, settings: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "settings": settings,
                                                  "results": [{**asdict(r), "median": r.medians()} for r in results]}, indent=2))
    base = results[0].medians()
    lines = [f"# Speed at {results[0].context_tokens} tokens of context", "", f"`{command}`", "",
             f"Medians over {len(results[0].decode_tok_s)} alternating repeats; decode = steady state over "
             f"{results[0].new_tokens} generated tokens (first step apart); question s = reading a short question after "
             f"the document (where SeKV's select=question pins spans); answer s = all {results[0].new_tokens} decode "
             f"steps, the first (memory import) included; ratios vs `{results[0].run}` (answer ratio: its answer s "
             f"over this run's).", "",
             "| run | prefill tok/s | question s | decode tok/s | decode ratio | first step s | answer s | answer ratio "
             "| prefill ratio | device peak MiB | % of full KV | host reads/step % of full KV |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.medians()
        lines.append(f"| {r.run} | {m['prefill_tok_s']:.1f} | {m['question_s']:.2f} | {m['decode_tok_s']:.1f} | "
                     f"{m['decode_tok_s'] / base['decode_tok_s']:.2f}x | {m['first_step_s']:.2f} | {m['answer_s']:.2f} | "
                     f"{base['answer_s'] / m['answer_s']:.2f}x | {m['prefill_tok_s'] / base['prefill_tok_s']:.2f}x | "
                     f"{r.device_peak_bytes / 2**20:.1f} | "
                     f"{100 * r.device_peak_bytes / r.full_kv_bytes:.1f}% | "
                     + ("not counted |" if r.reads_per_step_bytes is None
                        else f"{100 * r.reads_per_step_bytes / r.full_kv_bytes:.1f}% |"))
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
