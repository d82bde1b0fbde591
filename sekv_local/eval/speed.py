"""Time a user waits, per engine/method pair, on one long document, side by side in one run.

Every run loads the model, reads the same natural-English document (prefill), reads a question and
decodes a fixed number of tokens greedily with no stop token, then does the same for a second question on
the same memory. Runs alternate (A B A B ...) so slow drifts of the machine hit all of them alike; the
median over repeats is reported. Nothing is left out of the waits: the first decode step (where the
llama.cpp engine imports the torch-built memory) is inside the time to first token and the answer time;
steady decode tok/s (steps 2..n) is reported beside them.
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
from ..engines.torch_engine import load_transformer
from ..models.gguf_file import forget_opened_models
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


#: what one repeat of a run measures (seconds unless named otherwise)
TIMINGS = ("load_s", "prefill_tok_s", "question_s", "first_step_s", "ttft_s", "decode_tok_s", "answer_s", "total_s",
           "second_ttft_s", "second_answer_s")


@dataclass
class Timing:
    """One repeat. load: engine and model ready; prefill: the document read; question: the first question read;
    first step: the first decode step; ttft: question + first step (the document already read); answer: every
    decode step of the answer; total: load + document + question + answer (from the command to the last
    token); second_*: a second question and its answer on the same memory (a re-import included)."""

    load_s: float
    prefill_tok_s: float
    question_s: float
    first_step_s: float
    ttft_s: float
    decode_tok_s: float  # steps 2..n (steady state)
    answer_s: float
    total_s: float
    second_ttft_s: float
    second_answer_s: float


@dataclass
class SpeedResult:
    run: str
    context_tokens: int
    new_tokens: int
    timings: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in TIMINGS})
    device_peak_bytes: int = 0
    full_kv_bytes: int = 0
    # host bytes gathered per decode step (None: the engine keeps a host tier but does not count its reads)
    reads_per_step_bytes: float | None = None

    def add(self, timing: Timing) -> None:
        for key in TIMINGS:
            self.timings[key].append(getattr(timing, key))

    @property
    def repeats(self) -> int:
        return len(self.timings["answer_s"])

    def medians(self) -> dict[str, float]:
        return {key: statistics.median(values) for key, values in self.timings.items()}


#: read after the document, as a user's question is: methods that act at question time (SeKV's select=question)
#: do it here, and every run pays for it alike
QUESTION = "\n\nQuestion: What is the text above about? Answer in one sentence.\nAnswer:"
SECOND_QUESTION = "\n\nQuestion: Which words of the text above are the most important? Name three.\nAnswer:"


def document_tokens(tokenizer: Tokenizer, n_tokens: int) -> list[int]:
    ids = tokenizer.encode(natural_text())
    if len(ids) < n_tokens:
        raise SekvError(f"the built-in text has only {len(ids)} tokens; ask for fewer than {n_tokens}")
    return ids[:n_tokens]


def _answer(engine, tokenizer: Tokenizer, question: str, new_tokens: int) -> tuple[float, list[float]]:
    """Read `question`, decode new_tokens greedily: (seconds to read it, seconds of each decode step)."""
    start = time.perf_counter()
    engine.feed(tokenizer.encode(question))
    engine.finish_prefill()
    stamps = [time.perf_counter()]
    for _ in engine.generate(new_tokens + 1, stop_ids=frozenset()):
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # each: one _forward of a generated token
    if len(steps) < 2:
        raise SekvError("too few decode steps to time")
    return stamps[0] - start, steps


def measure_once(run: SpeedRun, model: Path, tokenizer: Tokenizer, ids: list[int], new_tokens: int,
                 budget: float | int | None, threads: int, chunk_size: int
                 ) -> tuple[Timing, int, int, float | None]:
    """(the repeat's Timing, device peak bytes, full-KV bytes, host bytes read per decode step of the first
    answer or None where the engine does not count them)."""
    method, method_options = split_variant(run.method)
    options = EngineOptions(method=method, budget=budget if method != "full" else None, threads=threads,
                            chunk_size=chunk_size, method_options=method_options)
    # a user's command loads the model once: the process-wide caches of dequantized weights would hide that
    load_transformer.cache_clear()
    forget_opened_models()
    start = time.perf_counter()
    engine = create_engine(run.engine, model, tokenizer, options)
    try:
        engine.reserve(len(ids) + new_tokens)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.feed(ids)
        engine.finish_prefill()
        prefill_s = time.perf_counter() - start
        engine.reset_observations()
        question_s, steps = _answer(engine, tokenizer, QUESTION, new_tokens)
        memory = engine.memory()
        # a method without a host tier reads nothing from it; one with a tier but no count says so (None)
        reads = memory.host_reads.per_step if memory.host_reads.steps or not memory.host_bytes else None
        second_q, second_steps = _answer(engine, tokenizer, SECOND_QUESTION, new_tokens)
        timing = Timing(load_s=load_s, prefill_tok_s=len(ids) / prefill_s, question_s=question_s,
                        first_step_s=steps[0], ttft_s=question_s + steps[0],
                        decode_tok_s=(len(steps) - 1) / sum(steps[1:]), answer_s=sum(steps),
                        total_s=load_s + prefill_s + question_s + sum(steps),
                        second_ttft_s=second_q + second_steps[0], second_answer_s=sum(second_steps))
        return timing, max(memory.device_peak_bytes, engine.memory().device_peak_bytes), memory.full_kv_bytes, reads
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
            timing, peak, full, reads = measure_once(run, model, tokenizer, ids, new_tokens, budget, threads,
                                                     chunk_size)
            res = results[run.label]
            res.add(timing)
            res.device_peak_bytes, res.full_kv_bytes = max(res.device_peak_bytes, peak), full
            res.reads_per_step_bytes = reads
            progress(f"  prefill {timing.prefill_tok_s:.1f} tok/s, first token {timing.ttft_s:.2f} s, decode "
                     f"{timing.decode_tok_s:.1f} tok/s, answer {timing.answer_s:.2f} s, total {timing.total_s:.2f} s")
    return list(results.values())


def write(results: list[SpeedResult], out: Path, command: str, settings: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "settings": settings,
                                                  "results": [{**asdict(r), "median": r.medians()} for r in results]}, indent=2))
    base = results[0].medians()
    n = results[0].new_tokens
    lines = [f"# Time to answer at {results[0].context_tokens} tokens of context", "", f"`{command}`", "",
             f"Medians over {results[0].repeats} alternating repeats. load s: engine and model ready; prefill: reading "
             f"the document; first token s: reading a short question (where SeKV's select=question pins spans) and "
             f"the first decode step (where the llama.cpp engine imports its memory); answer s: all {n} decode steps, "
             f"the first included; total s: load + document + question + answer, from the command to the last token; "
             f"decode tok/s: steps 2..{n}; 2nd: a second question and its {n}-token answer on the same memory. "
             f"Ratios vs `{results[0].run}` (time ratios: its seconds over this run's).", "",
             "| run | load s | prefill tok/s | first token s | decode tok/s | answer s | answer ratio | total s "
             "| total ratio | 2nd first token s | 2nd answer s | device peak MiB | % of full KV "
             "| host reads/step % of full KV |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.medians()
        lines.append(f"| {r.run} | {m['load_s']:.2f} | {m['prefill_tok_s']:.1f} | {m['ttft_s']:.2f} | "
                     f"{m['decode_tok_s']:.1f} | {m['answer_s']:.2f} | {base['answer_s'] / m['answer_s']:.2f}x | "
                     f"{m['total_s']:.2f} | {base['total_s'] / m['total_s']:.2f}x | {m['second_ttft_s']:.2f} | "
                     f"{m['second_answer_s']:.2f} | {r.device_peak_bytes / 2**20:.1f} | "
                     f"{100 * r.device_peak_bytes / r.full_kv_bytes:.1f}% | "
                     + ("not counted |" if r.reads_per_step_bytes is None
                        else f"{100 * r.reads_per_step_bytes / r.full_kv_bytes:.1f}% |"))
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
