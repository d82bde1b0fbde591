"""`sekv-local bench`: a grid of engines x methods x budgets x tasks x lengths x samples, resumable."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..cache.budget import parse_budget
from ..documents import Document
from ..engines import EngineOptions, create_engine
from ..engines.base import Engine
from ..errors import BudgetError, DocumentError, SekvError
from ..method_variant import parse_method_options, split_variant
from ..models.prompt import PromptBuilder
from ..models.registry import resolve_model
from ..models.tokenizer import Tokenizer
from ..session import ANSWER_RESERVE, Session, SessionSettings
from .report import write_report
from .scoring import score
from .tasks import TASKS, Sample, generate_suite, parse_length

#: answer length per task: enough for the reference answers, short enough to keep the grid fast
MAX_NEW_TOKENS = {"niah_single": 24, "niah_multikey": 24, "niah_multivalue": 64, "niah_multiquery": 64,
                  "variable_tracking": 48, "common_words": 96, "doc_qa": 24, "multiturn_niah": 24}
#: methods the stock llama.cpp engine can run
STOCK_METHODS = ("full", "quant-q8_0", "quant-q4_0")
#: --shared-prefill: the engine whose ingested memory the other adopts
SHARED_PREFILL_SOURCE, SHARED_PREFILL_TARGET = "torch", "llama.cpp"
#: methods that keep everything and therefore take no budget
UNBUDGETED = ("full", "quant-q8_0", "quant-q4_0", "quant")
#: a variant key that sets the run's budget rather than a method option (sekv@budget=0.125)
VARIANT_BUDGET = "budget"


@dataclass
class BenchConfig:
    tasks: list[str]
    lengths: list[int]
    samples: int
    engines: list[str]
    methods: list[str]
    budgets: list[float | int | None] = field(default_factory=lambda: [None])  # fractions or bytes
    model: str = "smollm2-135m"
    seed: int = 1
    threads: int | None = None
    chunk_size: int = 1024
    out: str = "runs/bench"
    command: str = ""
    plots_dir: str | None = None
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the llama.cpp engine adopts the torch engine's ingested memory of the same cell (its prefill is the
    # torch engine's): cells run engine after engine, sample by sample, and each document is read once
    shared_prefill: bool = False
    # sample by sample: every method answers a question before the next question, so a run stopped
    # early still compares the methods on the same questions
    interleave: bool = False
    device: str = "cpu"  # where the torch engine runs (and the llama.cpp engine's prefill): cpu, cuda or auto

    def __post_init__(self) -> None:
        from ..engines.torch_engine import resolve_device

        self.device = resolve_device(self.device)  # a missing GPU fails here, before any work
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise SekvError(f"unknown task(s) {', '.join(unknown)} (available: {', '.join(TASKS)})")
        if not self.tasks or not self.lengths or not self.engines or not self.methods:
            raise SekvError("bench needs at least one task, length, engine and method")
        for method in self.methods:
            split_variant(method)  # a malformed variant fails here, before any work
        if self.shared_prefill and not {SHARED_PREFILL_SOURCE, SHARED_PREFILL_TARGET} <= set(self.engines):
            raise SekvError(f"--shared-prefill lets the {SHARED_PREFILL_TARGET} engine reuse the {SHARED_PREFILL_SOURCE} "
                            f"engine's prefill: run both (--engine {SHARED_PREFILL_SOURCE},{SHARED_PREFILL_TARGET})")

    @classmethod
    def from_cli(cls, tasks: str, lengths: str, samples: int, engines: str, methods_: str, budgets: str, model: str,
                 seed: int, threads: int | None, chunk_size: int, out: Path, quick: bool, command: str,
                 option: tuple[str, ...] = (), plots_dir: Path | None = None,
                 shared_prefill: bool = False, interleave: bool = False, device: str = "cpu") -> "BenchConfig":
        def split(text: str) -> list[str]:
            return [p.strip() for p in text.split(",") if p.strip()]

        if quick:
            tasks, lengths, samples = "niah_single", "1k", 2
        try:
            length_list = [parse_length(x) for x in split(lengths)]
        except ValueError as exc:
            raise SekvError(str(exc)) from None
        budget_list: list[float | int | None] = [parse_budget(b) for b in split(budgets)]
        return cls(tasks=split(tasks), lengths=length_list, samples=samples, engines=split(engines),
                   methods=split(methods_), budgets=budget_list or [None], model=model, seed=seed, threads=threads,
                   chunk_size=chunk_size, out=str(out), command=command, method_options=parse_method_options(option),
                   plots_dir=str(plots_dir) if plots_dir else None, shared_prefill=shared_prefill,
                   interleave=interleave, device=device)

    def options_of(self, method: str) -> dict[str, Any]:
        """Options of a method label: --option settings of its base method, then the variant's own."""
        base, variant = split_variant(method)
        variant.pop(VARIANT_BUDGET, None)
        return {**self.method_options.get(base, {}), **variant}

    def method_budgets(self) -> Iterator[tuple[str, float | None]]:
        return method_budgets(self.methods, self.budgets)


