"""`sekv-local train --method metasoft`: the soft-token library and selector, model frozen.

Target (per sample, per layer and KV head): where the real query tokens look - the attention the
sample's question/answer (or continuation) tokens pay to the context with full KV, summed over
those tokens and the query heads of the group, renormalised over the context without the
attention-sink tokens (always kept, and they would dominate the error).

Student: the k soft tokens appended right after the context (their own positions), run through the
frozen model over the context's full K/V; the same aggregation of their attention. Loss = n_context
* MSE between the two distributions (the factor keeps it O(1) whatever the length), plus
`orth_weight` * the library's orthogonality penalty.

Two stages: steps [0, library_steps) train the library and its static combination (no selector);
the rest train only the selector (library frozen), from the document features. Gumbel-softmax,
hard with straight-through gradients, temperature `tau`. Checkpoints, resume and Ctrl-C as the
router trainer (trainer.py): step i uses sample seed * SEED_STRIDE + i and Gumbel seed i.

At the end both modes are scored on `validation_samples` held-out samples (seeds past the training
ones, hard choices, no noise); when the selector does not lower the validation error it is zeroed, so
the file runs stage 1's static soft tokens (recorded in the file's info: `selector_kept`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from ..cache.base import CachePolicy
from ..errors import SekvError, config_check
from ..metasoft.library import SEED_WORDS, SoftTokenLibrary
from ..models.rope import Rope
from ..models.transformer import Transformer
from .teacher import OnePassPolicy, TeacherRecord
from .trainer import SEED_STRIDE, TrainResult, checkpoint_path, run_steps

ProgressFn = Callable[[int, int, dict[str, float]], None]
#: held-out samples for the end-of-training check come from seeds this far past the training ones
VALIDATION_OFFSET = 500_000


@dataclass(frozen=True)
class MetaSoftTrainConfig:
    """steps: optimizer steps (one sample each); library_steps: of those, the first stage (library +
    static combination; the rest train the selector); n_soft: soft tokens k; hidden: selector width;
    feature_layers: layers whose mean query is the selector's input; orth_weight: orthogonality
    penalty weight; tau: Gumbel-softmax temperature; n_sink: context tokens left out of the target."""

    model: str = "smollm2-135m"
    steps: int = 300
    library_steps: int = 150
    lr: float = 0.003
    seed: int = 0
    context_tokens: int = 1024
    query_tokens: int = 48
    n_soft: int = 16
    hidden: int = 64
    feature_layers: int = 2
    orth_weight: float = 0.1
    tau: float = 1.0
    n_sink: int = 4
    checkpoint_every: int = 20
    max_minutes: float | None = None
    validation_samples: int = 16

    def __post_init__(self) -> None:
        need = config_check("train metasoft")
        need(self.steps >= 1, "steps must be >= 1")
        need(0 <= self.library_steps <= self.steps, "library_steps must be in [0, steps]")
        need(self.lr > 0, "lr must be > 0")
        need(self.seed >= 0, "seed must be >= 0")
        need(self.context_tokens >= 256, "context_tokens must be >= 256")
        need(1 <= self.query_tokens <= 512, "query_tokens must be in [1, 512]")
        need(1 <= self.n_soft <= len(SEED_WORDS), f"n_soft must be in [1, {len(SEED_WORDS)}]")
        need(self.hidden >= 1 and self.feature_layers >= 1, "hidden and feature_layers must be >= 1")
        need(self.orth_weight >= 0 and self.tau > 0, "orth_weight must be >= 0 and tau > 0")
        need(self.checkpoint_every >= 1, "checkpoint_every must be >= 1")
        need(self.max_minutes is None or self.max_minutes > 0, "max_minutes must be > 0")

    def fingerprint(self) -> dict[str, Any]:
        """Settings a resumed run must share with the run it continues."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("steps", "max_minutes", "checkpoint_every", "validation_samples")}


