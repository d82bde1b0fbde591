"""`sekv-local train`: the router training loop with checkpoints and resume.

Only the router's parameters train (projections, thresholds, rank gate; < 0.1% of the model); the
model is frozen (its weights are buffers). Step i trains on sample `seed * SEED_STRIDE + i`, so a
run is a pure function of its config: resuming from a checkpoint continues exactly where a run
that never stopped would be (same thread count, same result).

Checkpoints are safetensors (router + Adam state) with a JSON header, written atomically next to
the output (`router.safetensors` -> `router.ckpt.safetensors`), every `checkpoint_every` steps, at
the time limit and on Ctrl-C. No pickle anywhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import Interrupted, SekvError, config_check
from ..sekv.config import AUTO_POOLS, AUTO_RANK_RULES, AUTO_ROUTERS, SekvConfig
from ..sekv.router import Router
from ..sekv.router_file import params_of, save_router
from .student import LossWeights, student_losses

SEED_STRIDE = 1_000_000
CHECKPOINT_VERSION = 1
ProgressFn = Callable[[int, int, dict[str, float]], None]


class TrainingInterrupted(Interrupted):
    """Ctrl-C during training: the checkpoint is saved; the same command resumes."""


@dataclass(frozen=True)
class TrainConfig:
    """steps: optimizer steps (one sample each); lr: Adam step size; seed: picks the training samples;
    context_tokens / query_tokens: sizes of a sample's context (the memory) and its query;
    checkpoint_every: steps between checkpoints; max_minutes: stop (and save) after this much time;
    auto_router: the routing SeKV's `router=auto` uses with this router ("projection": the learned one;
    "union": half the zoom pool by the attention rule), stored in the file; training does not use it.
    rank_rule: likewise what SeKV's `rank_rule=auto` uses with this router ("span", "row": the per-token
    energy rule, or "exact": spans kept raw); zoom_pool: what `pool=auto` uses ("fixed", or "free": a step's
    pool also takes the device room the step leaves unused)."""

    model: str = "smollm2-135m"
    steps: int = 400
    lr: float = 0.01
    seed: int = 0
    context_tokens: int = 1024
    query_tokens: int = 48
    checkpoint_every: int = 20
    max_minutes: float | None = None
    auto_router: str = "projection"
    rank_rule: str = "span"
    zoom_pool: str = "fixed"
    weights: LossWeights = field(default_factory=LossWeights)

    def __post_init__(self) -> None:
        need = config_check("train")
        need(self.steps >= 1, "steps must be >= 1")
        need(self.lr > 0, "lr must be > 0")
        need(self.seed >= 0, "seed must be >= 0")
        need(self.context_tokens >= 256, "context_tokens must be >= 256 (sinks + recent window + spans)")
        need(1 <= self.query_tokens <= 512, "query_tokens must be in [1, 512]")
        need(self.checkpoint_every >= 1, "checkpoint_every must be >= 1")
        need(self.max_minutes is None or self.max_minutes > 0, "max_minutes must be > 0")
        need(self.auto_router in AUTO_ROUTERS, f"auto_router must be one of {AUTO_ROUTERS}")
        need(self.rank_rule in AUTO_RANK_RULES, f"rank_rule must be one of {AUTO_RANK_RULES}")
        need(self.zoom_pool in AUTO_POOLS, f"zoom_pool must be one of {AUTO_POOLS}")

    def fingerprint(self) -> dict[str, Any]:
        """Settings a resumed run must share with the run it continues (steps and time limit may change)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("steps", "max_minutes",
                                                                                 "checkpoint_every", "auto_router",
                                                                                 "rank_rule", "zoom_pool")}
        out["weights"] = asdict(self.weights)
        return out


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".safetensors") + ".ckpt.safetensors")


def save_checkpoint(path: Path, router: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    config: Any, history: list[dict[str, float]]) -> None:
    """Parameters of `router` (any trained module) + Adam state; `config.fingerprint()` guards resume."""
    from safetensors.torch import save_file

    from ..persistence import atomic_write

    state = optimizer.state_dict()
    tensors = {f"router.{name}": p.detach().clone() for name, p in router.named_parameters()}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            tensors[f"adam.{index}.{key}"] = torch.as_tensor(value).detach().clone().reshape(-1) \
                if key == "step" else value.detach().clone()
    header = {"version": CHECKPOINT_VERSION, "step": step, "fingerprint": config.fingerprint(),
              "param_groups": state["param_groups"], "history": history}
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata={"sekv_train": json.dumps(header)})