def method_budgets(methods: list[str], budgets: list[float | int | None]) -> Iterator[tuple[str, float | None]]:
    """(method, budget) runs: unbudgeted methods once with None, a variant naming its own budget
    (``sekv@budget=0.125``) once with it, the others once per budget."""
    for method in methods:
        base, variant = split_variant(method)
        if base in UNBUDGETED:
            if VARIANT_BUDGET in variant:
                raise SekvError(f"method '{base}' takes no budget (in '{method}')")
            yield method, None
        elif VARIANT_BUDGET in variant:
            yield method, parse_budget(str(variant[VARIANT_BUDGET]))
        else:
            for budget in budgets:
                if budget is None:
                    raise SekvError(f"method '{method}' needs --budgets")
                yield method, budget


def _cell_key(engine: str, method: str, budget: float | None, task: str, length: int, sample: int,
              options: dict[str, Any] | None = None) -> str:
    return f"{engine}|{method}|{budget}|{task}|{length}|{sample}|{json.dumps(options or {}, sort_keys=True)}"


def _check_same_questions(previous: dict[str, Any], config: BenchConfig, path: Path) -> None:
    """A resumed run must ask the same questions: sample i's seed comes from --seed and its needle depth
    from --samples (depths spread evenly over the suite), so a different count would silently mix
    questions of two suites under the same sample index."""
    for name, flag in (("samples", "--samples"), ("seed", "--seed")):
        before, now = previous.get(name), getattr(config, name)
        if before is not None and before != now:
            raise SekvError(f"{path} was run with {flag} {before}, this run asks for {flag} {now}: the "
                            f"questions would differ under the same sample numbers; use {flag} {before} "
                            f"to resume it, or another --out")


def _atomic_write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def prompt_overhead(prompt: PromptBuilder) -> int:
    """Tokens around the document: prefix + a typical question turn + slack."""
    question = "What is the special magic number for brave-lion mentioned in the provided text? " \
               "Answer with the number only."
    return len(prompt.document_tokens("")[0]) + len(prompt.turn_tokens([], question)) + 16


def run_sample(engine: Engine, sample: Sample, settings: SessionSettings, model_path: Path,
               max_new_tokens: int, adopt_from: Session | None = None) -> tuple[list[dict[str, Any]], Session]:
    """Ingest one sample's document (or adopt `adopt_from`'s memory of it), ask its questions in turn
    (multi-turn keeps the conversation). Returns the records and the session."""
    session = Session(engine, Document.from_text(sample.document), settings, model_path)
    engine.reset_stats()
    if adopt_from is not None:
        session.adopt(adopt_from)
    else:
        session.ingest()
    # an adopted memory cost this engine nothing to read: its prefill numbers count the questions only
    ingest_s = session.ingest_s if adopt_from is None else 0.0
    records = []
    for turn, question in enumerate(sample.questions):
        answer = session.answer(question.text, max_new_tokens=max_new_tokens)
        mem = answer.memory
        records.append({
            "task": sample.task, "seed": sample.seed, "turn": turn,
            "depth": question.meta.get("depth", sample.meta.get("depth")),
            "score": score(answer.text, question), "prediction": answer.text, "answers": question.answers,
            "n_tokens": session.document_tokens + answer.prompt_tokens,
            "prefill_s": ingest_s + answer.prefill_s if turn == 0 else answer.prefill_s,
            "prefill_tokens": engine.stats.prefill_tokens if turn == 0 else answer.prompt_tokens,
            "decode_s": answer.decode_s, "decode_tokens": answer.n_tokens,
            "device_bytes": mem["device_bytes"], "device_peak_bytes": mem["device_peak_bytes"],
            "host_bytes": mem["host_bytes"], "checkpoint_bytes": mem.get("checkpoint_bytes", 0),
            "full_kv_bytes": mem["full_kv_bytes"],
            "host_reads_per_step_bytes": mem.get("host_reads_per_step_bytes", 0),
            **({"engine_notes": list(engine.notices)} if engine.notices else {}),
            **({"ingest_shared_from": adopt_from.settings.engine} if adopt_from is not None else {}),
        })
    return records, session


