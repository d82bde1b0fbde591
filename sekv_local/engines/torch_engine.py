"""The PyTorch reference engine: dequantized GGUF weights, attention through a cache policy."""

from __future__ import annotations

import threading
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache import create_policy
from ..cache.base import CachePolicy, MemoryReport
from ..errors import SekvError
from ..models.gguf_file import GGUFModelFile, open_model_file
from ..models.rope import Rope
from ..models.tokenizer import Tokenizer
from ..models.transformer import Transformer
from ..metasoft.library import SEED_WORDS
from .base import Engine, EngineOptions

_LOAD_LOCK = threading.Lock()
SEKV_METHODS = ("sekv", "sekv+xkv")


@lru_cache(maxsize=2)
def load_transformer(path: str, device: str) -> Transformer:
    """Dequantize once per process: the bench and the TUI build many engines over one model."""
    if torch.device(device).type == "cpu":  # ggml dequantizes the weights if its library is built (seconds)
        from ..native.bindings import load_built_library

        load_built_library()
    with _LOAD_LOCK:
        return Transformer.from_gguf(open_model_file(path), device=device).eval()


def _probe_pass(model: Transformer, policy: CachePolicy, embeddings: torch.Tensor) -> None:
    """Run soft-token embeddings [k, n_embd] through `model` with `policy` as its cache (no logits)."""
    model(None, policy, logits="none", embeddings=embeddings.to(model.embed.dtype))


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SekvError("--device cuda was asked for, but this torch build sees no CUDA device")
    return device


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, gguf_path: str | Path, tokenizer: Tokenizer, options: EngineOptions) -> None:
        self.device = resolve_device(options.device)
        self.model = load_transformer(str(gguf_path), self.device)
        super().__init__(self.model.config, tokenizer, options)
        if options.threads:
            torch.set_num_threads(options.threads)
        self.rope = Rope(self.config)
        self.gguf_path = Path(gguf_path)
        self.cache: CachePolicy = self._new_policy()

    def _new_policy(self) -> CachePolicy:
        o = self.options
        options = dict(o.method_options)
        if o.method == "sentencekv" and "sentence_end_ids" not in options:
            options["sentence_end_ids"] = self._sentence_end_ids()
        if o.method in SEKV_METHODS and options.get("trained", True) is not False:
            options["router_module"] = self._trained_router()
        if o.method == "metasoft":
            options["library"] = self._metasoft_library(options)
        policy = create_policy(o.method, self.config, self.rope, device=self.device, budget=o.budget, **options)
        if hasattr(policy, "prober"):  # Meta-Soft's probe pass runs the soft tokens through this engine's model
            # the policy hands itself in: a closure over it would be a reference cycle, and a policy replaced by
            # reset() would stay allocated until the garbage collector happened to run
            policy.prober = partial(_probe_pass, self.model)
        return policy

    def _metasoft_library(self, options: dict[str, Any]) -> Any:
        """Meta-Soft's soft tokens: --option params, else trained ones for this model, else untrained."""
        if self.config.has_local_layers:
            raise SekvError(f"method 'metasoft' does not support {self.config.architecture} models yet "
                            f"(the probe pass would enter their sliding windows)")
        from ..metasoft.library import SoftTokenLibrary
        from ..metasoft.params_file import find_trained_library, load_library

        path = options.get("params")
        trained = options.get("trained", True) is not False
        found = find_trained_library(self.gguf_file, self.config) if trained and not path else None
        if path and trained:
            library, info = load_library(path, self.config)
            note = f"Meta-Soft: trained soft tokens from {path} ({info.get('steps', '?')} steps)"
        elif found is not None:
            library, _, note = found
        else:
            features = 2 * self.config.n_heads * self.config.head_dim
            seed_ids = [self.tokenizer.encode(w)[0] for w in SEED_WORDS]
            library = SoftTokenLibrary.untrained(self.model.embed, seed_ids, features)
            note = "Meta-Soft: untrained soft tokens (question-word embeddings); train with `sekv-local train --method metasoft`"
        if note not in self.notices:
            self.notices.append(note)
        return library.to(self.device)

    @cached_property
    def gguf_file(self) -> GGUFModelFile:
        """The model file's metadata (trained parameters live there), parsed once per process."""
        return open_model_file(self.gguf_path)

    def _trained_router(self) -> Any:
        """The model's trained SeKV router (built once per engine; read-only), or None."""
        if not hasattr(self, "_router"):
            from ..sekv.router_file import build_router, find_trained_router

            params, note = find_trained_router(self.gguf_file)
            # the router serves the layers a cache method compresses (Gemma 3: the global ones)
            self._router = None if params is None else build_router(params, self.config.global_config(),
                                                                    self.gguf_path.name)
            self.notices.append(note)
        return self._router

    def _sentence_end_ids(self) -> tuple[int, ...]:
        """Token ids that end a sentence (computed once per engine; SentenceKV cuts there)."""
        if not hasattr(self, "_end_ids"):
            from ..cache.sentencekv import sentence_end_ids_from_tokenizer

            self._end_ids = tuple(sentence_end_ids_from_tokenizer(self.tokenizer))
        return self._end_ids

    def reset(self) -> None:
        self.cache = self._new_policy()
        self.n_tokens = 0
        self._last_logits = None

    @torch.inference_mode()
    def _forward(self, tokens: list[int], prefill: bool) -> np.ndarray:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(self.n_tokens, self.n_tokens + len(tokens), device=self.device)
        self.cache.begin_chunk(positions, is_prefill=prefill)
        if self.cache.needs_token_scores:
            scores = self.model(ids, self.cache, logits="scores").predicted_by(self._last_logits, tokens[0])
            self.cache.end_chunk(scores, ids)
            last = scores.last
        else:
            last = self.model(ids, self.cache, logits="last")
            self.cache.end_chunk(last, ids)
        # kept here too, not only by `feed`: the llama.cpp engine calls this directly to fold answers back
        self._last_logits = last[-1].float().cpu().numpy()
        return self._last_logits

    @torch.inference_mode()
    def continuation_logprobs(self, tokens: list[int]) -> np.ndarray:
        if self._last_logits is None:
            raise SekvError("nothing to continue from: feed a context first")
        previous = torch.from_numpy(self._last_logits)[None]  # [1, vocab]: predicts tokens[0]
        out = []
        step = self.chunk_size()
        for i in range(0, len(tokens), step):
            chunk = tokens[i: i + step]
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            self.cache.begin_chunk(torch.arange(self.n_tokens, self.n_tokens + len(chunk), device=self.device),
                                   is_prefill=True)
            scores = self.model(ids, self.cache, logits="scores")
            self.cache.end_chunk(scores, ids)
            self.n_tokens += len(chunk)
            first = torch.log_softmax(previous.float(), dim=-1)[0, int(chunk[0])].view(1)
            out.append(torch.cat([first, -scores.nll.cpu()]).numpy())
            previous = scores.last.float().cpu()
        self._last_logits = previous[0].numpy()
        return np.concatenate(out)

    @torch.inference_mode()
    def finish_prefill(self) -> None:
        self.cache.finish_prefill()
        again = self.cache.tokens_to_read_again()
        self.n_tokens -= len(again)  # the memory dropped them: read them once more, as it asked
        while again:
            n = self.chunk_size()
            piece, again = again[:n], again[n:]
            self._last_logits = self._forward(piece, prefill=True)
            self.n_tokens += len(piece)

    def reserve(self, n_tokens: int) -> None:
        self.cache.reserve(n_tokens)

    def reset_observations(self) -> None:
        self.cache.reset_observations()

    def chunk_size(self) -> int:
        cap = self.cache.max_chunk_tokens()
        return min(self.options.chunk_size, cap) if cap else self.options.chunk_size

    def room_tokens(self) -> int | None:
        return self.cache.room_tokens()

    def host_bytes_needed(self, n_tokens: int) -> int:
        return self.cache.host_bytes_needed(n_tokens)

    def max_context(self) -> int:
        limit = self.cache.max_tokens()
        return limit if limit is not None else 1 << 30

    @torch.inference_mode()
    def mark(self) -> Any:
        return (self.n_tokens, self._last_logits, self.cache.mark())

    @torch.inference_mode()
    def rollback(self, mark: Any) -> None:
        self.n_tokens, self._last_logits, cache_mark = mark
        self.cache.rollback(cache_mark)

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = self.cache.export_state()
        tensors = {f"cache.{k}": v for k, v in tensors.items()}
        if self._last_logits is not None:
            tensors["engine.last_logits"] = torch.from_numpy(self._last_logits.copy())
        return tensors, {"cache": meta, "n_tokens": self.n_tokens}

    @torch.inference_mode()
    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.reset()
        cache = {k[len("cache."):]: v for k, v in tensors.items() if k.startswith("cache.")}
        try:
            self.cache.import_state(cache, meta["cache"])
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            self.reset()
            raise SekvError(f"the saved memory does not fit this model and method: {exc}") from None
        self.n_tokens = int(meta["n_tokens"])
        logits = tensors.get("engine.last_logits")
        self._last_logits = logits.numpy().copy() if logits is not None else None

    def memory(self) -> MemoryReport:
        return self.cache.memory()

    def observations(self) -> dict[str, Any]:
        return self.cache.observations()

    @torch.inference_mode()
    def score(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        self.reset()
        logprobs, argmax = [], []
        step = self.options.chunk_size
        for i in range(0, len(tokens), step):
            chunk = tokens[i: i + step]
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            self.cache.begin_chunk(torch.arange(i, i + len(chunk), device=self.device), is_prefill=True)
            logits = self.model(ids, self.cache, logits="all").float()
            self.cache.end_chunk(logits, ids)
            lp = torch.log_softmax(logits, dim=-1)
            nxt = torch.tensor(tokens[i + 1: i + 1 + len(chunk)], dtype=torch.long, device=self.device)
            logprobs.append(lp[: len(nxt)].gather(1, nxt[:, None])[:, 0].cpu().numpy())
            argmax.append(lp[: len(nxt)].argmax(-1).cpu().numpy())
        self.reset()
        return np.concatenate(logprobs), np.concatenate(argmax)