def load_checkpoint(path: Path, router: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    config: Any) -> tuple[int, list[dict[str, float]]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            header = json.loads((fh.metadata() or {})["sekv_train"])
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise SekvError(f"training checkpoint {path} is unreadable ({exc}); delete it to start over") from None
    if header.get("version") != CHECKPOINT_VERSION:
        raise SekvError(f"training checkpoint {path} has another format version; delete it to start over")
    if header["fingerprint"] != json.loads(json.dumps(config.fingerprint())):
        raise SekvError(f"training checkpoint {path} was made with other settings; use the same settings to "
                        f"resume, or --fresh to start over")
    with torch.no_grad():
        for name, p in router.named_parameters():
            p.copy_(tensors[f"router.{name}"])
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("adam."):
            _, index, key = name.split(".", 2)
            slots.setdefault(int(index), {})[key] = value.reshape(()) if key == "step" else value
    optimizer.load_state_dict({"state": slots, "param_groups": header["param_groups"]})
    return int(header["step"]), list(header["history"])


@dataclass
class TrainResult:
    out: Path
    steps_done: int
    finished: bool
    minutes: float  # wall time of this run (a resumed run: its own steps only)
    history: list[dict[str, float]]
    steps_run: int  # steps this run did (fewer than steps_done when it resumed from a checkpoint)


def run_steps(config: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path, fresh: bool,
              one_step: Callable[[int], tuple[torch.Tensor, dict[str, Any], dict[str, float]]],
              progress: ProgressFn | None) -> tuple[int, int, float, list[dict[str, Any]]]:
    """The loop every trainer shares: resume from `ckpt` (unless fresh), then steps up to config.steps,
    stopping early after config.max_minutes. one_step(step) -> (loss, history fields, loss parts).
    Checkpoints every config.checkpoint_every steps, at the end, and on Ctrl-C (then raises
    TrainingInterrupted). Returns (steps done, steps done by this run, minutes of this run, history)."""
    start, history = 0, []
    if ckpt.exists() and not fresh:
        start, history = load_checkpoint(ckpt, module, optimizer, config)
    began = time.monotonic()
    step = start
    try:
        while step < config.steps:
            if config.max_minutes is not None and time.monotonic() - began > 60 * config.max_minutes:
                break
            loss, fields_, parts = one_step(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            history.append({"step": step, **fields_, **{k: round(v, 6) for k, v in parts.items()}})
            if progress is not None:
                progress(step, config.steps, parts)
            if step % config.checkpoint_every == 0:
                save_checkpoint(ckpt, module, optimizer, step, config, history)
    except KeyboardInterrupt:
        save_checkpoint(ckpt, module, optimizer, step, config, history)
        raise TrainingInterrupted(f"training stopped at step {step} of {config.steps}; checkpoint saved to {ckpt}. "
                                  "Run the same command again to resume.") from None
    save_checkpoint(ckpt, module, optimizer, step, config, history)
    return step, step - start, (time.monotonic() - began) / 60, history


def train_router(config: TrainConfig, out: Path, fresh: bool = False, progress: ProgressFn | None = None,
                 threads: int | None = None) -> TrainResult:
    """Train (or resume training) the SeKV router of `config.model`; write the router file `out` when done."""
    from ..models.gguf_file import GGUFModelFile
    from ..models.prompt import PromptBuilder
    from ..models.registry import resolve_model
    from ..models.rope import Rope
    from ..models.tokenizer import Tokenizer
    from ..models.transformer import Transformer
    from ..persistence import file_sha256
    from .data import make_sample
    from .teacher import run_teacher

    if threads:
        torch.set_num_threads(threads)
    model_path = resolve_model(config.model, show_progress=progress is not None)
    model = Transformer.from_gguf(GGUFModelFile(model_path)).eval()
    tokenizer = Tokenizer(model_path)
    prompt = PromptBuilder(tokenizer)
    rope = Rope(model.config)
    sekv = SekvConfig()
    routed = model.config.global_config()  # Gemma 3: the router serves the global layers only
    router = Router(routed, sekv)
    optimizer = torch.optim.Adam(router.parameters(), lr=config.lr)
    def one_step(step: int) -> tuple[torch.Tensor, dict[str, Any], dict[str, float]]:
        sample = make_sample(config.seed * SEED_STRIDE + step, config.context_tokens, config.query_tokens,
                             tokenizer, prompt)
        record = run_teacher(model, rope, sample.context, sample.query)
        losses = student_losses(model, rope, router, sekv, record, config.weights)
        return losses.total, {"kind": sample.kind}, losses.parts

    step, steps_run, minutes, history = run_steps(config, router, optimizer, checkpoint_path(out), fresh, one_step,
                                                  progress)
    finished = step >= config.steps
    if finished:
        recent = history[-50:]
        info = {"model": config.model, "model_sha256": file_sha256(model_path), "steps": step, "seed": config.seed,
                "lr": config.lr, "context_tokens": config.context_tokens, "query_tokens": config.query_tokens,
                "auto_router": config.auto_router, "rank_rule": config.rank_rule, "zoom_pool": config.zoom_pool,
                "final_losses": {k: round(sum(h[k] for h in recent) / len(recent), 6)
                                 for k in ("kl", "zoom_bce", "reconstruction", "budget", "zoom_fraction",
                                           "rank_fraction")}}
        hparams = {f.name: getattr(sekv, f.name) for f in fields(sekv)}
        save_router(out, params_of(router, routed, hparams, info))
    return TrainResult(out, step, finished, minutes, history, steps_run)