def context_attention(rope: Rope, q: torch.Tensor, q_pos: torch.Tensor, keys_rot: torch.Tensor,
                      extra_keys: torch.Tensor | None, n_sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [H, M, D] (pre-RoPE, at q_pos [M]) over post-RoPE context keys [KV, n, D] and,
    causally, over `extra_keys` [KV, M, D] (post-RoPE keys of the M query tokens themselves).

    Returns (probs [KV, G, M, n + M], where [KV, n]: context mass summed over queries and the group,
    sinks removed, renormalised to sum 1 per KV head)."""
    n_kv, n = keys_rot.shape[0], keys_rot.shape[1]
    group, m, dim = q.shape[0] // n_kv, q.shape[1], q.shape[2]
    q_rot = rope.apply(q, q_pos).float().view(n_kv, group, m, dim)
    keys = keys_rot if extra_keys is None else torch.cat([keys_rot, extra_keys], dim=1)
    logits = q_rot @ keys[:, None].transpose(2, 3) * dim ** -0.5
    if extra_keys is not None:
        later = torch.ones(m, m, dtype=torch.bool).triu(1)
        logits[..., n:] = logits[..., n:].masked_fill(later, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    mass = probs[..., n_sink:n].sum(dim=(1, 2))
    return probs, mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-12)


def teacher_targets(rope: Rope, record: TeacherRecord, n_sink: int) -> list[torch.Tensor]:
    """Per layer [KV, n - n_sink]: where the record's query tokens look in the context."""
    n = record.n_context
    total = record.k[0].shape[1]
    pos = torch.arange(total)
    out = []
    for q, k in zip(record.q, record.k):
        k_rot = rope.apply(k, pos).float()
        _, dist = context_attention(rope, q, pos[n:], k_rot[:, :n], k_rot[:, n:], n_sink)
        out.append(dist)
    return out


class _ProbeStudent(OnePassPolicy):
    """The soft tokens attend to a record's context K/V (full) and causally to each other, with grad."""

    name = "metasoft-student"

    def __init__(self, model: Transformer, rope: Rope, record: TeacherRecord, n_sink: int) -> None:
        super().__init__(model.config, rope)
        n = record.n_context
        pos = torch.arange(n)
        self.keys = [rope.apply(k[:, :n], pos).float() for k in record.k]
        self.values = [v[:, :n].float() for v in record.v]
        self.n_sink = n_sink
        self.dists: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_rot = self.rope.apply(k, self._positions).float()
        probs, dist = context_attention(self.rope, q, self._positions, self.keys[layer], k_rot, self.n_sink)
        self.dists.append(dist)
        values = torch.cat([self.values[layer], v.float()], dim=1)
        out = probs @ values[:, None]  # [KV, G, k, D]
        return out.reshape(q.shape[0], q.shape[1], q.shape[2])


def metasoft_losses(model: Transformer, rope: Rope, library: SoftTokenLibrary, record: TeacherRecord,
                    targets: list[torch.Tensor], static: bool, tau: float, n_sink: int, orth_weight: float,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, dict[str, float]]:
    """(total loss, parts) for one sample; generator None = no Gumbel noise (inference's hard choice)."""
    student = _ProbeStudent(model, rope, record, n_sink)
    embeddings = library.soft_tokens(record.features, static=static, hard=True, tau=tau, generator=generator)
    n = record.n_context
    CachePolicy.begin_chunk(student, torch.arange(n, n + embeddings.shape[0]), is_prefill=False)
    model(None, student, logits="none", embeddings=embeddings)
    mse = torch.stack([((s - t) ** 2).sum(-1).mean() for s, t in zip(student.dists, targets)]).mean()
    orth = library.orthogonality()
    total = mse * (n - n_sink) + orth_weight * orth
    return total, {"mse": float(mse.detach()) * (n - n_sink), "orthogonality": float(orth.detach())}


@torch.no_grad()
def validate(model: Transformer, rope: Rope, library: SoftTokenLibrary,
             data: list[tuple[TeacherRecord, list[torch.Tensor]]], config: "MetaSoftTrainConfig") -> dict[str, float]:
    """Mean scaled MSE on held-out samples with hard soft tokens (as at inference), with the selector and
    with the static combination alone."""
    out = {}
    for mode in ("static", "selector"):
        losses = [metasoft_losses(model, rope, library, record, targets, mode == "static", config.tau, config.n_sink,
                                  0.0, None)[1]["mse"] for record, targets in data]
        out[mode] = round(sum(losses) / len(losses), 6)
    return out


def train_metasoft(config: MetaSoftTrainConfig, out: Path, fresh: bool = False,
                   progress: ProgressFn | None = None, threads: int | None = None) -> TrainResult:
    """Train (or resume) Meta-Soft's library and selector for `config.model`; write `out` when done."""
    from ..metasoft.params_file import save_library
    from ..models.gguf_file import GGUFModelFile
    from ..models.prompt import PromptBuilder
    from ..models.registry import resolve_model
    from ..models.tokenizer import Tokenizer
    from ..persistence import file_sha256
    from .data import make_sample
    from .teacher import run_teacher

    if threads:
        torch.set_num_threads(threads)
    model_path = resolve_model(config.model, show_progress=progress is not None)
    model = Transformer.from_gguf(GGUFModelFile(model_path)).eval()
    if model.config.has_local_layers:
        raise SekvError("train metasoft: models with sliding-window layers are not supported yet")
    tokenizer = Tokenizer(model_path)
    prompt = PromptBuilder(tokenizer)
    rope = Rope(model.config)
    feature_dim = config.feature_layers * model.config.n_heads * model.config.head_dim
    library = SoftTokenLibrary.untrained(model.embed, [tokenizer.encode(w)[0] for w in SEED_WORDS], feature_dim,
                                        config.n_soft, config.hidden)
    optimizer = torch.optim.Adam(library.parameters(), lr=config.lr)
    stage_params = {"library": [library.library, library.static_logits],
                    "selector": list(library.selector_in.parameters()) + list(library.selector_out.parameters())}

    def one_step(step: int) -> tuple[torch.Tensor, dict[str, Any], dict[str, float]]:
        stage = "library" if step < config.library_steps else "selector"
        for name, params in stage_params.items():
            for p in params:
                p.requires_grad_(name == stage)
        sample = make_sample(config.seed * SEED_STRIDE + step, config.context_tokens, config.query_tokens,
                             tokenizer, prompt)
        record = run_teacher(model, rope, sample.context, sample.query, config.feature_layers)
        targets = teacher_targets(rope, record, config.n_sink)
        total, parts = metasoft_losses(model, rope, library, record, targets, stage == "library", config.tau,
                                       config.n_sink, config.orth_weight, torch.Generator().manual_seed(step))
        return total, {"stage": stage, "kind": sample.kind}, parts

    step, steps_run, minutes, history = run_steps(config, library, optimizer, checkpoint_path(out), fresh, one_step,
                                                  progress)
    finished = step >= config.steps
    if finished:
        def recent_mean(stage: str, key: str) -> float | None:
            rows = [h[key] for h in history if h["stage"] == stage][-50:]
            return round(sum(rows) / len(rows), 6) if rows else None

        def samples(i: int) -> tuple[TeacherRecord, list[torch.Tensor]]:
            sample = make_sample(config.seed * SEED_STRIDE + VALIDATION_OFFSET + i, config.context_tokens,
                                 config.query_tokens, tokenizer, prompt)
            record = run_teacher(model, rope, sample.context, sample.query, config.feature_layers)
            return record, teacher_targets(rope, record, config.n_sink)

        validation = validate(model, rope, library, [samples(i) for i in range(config.validation_samples)],
                              config)
        if validation["selector"] >= validation["static"]:  # the selector does not help: keep stage 1's tokens
            with torch.no_grad():
                for p in library.selector_out.parameters():
                    p.zero_()
        info = {"model": config.model, "model_sha256": file_sha256(model_path), "steps": step, "seed": config.seed,
                "config": config.fingerprint(), "validation_mse": validation,
                "selector_kept": validation["selector"] < validation["static"],
                "final_losses": {f"{stage}_{key}": recent_mean(stage, key) for stage in ("library", "selector")
                                 for key in ("mse", "orthogonality")}}
        save_library(out, library, info)
    return TrainResult(out, step, finished, minutes, history, steps_run)
