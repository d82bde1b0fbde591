"""What every engine offers the session and the bench: feed tokens, generate, roll back, report."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..allocator import release_compute_pools, release_free_memory
from ..cache.base import MemoryReport
from ..errors import SekvError
from ..models.config import ModelConfig
from ..models.tokenizer import Tokenizer

ProgressFn = Callable[[int, int], None]  # (tokens done, tokens total)


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy. top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SekvError("temperature must be >= 0")
        if self.top_k < 0:
            raise SekvError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise SekvError("top_p must be in (0, 1]")


class Sampler:
    """Picks the next token from logits [vocab] (float32 numpy)."""

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, logits: np.ndarray) -> int:
        cfg = self.config
        if cfg.temperature == 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / cfg.temperature
        if cfg.top_k:
            kth = np.partition(scaled, -cfg.top_k)[-cfg.top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if cfg.top_p < 1:
            order = np.argsort(-probs)
            keep = np.cumsum(probs[order]) - probs[order] < cfg.top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0)
            probs /= probs.sum()
        return int(self.rng.choice(len(probs), p=probs))


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill_tokens": self.prefill_tokens, "prefill_s": round(self.prefill_s, 4),
            "decode_tokens": self.decode_tokens, "decode_s": round(self.decode_s, 4),
            "prefill_tokens_per_s": round(self.prefill_tokens / self.prefill_s, 2) if self.prefill_s else None,
            "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 2) if self.decode_s else None,
        }


@dataclass
class EngineOptions:
    """Settings shared by all engines (each engine validates what it supports)."""

    method: str = "full"
    budget: float | int | None = None
    threads: int | None = None
    chunk_size: int = 1024
    device: str = "cpu"
    method_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise SekvError("chunk size must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise SekvError("threads must be >= 1")


class Engine(ABC):
    """One model and one growing context. Token ids in, logits and tokens out."""

    name = "base"

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer, options: EngineOptions) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.options = options
        self.stats = EngineStats()
        self.n_tokens = 0
        self._last_logits: np.ndarray | None = None
        self.notices: list[str] = []  # one-line facts the user should see once (e.g. which router runs)

    # -- engine-specific ------------------------------------------------------------------------
    @abstractmethod
    def _forward(self, tokens: list[int], prefill: bool) -> np.ndarray:
        """Append `tokens` to the context; return the logits [vocab] after the last one."""

    @abstractmethod
    def reset(self) -> None:
        """Empty the context (a new document)."""

    @abstractmethod
    def mark(self) -> Any: ...

    @abstractmethod
    def rollback(self, mark: Any) -> None: ...

    @abstractmethod
    def memory(self) -> MemoryReport: ...

    @abstractmethod
    def score(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Teacher forcing on a fresh context: (log p(tokens[i+1] | tokens[:i+1]) [n-1],
        argmax predictions [n-1]). Leaves the engine reset."""

    def finish_prefill(self) -> None:
        """The document (or a user turn) is complete; compressing methods may act now."""

    def continuation_logprobs(self, tokens: list[int]) -> np.ndarray:
        """Append `tokens` (a prefill turn after the context) and return log p(tokens[i] | everything
        before it) [len(tokens)]: the perplexity of a continuation given the (compressed) context."""
        raise SekvError(f"engine '{self.name}' cannot score a continuation (use --engine torch)")

    def export_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        raise SekvError(f"engine '{self.name}' cannot save a memory (use --engine torch)")

    def import_state(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        raise SekvError(f"engine '{self.name}' cannot load a memory (use --engine torch)")

    def reserve(self, n_tokens: int) -> None:
        """The context will hold about n_tokens; budgeted methods size themselves for it."""

    def reset_observations(self) -> None:
        """Start a new answer's observations (e.g. SeKV's zoomed spans)."""

    def room_tokens(self) -> int | None:
        """Tokens the method can still take within its budget (None: only max_context limits)."""
        return None

    def host_bytes_needed(self, n_tokens: int) -> int:
        """Host RAM the cache method will hold for n_tokens (0 when it keeps nothing in host RAM)."""
        return 0

    def chunk_size(self) -> int:
        """Prefill chunk size: the option, capped by what the method allows."""
        return self.options.chunk_size

    def observations(self) -> dict[str, Any]:
        return {}

    # -- shared ---------------------------------------------------------------------------------
    def feed(self, tokens: list[int], progress: ProgressFn | None = None) -> None:
        """Append `tokens` to the context in chunks (prefill), reporting progress after each chunk."""
        if not tokens:
            return
        if self.n_tokens + len(tokens) > self.max_context():
            raise SekvError(f"context would hold {self.n_tokens + len(tokens)} tokens; this engine and method "
                            f"can hold at most {self.max_context()}")
        step = self.chunk_size()
        start = time.perf_counter()
        for i in range(0, len(tokens), step):
            self._last_logits = self._forward(tokens[i: i + step], prefill=True)
            self.n_tokens += len(tokens[i: i + step])
            release_free_memory()
            if progress is not None:
                progress(min(i + step, len(tokens)), len(tokens))
        release_compute_pools()
        self.stats.prefill_s += time.perf_counter() - start
        self.stats.prefill_tokens += len(tokens)

    def generate(self, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                 stop_ids: frozenset[int] | None = None) -> Iterator[int]:
        """Yield up to `max_new_tokens` tokens. Each yielded token is fed back into the context
        (so the conversation stays cached); a stop token ends generation and is not yielded."""
        if self._last_logits is None:
            raise SekvError("nothing to continue from: feed a prompt first")
        stop = self.tokenizer.end_of_generation_ids if stop_ids is None else stop_ids
        sampler = Sampler(sampling)
        try:
            for _ in range(max_new_tokens):
                token = sampler(self._last_logits)
                if token in stop:
                    return
                yield token
                if self.n_tokens + 1 > self.max_context():
                    return
                start = time.perf_counter()
                self._last_logits = self._forward([token], prefill=False)
                self.n_tokens += 1
                self.stats.decode_s += time.perf_counter() - start
                self.stats.decode_tokens += 1
        finally:  # an answer's steps free blocks between live ones too
            release_compute_pools()

    def max_context(self) -> int:
        """Most tokens the context can hold with this engine and method."""
        return self.config.context_length

    def reset_stats(self) -> None:
        self.stats = EngineStats()
