"""The check a method's own memory report cannot fool: how much the process's resident memory grows.

In a fresh process (``python -m sekv_local.eval.process_memory``): load the model, then read a needle
document of the given length with one method, ask its question and decode an answer, and compare the growth
of the process's resident memory (peak and at the end) with what the method reports (device peak + host
bytes). What the report leaves out is given as a share of full KV's bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from dataclasses import asdict, dataclass

from ..allocator import give_back_freed_memory, release_compute_pools, reset_peak, resident_bytes

#: a method's report may leave out at most this share of full KV's bytes (transients, allocator slack)
UNREPORTED_LIMIT = 0.10
MODULE = "sekv_local.eval.process_memory"


@dataclass
class ProcessMemory:
    """Bytes of one read-and-answer: resident growth after the model was loaded vs the method's report."""

    method: str
    engine: str
    model: str
    tokens: int
    full_kv_bytes: int
    reported_peak_bytes: int  # device peak + host + checkpoints
    reported_end_bytes: int  # device + host + checkpoints now
    resident_peak_growth: int
    resident_end_growth: int
    device_bytes: int = 0
    host_bytes: int = 0
    checkpoint_bytes: int = 0
    full_kv_held_bytes: int = 0  # what full KV holds for this model (window layers at their window)

    @property
    def unreported_peak(self) -> float:
        """Peak resident growth not in the report, as a share of full KV's bytes."""
        return (self.resident_peak_growth - self.reported_peak_bytes) / self.full_kv_bytes

    @property
    def unreported_end(self) -> float:
        return (self.resident_end_growth - self.reported_end_bytes) / self.full_kv_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "unreported_peak": round(self.unreported_peak, 4),
                "unreported_end": round(self.unreported_end, 4)}