def plan_cells(config: BenchConfig, done: set[str] = frozenset()) -> list[tuple[str, str, float | None, int, str, int]]:
    """The cells still to run, (engine, method, budget, length, task, sample), in run order: engine by
    engine and method by method; with shared_prefill each cell's engines back to back; with interleave
    every method (and engine) on one sample before the next sample."""
    plan = []
    for engine_name in config.engines:
        for method, budget in config.method_budgets():
            if engine_name == "llama.cpp-stock" and split_variant(method)[0] not in STOCK_METHODS:
                print(f"skipping {method} on {engine_name} (it runs {', '.join(STOCK_METHODS)})", file=sys.stderr)
                continue
            for length in config.lengths:
                for task in config.tasks:
                    for i in range(config.samples):
                        if _cell_key(engine_name, method, budget, task, length, i,
                                     config.options_of(method)) not in done:
                            plan.append((engine_name, method, budget, length, task, i))
    groups = list(config.method_budgets())

    def order(c: tuple) -> tuple:
        engine, group, where = config.engines.index(c[0]), groups.index((c[1], c[2])), \
            (config.lengths.index(c[3]), config.tasks.index(c[4]), c[5])
        if config.interleave:
            return (*where, group, engine) if config.shared_prefill else (*where, engine, group)
        return (group, *where, engine) if config.shared_prefill else (engine, group, *where)

    return sorted(plan, key=order)


def run_bench(config: BenchConfig, show_progress: bool = True) -> dict[str, Path]:
    from tqdm import tqdm

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results: dict[str, Any] = {"config": asdict(config), "records": [], "refused": []}
    if results_path.exists():
        try:
            previous = json.loads(results_path.read_text())
            _check_same_questions(previous.get("config", {}), config, results_path)
            for part in ("records", "refused"):
                results[part] = [r for r in previous.get(part, []) if r.get("model") == config.model]
        except (json.JSONDecodeError, OSError):
            print(f"warning: {results_path} is unreadable; starting it afresh", file=sys.stderr)
    done = {_cell_key(r["engine"], r["method"], r["budget"], r["task"], r["length"], r["sample"],
                      r.get("method_options")) for r in results["records"] + results["refused"]}

    model_path = resolve_model(config.model, show_progress=show_progress)
    tokenizer = Tokenizer(model_path)
    prompt = PromptBuilder(tokenizer)
    overhead = prompt_overhead(prompt)
    suites: dict[tuple[str, int], list[Sample]] = {}

    plan = plan_cells(config, done)
    bar = tqdm(total=len(plan), desc="bench", unit="sample", disable=not show_progress, file=sys.stderr,
               dynamic_ncols=True)
    engines: dict[str, tuple[Any, Engine]] = {}  # engine name -> (key, engine): the live ones
    source: tuple[Any, Session] | None = None  # the last cell the source engine ran, for the target to adopt
    scores: list[float] = []
    for engine_name, method, budget, length, task, i in plan:
        base_method = split_variant(method)[0]
        options = config.options_of(method)
        if engine_name == "llama.cpp-stock":  # llama.cpp allocates its whole context up front: size it
            options["n_ctx"] = -(-(length + ANSWER_RESERVE + 64) // 256) * 256
        key = (engine_name, method, budget, length if engine_name == "llama.cpp-stock" else None)
        if (task, length) not in suites:
            suites[(task, length)] = generate_suite(task, length - overhead, config.samples, config.seed,
                                                    tokenizer.count)
        sample = suites[(task, length)][i]
        settings = SessionSettings(model=config.model, engine=engine_name, method=base_method, budget=budget,
                                   threads=config.threads, chunk_size=config.chunk_size, device=config.device,
                                   method_options=tuple(sorted(options.items())))
        started = time.perf_counter()
        cell = {"engine": engine_name, "method": method, "budget": budget, "model": config.model,
                "method_options": config.options_of(method), "task": task, "length": length,
                "sample": i}
        cell_id = (method, budget, length, task, i)
        try:
            if engines.get(engine_name, (None,))[0] != key:
                if not config.shared_prefill:
                    engines.clear()  # one engine alive at a time
                engines.pop(engine_name, None)
                engines[engine_name] = (key, create_engine(engine_name, model_path, tokenizer, EngineOptions(
                    method=base_method, budget=budget, threads=config.threads, chunk_size=config.chunk_size,
                    device=config.device, method_options=options)))
            adopt = source[1] if (config.shared_prefill and engine_name == SHARED_PREFILL_TARGET and source
                                  and source[0] == cell_id) else None
            records, session = run_sample(engines[engine_name][1], sample, settings, model_path,
                                          MAX_NEW_TOKENS.get(task, 32), adopt_from=adopt)
            if config.shared_prefill and engine_name == SHARED_PREFILL_SOURCE:
                source = (cell_id, session)
        except (BudgetError, DocumentError) as exc:  # cannot run at this budget or length: say so in the report
            results["refused"].append({**cell, "reason": str(exc)})
            records = []
        for r in records:
            r.update({**cell, "wall_s": round(time.perf_counter() - started, 3)})
            scores.append(r["score"])
        results["records"].extend(records)
        _atomic_write_json(results_path, results)
        acc = f"acc {100 * sum(scores) / len(scores):.0f}%" if scores else "refused"
        bar.set_postfix_str(f"{engine_name}/{method}/{task}/{length}: {acc}")
        bar.update(1)
    bar.close()
    paths = write_report(results, out, title=f"sekv-local bench — {config.model}",
                         plots_dir=Path(config.plots_dir) if config.plots_dir else None)
    return {"results": results_path, **paths}
