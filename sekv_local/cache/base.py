"""The interface between the torch engine's attention and a KV cache method.

The engine runs the model over chunks of tokens (a prefill chunk, a question, one generated token).
For each chunk it calls `begin_chunk`, then `attend` once per layer with that layer's *pre-RoPE*
queries/keys/values, then `end_chunk` with the chunk's logits. Everything a method stores, and
hence every byte it reports, lives in the policy object.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..errors import SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope


def storage_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct storages behind `tensors` (what is really allocated, not a formula)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def tensors_in(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts (a Checkpoint inside is its own policy's to count)."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_in(value)
    elif isinstance(state, (tuple, list)):
        for value in state:
            yield from tensors_in(value)


class Checkpoint:
    """A policy's saved contents (from `CachePolicy.mark`): its copies count in the policy's memory report
    for as long as anyone holds the checkpoint (a chat session holds one for the document)."""

    __slots__ = ("state", "__weakref__")

    def __init__(self, state: Any) -> None:
        self.state = state


def share(part: float, whole: int) -> float:
    """part / whole, 0 when there is no whole (nothing read yet, no tokens)."""
    return part / whole if whole else 0.0


@dataclass
class HostReads:
    """Bytes a method gathers from its host tier, counted where it reads them (stored bytes: rows, or a
    span's factors), since the last `reset_observations` (one answer).

    step_bytes / steps: over decode steps; per step it is the PCIe traffic per token on a GPU and the
    memory traffic per token on a CPU. question_bytes: one-time reads of a prefill after the document
    (a question, a user turn), e.g. SeKV's question-time pass over every span.
    """

    step_bytes: int = 0
    steps: int = 0
    question_bytes: int = 0

    def count(self, nbytes: int, decode_step: bool) -> None:
        if decode_step:
            self.step_bytes += int(nbytes)
        else:
            self.question_bytes += int(nbytes)

    @property
    def per_step(self) -> float:
        return share(self.step_bytes, self.steps)


@dataclass
class MemoryReport:
    """What a method holds, from real tensor storage.

    device_bytes: what stays on the accelerator across decode steps now (per layer in `device_per_layer`).
    device_peak_bytes: the largest device tier seen so far, prefill and zoom working sets included.
    host_bytes: what is parked in host RAM (e.g. SVD factors).
    full_kv_bytes: f16 full-KV bytes for the same number of tokens, every layer at full context (the
        baseline budgets are shares of).
    full_kv_held_bytes: what full KV itself holds for those tokens: window layers at their window (equal to
        full_kv_bytes on a model without them; 0 means not given, read as full_kv_bytes).
    checkpoint_bytes: host copies kept so that the contents at a mark can come back (a ring buffer that
        overwrites in place cannot truncate; a chat session marks the document to answer each question from it).
    On a CPU the device and host tiers are the same RAM: `total_bytes` is what the process holds for it.
    """

    tokens: int
    device_bytes: int
    device_peak_bytes: int
    host_bytes: int
    full_kv_bytes: int
    device_per_layer: list[int] = field(default_factory=list)
    host_per_layer: list[int] = field(default_factory=list)
    host_reads: HostReads = field(default_factory=HostReads)
    full_kv_held_bytes: int = 0
    checkpoint_bytes: int = 0

    @property
    def held_baseline(self) -> int:
        return self.full_kv_held_bytes or self.full_kv_bytes

    @property
    def total_bytes(self) -> int:
        """Device and host tiers and checkpoints together (one RAM on a CPU)."""
        return self.device_bytes + self.host_bytes + self.checkpoint_bytes

    @property
    def device_fraction_of_held(self) -> float:
        """The device tier as a share of what full KV holds (window layers at their window)."""
        return share(self.device_bytes, self.held_baseline)

    @property
    def total_fraction_of_held(self) -> float:
        return share(self.total_bytes, self.held_baseline)

    @property
    def host_reads_per_step_fraction(self) -> float:
        """Host bytes gathered per decode step over the answer, as a share of full-KV bytes."""
        return share(self.host_reads.per_step, self.full_kv_bytes)

    @property
    def device_fraction(self) -> float:
        return share(self.device_bytes, self.full_kv_bytes)

    @property
    def device_peak_fraction(self) -> float:
        return share(self.device_peak_bytes, self.full_kv_bytes)

    @property
    def host_fraction(self) -> float:
        return share(self.host_bytes, self.full_kv_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "device_bytes": self.device_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "host_bytes": self.host_bytes,
            "full_kv_bytes": self.full_kv_bytes,
            "device_fraction": round(self.device_fraction, 5),
            "device_peak_fraction": round(self.device_peak_fraction, 5),
            "host_fraction": round(self.host_fraction, 5),
            "device_per_layer": list(self.device_per_layer),
            "host_per_layer": list(self.host_per_layer),
            "host_reads_per_step_bytes": round(self.host_reads.per_step),
            "host_reads_per_step_fraction": round(self.host_reads_per_step_fraction, 5),
            "host_reads_steps": self.host_reads.steps,
            "host_reads_question_bytes": self.host_reads.question_bytes,
            "full_kv_held_bytes": self.held_baseline,
            "device_fraction_of_held": round(self.device_fraction_of_held, 5),
            "device_peak_fraction_of_held": round(share(self.device_peak_bytes, self.held_baseline), 5),
            "checkpoint_bytes": self.checkpoint_bytes,
            "total_bytes": self.total_bytes,
            "total_fraction_of_held": round(self.total_fraction_of_held, 5),
        }


class CachePolicy(ABC):
    """One KV cache method for all layers of one model and one sequence.

    Shapes: q [n_heads, T, head_dim], k/v [n_kv_heads, T, head_dim], all pre-RoPE, float32;
    `positions` [T] int64 absolute positions of the chunk.

    Models with sliding-window layers (Gemma 3, `config.has_local_layers`) need a method that masks
    keys older than the window on those layers and rotates them with the local RoPE
    (`layer_rope`): `full` does it itself; `create_policy` runs every other method on the global layers
    only, inside `MixedLayers` (mixed_layers.py), which keeps the local windows exact.
    """

    name: str = "base"
    #: whether `end_chunk` needs every prefill token's next-token score (e.g. SeKV's surprisal): then it gets a
    #: ChunkScores, computed without a [T, vocab] tensor
    needs_token_scores: bool = False
    #: whether the method handles local (sliding-window) layers with their own RoPE
    supports_sliding_window: bool = False

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu") -> None:
        if config.has_local_layers and not self.supports_sliding_window:
            raise SekvError(f"method '{self.name}' does not support {config.architecture} models yet (their "
                            f"sliding-window layers need their own masking and RoPE); use method 'full'")
        self.config = config
        self.rope = rope
        self.device = torch.device(device)
        self.n_tokens = 0
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._local_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._peak_device = 0
        self._is_prefill = True
        self.host_reads = HostReads()
        self._checkpoints: weakref.WeakSet[Checkpoint] = weakref.WeakSet()

    # -- the engine's calls -------------------------------------------------------------------
    def begin_chunk(self, positions: torch.Tensor, is_prefill: bool) -> None:
        """Called once before the layers run over a chunk of tokens at `positions` [T]."""
        self._positions = positions
        self._cos_sin = self.rope.cos_sin(positions)
        self._local_cos_sin = self.rope.local.cos_sin(positions) if self.rope.local is not None else None
        self._is_prefill = is_prefill
        self._count_step()

    def _count_step(self) -> None:
        """A chunk begins: one more decode step for the host-read average when it is one."""
        if not self._is_prefill:
            self.host_reads.steps += 1

    def _count_host_read(self, nbytes: int) -> None:
        """`nbytes` gathered from the host tier by the current chunk (a decode step or a prefill)."""
        self.host_reads.count(nbytes, decode_step=not self._is_prefill)

    def layer_rope(self, layer: int) -> tuple[Rope, tuple[torch.Tensor, torch.Tensor]]:
        """The RoPE of `layer` and its cos/sin tables [T, rope_dim/2] for the current chunk."""
        rope = self.rope.for_layer(layer)
        if rope is self.rope:
            return rope, self._cos_sin
        return rope, self._local_cos_sin

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this chunk's k/v for `layer` as the method decides and return attention output
        [n_heads, T, head_dim] of q over (memory + this chunk), causal within the chunk."""

    def end_chunk(self, logits: torch.Tensor | None, token_ids: torch.Tensor) -> None:
        """Called after all layers; `logits`: a prefill chunk's ChunkScores when `needs_token_scores`, otherwise
        logits [1, vocab] (last only) or [T, vocab], or None."""
        self.n_tokens += int(token_ids.shape[0])
        self._note_peak()

    def score_rows(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The vocabulary rows [R] (sorted ids, each of token_ids [T] among them) that this chunk's token scores
        normalise over; None: the whole vocabulary. Called once per scored chunk, before its scores exist: a
        method that keeps a shortlist adds the chunk's tokens to it here."""
        return None

    def finish_prefill(self) -> None:
        """The document (or a new user turn) has been fed; methods that compress after prefill do it here."""

    def tokens_to_read_again(self) -> list[int]:
        """After finish_prefill: the newest tokens the method has just dropped from its memory and wants the
        engine to feed again before the answer (prefill chunks of max_chunk_tokens), e.g. a question whose rows were computed
        under a placement the answer will not use. Empty for most methods."""
        return []

    def reserve(self, n_tokens: int) -> None:
        """The context will hold about n_tokens (document + conversation); fractional budgets are
        fractions of the full-KV bytes of that many tokens."""

    def max_chunk_tokens(self) -> int | None:
        """Largest prefill chunk the method's budget allows (None = no limit of its own)."""
        return None

    def max_tokens(self) -> int | None:
        """Most tokens the method can hold (None = no limit); default: the model's trained context."""
        return self.config.context_length

    def reset_observations(self) -> None:
        """Start collecting `observations()` and host reads afresh (called before each question)."""
        self.host_reads = HostReads()

    def host_bytes_needed(self, n_tokens: int) -> int:
        """Host RAM the method will hold for a context of n_tokens (an upper estimate; 0 = none)."""
        return 0

    def room_tokens(self) -> int | None:
        """Tokens that can still be appended within the budget (None: no limit besides max_tokens, e.g.
        methods that evict to stay in budget, or full KV)."""
        return None

    # -- conversation rollback -----------------------------------------------------------------
    def mark(self) -> Checkpoint:
        """A checkpoint of the current contents (e.g. right after the document), counted while it is held."""
        checkpoint = Checkpoint(self._checkpoint())
        self._checkpoints.add(checkpoint)
        return checkpoint

    def rollback(self, mark: Checkpoint) -> None:
        """Forget everything added after `mark` (used to ask independent questions on one document)."""
        if not isinstance(mark, Checkpoint):
            raise SekvError(f"{self.name}: rollback takes a checkpoint from mark()")
        self._restore(mark.state)

    @abstractmethod
    def _checkpoint(self) -> Any:
        """What `_restore` needs to bring the current contents back: counts, and copies of what later
        tokens overwrite in place (tensors in nested tuples, lists and dicts, so they can be counted)."""

    @abstractmethod
    def _restore(self, state: Any) -> None:
        """Back to the contents `state` was taken from."""

    def _checkpoint_states(self) -> list[Any]:
        """States of the checkpoints held now (a method that keeps states of its own adds them)."""
        return [c.state for c in self._checkpoints]

    def checkpoint_bytes(self) -> int:
        """Bytes the held checkpoints' copies add to the method's own tensors (shared storage counted once)."""
        held = [t for state in self._checkpoint_states() for t in tensors_in(state)]
        if not held:
            return 0
        own = [t for l in range(self.config.n_layers) for t in self.device_tensors(l) + self.host_tensors(l)]
        return storage_bytes(*own, *held) - storage_bytes(*own)

    # -- persistence -------------------------------------------------------------------------------
    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to continue from here: tensors (saved with safetensors) and JSON metadata."""
        raise SekvError(f"method '{self.name}' cannot save its memory yet")

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Inverse of export_state on a freshly created policy with the same config."""
        raise SekvError(f"method '{self.name}' cannot load a saved memory")

    # -- accounting ------------------------------------------------------------------------------
    @abstractmethod
    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        """Tensors of `layer` that live in the device tier now."""

    def host_tensors(self, layer: int) -> list[torch.Tensor]:
        """Tensors of `layer` parked in host RAM."""
        return []

    def device_bytes_now(self) -> int:
        """Bytes the device tier's tensors hold at this moment (all layers)."""
        return sum(storage_bytes(*self.device_tensors(l)) for l in range(self.config.n_layers))

    def _note_peak(self, extra: int = 0) -> None:
        self._peak_device = max(self._peak_device, self.device_bytes_now() + extra)

    def memory(self) -> MemoryReport:
        dev = [storage_bytes(*self.device_tensors(l)) for l in range(self.config.n_layers)]
        host = [storage_bytes(*self.host_tensors(l)) for l in range(self.config.n_layers)]
        return MemoryReport(
            tokens=self.n_tokens,
            device_bytes=sum(dev),
            device_peak_bytes=max(self._peak_device, sum(dev)),
            host_bytes=sum(host),
            full_kv_bytes=self.config.full_kv_bytes(self.n_tokens),
            device_per_layer=dev,
            host_per_layer=host,
            host_reads=HostReads(**vars(self.host_reads)),
            full_kv_held_bytes=self.config.full_kv_held_bytes(self.n_tokens),
            checkpoint_bytes=self.checkpoint_bytes(),
        )

    def observations(self) -> dict[str, Any]:
        """Per-answer diagnostics a method wants to expose (SeKV: zoomed spans). Empty by default."""
        return {}


PolicyFactory = Callable[..., CachePolicy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def deco(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def describe_policy(name: str) -> str:
    """One line about a method: its factory's docstring, else its module's (without the `name`: prefix)."""
    import re
    import sys

    factory = _REGISTRY[name]
    doc = (factory.__doc__ or sys.modules[factory.__module__].__doc__ or "").strip()
    line = doc.splitlines()[0] if doc else ""
    match = re.match(r"^`[^`]+`\s*(?:\(([^)]*)\))?:\s*", line)  # "`h2o` (Heavy-Hitter Oracle): keep ..."
    if not match:
        return line
    return (f"{match.group(1)}: " if match.group(1) else "") + line[match.end():]


def create_policy(name: str, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                  budget: float | int | None = None, **options: Any) -> CachePolicy:
    """Build the policy registered as `name`; `budget` is a fraction of full-KV bytes or bytes."""
    if name not in _REGISTRY:
        raise SekvError(f"unknown cache method '{name}' (available: {', '.join(available_policies())})")
    factory = _REGISTRY[name]
    if config.has_local_layers and name != "full":  # the method compresses the global layers only
        from .mixed_layers import MixedLayers

        return MixedLayers(factory, config, rope, device=device, budget=budget, **options)
    return factory(config=config, rope=rope, device=device, budget=budget, **options)