def measure(method: str, model: str, tokens: int, budget: float | None, engine: str = "torch",
            threads: int | None = None, answer_tokens: int = 32, seed: int = 1) -> ProcessMemory:
    """Read a `tokens`-token niah_single document with `method`, ask and answer; call in a fresh process."""
    give_back_freed_memory()
    from ..documents import Document
    from ..engines.factory import create_engine
    from ..models.registry import resolve_model
    from ..models.tokenizer import Tokenizer
    from ..method_variant import split_variant
    from ..session import Session, SessionSettings
    from .tasks import generate_sample

    path = resolve_model(model, show_progress=False)
    tokenizer = Tokenizer(path)
    sample = generate_sample("niah_single", tokens, seed, lambda text: len(tokenizer.encode(text)))
    base_method, options = split_variant(method)  # "sekv@host_quant=q8_0": a method with its options
    settings = SessionSettings(model=model, engine=engine, method=base_method, budget=budget, threads=threads,
                               max_new_tokens=answer_tokens, method_options=tuple(sorted(options.items())))
    eng = create_engine(engine, path, tokenizer, settings.engine_options())
    # a third of the document: on Gemma 3 a budget of a shorter one would not hold the sliding windows
    warm_text = sample.document[: max(8000, len(sample.document) // 3)]
    warm = Session(eng, Document.from_text(warm_text), settings, path)
    warm.ingest()  # code paths and thread pools warm; the engine goes, the loaded model stays (cached per process)
    warm.answer(sample.questions[0].text, max_new_tokens=2)
    del warm, eng
    gc.collect()
    release_compute_pools()  # what loading freed is not the method's to give back
    base, _ = resident_bytes()
    reset_peak()
    eng = create_engine(engine, path, tokenizer, settings.engine_options())
    session = Session(eng, Document.from_text(sample.document), settings, path)
    session.ingest()
    session.answer(sample.questions[0].text)
    gc.collect()
    end, peak = resident_bytes()
    report = eng.memory()
    return ProcessMemory(method, engine, model, eng.n_tokens, report.full_kv_bytes,
                         report.total_bytes - report.device_bytes + report.device_peak_bytes, report.total_bytes,
                         peak - base, end - base, report.device_bytes, report.host_bytes, report.checkpoint_bytes,
                         report.held_baseline)


def measure_in_fresh_process(method: str, model: str, tokens: int, budget: float | None, engine: str = "torch",
                             threads: int | None = None, timeout: float = 3600) -> ProcessMemory:
    """:func:`measure` in a new interpreter, so that nothing an earlier read left behind is counted."""
    command = [sys.executable, "-m", MODULE, "--method", method, "--model", model, "--tokens", str(tokens),
               "--engine", engine, "--json"]
    if budget is not None:
        command += ["--budget", str(budget)]
    if threads:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    fields = json.loads(done.stdout.strip().splitlines()[-1])
    return ProcessMemory(**{k: fields[k] for k in ProcessMemory.__dataclass_fields__})


def markdown(results: list[dict]) -> str:
    """One row per method: the report's parts, what the process grew by, and both denominators."""
    mib = 1 << 20
    head = ("| method | device MiB | host MiB | kept MiB | total MiB | total % of full KV held "
            "| total % of full KV, every layer | resident end MiB "
            "| unreported end | reported peak MiB | resident peak MiB | unreported peak |\n" + "|---" * 12 + "|")
    rows = []
    for r in results:
        name = f"{r['method']}{'' if r['engine'] == 'torch' else ' (' + r['engine'] + ')'}"
        if "error" in r:
            rows.append(f"| {name} | {r['error']} |" + " |" * 10)
            continue
        held = r.get("full_kv_held_bytes") or r["full_kv_bytes"]
        rows.append(f"| {name} "
                    f"| {r['device_bytes'] / mib:.1f} | {r['host_bytes'] / mib:.1f} | {r['checkpoint_bytes'] / mib:.1f} "
                    f"| {r['reported_end_bytes'] / mib:.1f} | {100 * r['reported_end_bytes'] / held:.1f} "
                    f"| {100 * r['reported_end_bytes'] / r['full_kv_bytes']:.1f} "
                    f"| {r['resident_end_growth'] / mib:.1f} | {100 * r['unreported_end']:+.1f}% "
                    f"| {r['reported_peak_bytes'] / mib:.1f} | {r['resident_peak_growth'] / mib:.1f} "
                    f"| {100 * r['unreported_peak']:+.1f}% |")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="sekv", help="a method, a comma-separated list, or 'all' (each in a "
                                                           "fresh process)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=7168)
    parser.add_argument("--budget", type=float, default=0.25, help="for methods that take one")
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    parser.add_argument("--json", action="store_true", help="measure in this process; one JSON line")
    args = parser.parse_args(argv)
    from ..cache import available_policies
    from .runner import UNBUDGETED

    def budget_of(method: str) -> float | None:
        return None if method in UNBUDGETED else args.budget

    if args.json:
        print(json.dumps(measure(args.method, args.model, args.tokens, budget_of(args.method), args.engine,
                                 args.threads).as_dict()))
        return
    methods = available_policies() if args.method == "all" else args.method.split(",")
    results = []
    mib = 1 << 20
    for method in methods:
        try:
            r = measure_in_fresh_process(method, args.model, args.tokens, budget_of(method), args.engine, args.threads)
        except RuntimeError as e:  # a method that cannot read this document (refused, or failed): its row says why
            lines = [line for line in str(e).splitlines() if line.strip()]
            results.append({"method": method, "engine": args.engine, "error": lines[-1][:200] if lines else "failed"})
            print(f"{method:12s} ({args.engine}, {args.model}, {args.tokens} tokens): {results[-1]['error']}", flush=True)
            continue
        results.append(r.as_dict())
        print(f"{r.method:12s} ({r.engine}, {r.model}, {r.tokens} tokens): resident growth peak "
              f"{r.resident_peak_growth / mib:6.1f} MiB, end {r.resident_end_growth / mib:6.1f} MiB; reported "
              f"peak {r.reported_peak_bytes / mib:6.1f}, end {r.reported_end_bytes / mib:6.1f}; unreported "
              f"{r.unreported_peak:+7.1%} (peak) {r.unreported_end:+7.1%} (end) of full KV "
              f"({r.full_kv_bytes / mib:.1f} MiB)", flush=True)
    print(markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python -m", MODULE, *(argv if argv is not None else sys.argv[1:])]),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
