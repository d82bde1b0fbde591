"""`sentencekv` (SentenceKV): sentence-level semantic KV caching with the token KV offloaded to host RAM.

Sentences are cut after a sentence-ending token (ids given as `sentence_end_ids`; the engine derives
them from the tokenizer with `sentence_end_ids_from_tokenizer`) once they hold `min_sentence` tokens,
and after `max_sentence` tokens in any case (without end ids: every `max_sentence` tokens).

Device tier (per layer):
* the first `n_start` tokens, exact;
* the pending tokens: everything not yet moved to host — at least the `n_recent` most recent tokens
  plus the sentence they cut into, and the current chunk (a fixed buffer sized for that);
* per sentence and KV head the mean post-RoPE key (the sentence's semantic vector), plus its host offset
  and length;
* a fixed working set of W token slots per KV head, into which each chunk (prefill chunk, question,
  generated token) loads the best sentences: sentences are scored per KV head by q · mean key, max
  over the GQA group's heads and the chunk's queries, and taken best first while their tokens fit W.
  W is what the budget leaves after everything above (planned for the expected number of sentences;
  lowered when the sentence vectors outgrow the plan, so the budget holds at every step).
Host tier: the post-RoPE K and V of every sentence that left the recent window (f16 by default, token-major,
pinned when the device is CUDA).

Every token keeps its own position (keys are stored post-RoPE), so like full KV the method holds at most
the model's trained context. Attention covers start + loaded sentences + pending tokens (causal by position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import CACHE_DTYPES, check_cache_dtype
from ..errors import BudgetError, SekvError, config_check
from ..models.config import ModelConfig
from ..models.rope import Rope
from ..sekv.buffers import FlatBuffer, RowBuffer, VecBuffer
from .attention import gqa_attention_parts
from .base import CachePolicy, register_policy, storage_bytes
from .budget import resolve_budget_bytes

_SENTENCE_END_CHARS = (b".", b"!", b"?", b"\n")
_SENTENCE_STEP = 64  # growth step (sentences) of the device sentence tables
_MAX_CHUNK = 1024  # prefill chunk cap: a larger pending buffer would only take bytes from the working set


def sentence_end_ids_from_tokenizer(tokenizer: Any) -> tuple[int, ...]:
    """Ids of the tokens whose text ends with '.', '!', '?' or a newline (control tokens render as
    nothing and are left out). One pass over the vocabulary: call once per engine, not per document."""
    ids = []
    for i in range(int(tokenizer.n_vocab)):
        if tokenizer.decode_bytes([i]).endswith(_SENTENCE_END_CHARS):
            ids.append(i)
    return tuple(ids)


def _parse_ids(value: Any) -> tuple[int, ...]:
    """sentence_end_ids from code (tuple/list) or from a command-line option ("13,30" or "13 30")."""
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str):
        parts = value.replace(",", " ").split()
        try:
            return tuple(int(p) for p in parts)
        except ValueError:
            raise SekvError(f"sentencekv: sentence_end_ids must be token ids like '13,30', got '{value}'") from None
    try:
        ids = tuple(value)
    except TypeError:
        raise SekvError(f"sentencekv: sentence_end_ids must be a list of token ids, got {value!r}") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise SekvError("sentencekv: sentence_end_ids must be integers")
    return ids


@dataclass(frozen=True)
class SentenceKVConfig:
    """n_start: first tokens kept exact (32 in the paper); n_recent: most recent tokens kept exact (32);
    sentence_end_ids: token ids that close a sentence (empty: cut every max_sentence tokens);
    min_sentence: a sentence end closes a sentence only once it has this many tokens (shorter pieces
    join the next sentence, so one-token "sentences" cannot blow up the device table);
    max_sentence: longest sentence (longer runs are cut); chunk_fraction: share of the budget a prefill
    chunk may take; dtype: storage of K/V (device and host) and of the sentence vectors."""

    n_start: int = 32
    n_recent: int = 32
    sentence_end_ids: tuple[int, ...] = ()
    min_sentence: int = 4
    max_sentence: int = 48
    chunk_fraction: float = 0.25
    dtype: str = "f16"

    def __post_init__(self) -> None:
        need = config_check("sentencekv")

        object.__setattr__(self, "sentence_end_ids", tuple(sorted(set(_parse_ids(self.sentence_end_ids)))))
        for name in ("n_start", "n_recent", "min_sentence", "max_sentence"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer")
        need(self.n_start >= 0, "n_start must be >= 0")
        need(self.n_recent >= 1, "n_recent must be >= 1")
        need(1 <= self.min_sentence <= self.max_sentence, "need 1 <= min_sentence <= max_sentence")
        need(all(i >= 0 for i in self.sentence_end_ids), "sentence_end_ids must be >= 0")
        need(isinstance(self.chunk_fraction, (int, float)) and 0 < self.chunk_fraction < 1,
             "chunk_fraction must be in (0, 1)")
        check_cache_dtype("sentencekv", self.dtype)


def sentence_lengths(is_end: torch.Tensor, min_len: int, max_len: int) -> list[int]:
    """Lengths of the complete sentences at the front of a token run that starts a sentence.

    is_end [N] bool: token i ends a sentence if the sentence so far has >= min_len tokens; a sentence
    is also cut when it reaches max_len tokens. The open tail is not returned. Causal: a prefix of the
    run gives a prefix of the answer, so the segmentation can be recomputed as tokens arrive."""
    n = int(is_end.shape[0])
    lengths: list[int] = []
    start = 0
    for end in torch.nonzero(is_end).flatten().tolist():  # one step per end token, not per token
        if end < start:
            continue
        length = end - start + 1
        if length > max_len:  # cut the overlong run into max_len pieces first
            full = (length - 1) // max_len
            lengths.extend([max_len] * full)
            start += full * max_len
            length -= full * max_len
        if length >= min_len:
            lengths.append(length)
            start = end + 1
    full = (n - start) // max_len
    lengths.extend([max_len] * full)
    return lengths


class SentenceKVCache(CachePolicy):
    name = "sentencekv"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = None, **options: Any) -> None:
        super().__init__(config, rope, device)
        known = set(SentenceKVConfig.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise SekvError(f"sentencekv: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        self.cfg = SentenceKVConfig(**options)
        bad = [i for i in self.cfg.sentence_end_ids if i >= config.vocab_size]
        if bad:
            raise SekvError(f"sentencekv: sentence_end_ids {bad[:5]} are outside the vocabulary ({config.vocab_size})")
        if isinstance(budget, float) and not 0 < budget <= 1:
            raise SekvError(f"sentencekv: a fractional budget must be in (0, 1], got {budget}")
        resolve_budget_bytes(budget, config, 1, self.name)  # refuses a missing or negative budget now
        self.budget_spec = budget
        self.end_ids = torch.tensor(self.cfg.sentence_end_ids, dtype=torch.long, device=self.device)
        dt, dev, KV, D = CACHE_DTYPES[self.cfg.dtype], self.device, config.n_kv_heads, config.head_dim
        pin = self.device.type == "cuda"
        # device sentence tables (grow by _SENTENCE_STEP; the slack is counted)
        self.sem_k = [RowBuffer(KV, D, dt, dev, _SENTENCE_STEP) for _ in range(config.n_layers)]
        self.sent_off = VecBuffer(torch.long, dev, _SENTENCE_STEP)  # first host row of each sentence
        self.sent_len = VecBuffer(torch.long, dev, _SENTENCE_STEP)
        # host tier: token-major rows [tokens, KV, D] of every offloaded sentence, flattened
        self.host_k = [FlatBuffer(dt, "cpu", pin) for _ in range(config.n_layers)]
        self.host_v = [FlatBuffer(dt, "cpu", pin) for _ in range(config.n_layers)]
        self.host_tokens = 0
        # last load per layer: sentence ids [KV, W] (-1 = empty slot), kept on the host for diagnostics
        self.selected: list[torch.Tensor | None] = [None] * config.n_layers
        self._plan_error: BudgetError | None = None
        try:
            self.reserve(config.context_length)
        except BudgetError as exc:
            if not isinstance(budget, int):
                raise
            self._plan_error = exc  # a byte budget may still fit the document reserve() announces

    # -- budget ----------------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Device bytes of one token slot over all layers (K and V, every KV head)."""
        c = self.config
        return c.n_layers * 2 * c.n_kv_heads * c.head_dim * CACHE_DTYPES[self.cfg.dtype].itemsize

    @property
    def sentence_bytes(self) -> int:
        """Device bytes of one sentence: mean key per layer and KV head + host offset and length."""
        c = self.config
        return c.n_layers * c.n_kv_heads * c.head_dim * CACHE_DTYPES[self.cfg.dtype].itemsize + 16

    def reserve(self, n_tokens: int) -> None:
        if self.n_tokens:
            raise SekvError("sentencekv: reserve() must come before the first token")
        cfg, c = self.cfg, self.config
        self.budget_bytes = resolve_budget_bytes(self.budget_spec, c, max(int(n_tokens), 1), self.name)
        pending_token = self.slot_bytes + 8 + 1  # K, V + position + end flag
        self.chunk_tokens = min(_MAX_CHUNK, max(1, int(self.budget_bytes // pending_token * cfg.chunk_fraction)))
        self.capacity = cfg.n_recent + cfg.max_sentence + self.chunk_tokens
        fixed = cfg.n_start * self.slot_bytes + self.capacity * pending_token + self.end_ids.numel() * 8
        expected = math.ceil(max(int(n_tokens) - cfg.n_start, 0) / ((cfg.min_sentence + cfg.max_sentence) / 2))
        sentences = -(-expected // _SENTENCE_STEP) * _SENTENCE_STEP
        free = self.budget_bytes - fixed - sentences * self.sentence_bytes
        self.working = free // self.slot_bytes
        if self.working < cfg.max_sentence:
            need = fixed + sentences * self.sentence_bytes + cfg.max_sentence * self.slot_bytes
            full = c.full_kv_bytes(max(int(n_tokens), 1))
            advice = (f"Use a budget of at least {need / full:.0%} of full KV (e.g. --budget {min(1.0, 1.25 * need / full):.2f})."
                      if need <= full else f"This document is too short for a fraction; use --budget {need / 2**20:.2f}MiB or more.")
            raise BudgetError(
                f"sentencekv: a budget of {self.budget_bytes / 2**20:.2f} MiB cannot hold {cfg.n_start} start tokens, "
                f"the recent window and a prefill chunk ({fixed / 2**20:.2f} MiB), about {expected} sentence vectors "
                f"({sentences * self.sentence_bytes / 2**20:.2f} MiB) and one sentence of working set. "
                f"{advice}")
        self._plan_error = None
        dt, dev, KV, D = CACHE_DTYPES[cfg.dtype], self.device, c.n_kv_heads, c.head_dim
        self.start_k = [torch.zeros(KV, cfg.n_start, D, dtype=dt, device=dev) for _ in range(c.n_layers)]
        self.start_v = [torch.zeros_like(t) for t in self.start_k]
        self.n_start_held = 0
        self.pend_k = [torch.zeros(KV, self.capacity, D, dtype=dt, device=dev) for _ in range(c.n_layers)]
        self.pend_v = [torch.zeros_like(t) for t in self.pend_k]
        self.pend_pos = torch.full((self.capacity,), -1, dtype=torch.long, device=dev)
        self.pend_end = torch.zeros(self.capacity, dtype=torch.bool, device=dev)
        self.pend_len = 0
        self._allocate_working(self.working)

    def _allocate_working(self, slots: int) -> None:
        c = self.config
        self.working = slots
        self.ws_k = [torch.zeros(c.n_kv_heads, slots, c.head_dim, dtype=CACHE_DTYPES[self.cfg.dtype], device=self.device)
                     for _ in range(c.n_layers)]
        self.ws_v = [torch.zeros_like(t) for t in self.ws_k]

    def _fixed_device_bytes(self, sentence_capacity: int) -> int:
        """Device bytes of everything but the working set, with the sentence tables at `sentence_capacity`."""
        fixed = storage_bytes(*self.start_k, *self.start_v, *self.pend_k, *self.pend_v)
        fixed += storage_bytes(self.pend_pos, self.pend_end, self.end_ids)
        return fixed + sentence_capacity * self.sentence_bytes

    def _fit_working_set(self, n_sentences: int) -> None:
        """Lower W before the sentence tables grow to hold n_sentences, so the budget holds throughout."""
        capacity = max(self.sent_len.data.shape[1], -(-n_sentences // _SENTENCE_STEP) * _SENTENCE_STEP)
        free = self.budget_bytes - self._fixed_device_bytes(capacity)
        if free < 0:
            raise BudgetError(f"sentencekv: {n_sentences} sentence vectors no longer fit a budget of "
                              f"{self.budget_bytes / 2**20:.2f} MiB; raise --budget or max_sentence/min_sentence")
        slots = free // self.slot_bytes
        if slots < self.working:
            self._allocate_working(slots)

    def max_chunk_tokens(self) -> int:
        return self.chunk_tokens

    # -- attention -----------------------------------------------------------------------------------
    def begin_chunk(self, positions: torch.Tensor, is_prefill: bool) -> None:
        if self._plan_error is not None:
            raise self._plan_error
        super().begin_chunk(positions, is_prefill)
        T = int(positions.shape[0])
        if self.pend_len + T > self.capacity:
            raise SekvError(f"sentencekv: a chunk of {T} tokens does not fit; chunks may hold at most "
                            f"{self.capacity - self.pend_len} tokens now (max_chunk_tokens {self.chunk_tokens})")
        self.pend_pos[self.pend_len: self.pend_len + T] = positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        KV, T = k.shape[0], k.shape[1]
        k_rot = self.rope.apply(k, self._positions, self._cos_sin)
        q_rot = self.rope.apply(q, self._positions, self._cos_sin)
        end = self.pend_len + T
        self.pend_k[layer][:, self.pend_len: end] = k_rot.to(self.pend_k[layer].dtype)
        self.pend_v[layer][:, self.pend_len: end] = v.to(self.pend_v[layer].dtype)

        keys, values, biases = [], [], []
        if self.n_start_held:
            keys.append(self.start_k[layer][:, : self.n_start_held].float())
            values.append(self.start_v[layer][:, : self.n_start_held].float())
            biases.append(torch.zeros(KV, T, self.n_start_held, device=self.device))
        if self.sent_len.length and self.working:
            valid = self._load(layer, q_rot)
            keys.append(self.ws_k[layer].float())
            values.append(self.ws_v[layer].float())
            biases.append(torch.where(valid, 0.0, float("-inf"))[:, None, :].expand(KV, T, -1))
        pos = self.pend_pos[:end]
        keys.append(self.pend_k[layer][:, :end].float())
        values.append(self.pend_v[layer][:, :end].float())
        causal = torch.where(pos[None, :] <= self._positions[:, None], 0.0, float("-inf"))
        biases.append(causal[None].expand(KV, T, -1))
        return gqa_attention_parts(q_rot, keys, values, biases)

    def _load(self, layer: int, q_rot: torch.Tensor) -> torch.Tensor:
        """Score sentences by q · mean key (max over the GQA group and the chunk's queries), fill the
        working set with the best ones per KV head; returns the valid-slot mask [KV, W]."""
        KV, W, D = self.config.n_kv_heads, self.working, self.config.head_dim
        sem = self.sem_k[layer].view().float()  # [KV, S, D]
        S = sem.shape[1]
        scores = torch.bmm(q_rot.reshape(KV, -1, D).float(), sem.transpose(1, 2)).amax(dim=1)  # [KV, S]
        order = torch.argsort(scores, dim=1, descending=True)
        lengths = self.sent_len.view()[order]  # [KV, S] in score order
        cum = lengths.cumsum(dim=1)
        total = torch.where(cum <= W, cum, 0).amax(dim=1)  # tokens of the best sentences that fit
        slot = torch.arange(W, device=self.device).expand(KV, W).contiguous()
        rank = torch.searchsorted(cum, slot, right=True).clamp_max(S - 1)  # sentence covering each slot
        valid = slot < total[:, None]
        sentence = order.gather(1, rank)
        within = slot - (cum.gather(1, rank) - lengths.gather(1, rank))
        row = torch.where(valid, self.sent_off.view()[sentence] + within, 0)
        row_h, self.selected[layer] = torch.stack([row, torch.where(valid, sentence, -1)]).cpu()  # one transfer
        # gather from host memory (token-major rows) and copy into the device working set
        n = self.host_tokens
        host_k = self.host_k[layer].valid().view(n, KV, D)
        host_v = self.host_v[layer].valid().view(n, KV, D)
        head_h = torch.arange(KV)[:, None].expand(KV, W)
        self.ws_k[layer].copy_(host_k[row_h, head_h], non_blocking=True)
        self.ws_v[layer].copy_(host_v[row_h, head_h], non_blocking=True)
        self._count_host_read(2 * int(valid.sum()) * D * host_k.element_size())  # the valid slots' K and V rows
        return valid

    # -- after each chunk: start tokens out of the pending buffer, finished sentences to host ----------
    def end_chunk(self, logits: torch.Tensor | None, token_ids: torch.Tensor) -> None:
        T = int(token_ids.shape[0])
        ids = token_ids.to(self.device)
        is_end = torch.isin(ids, self.end_ids) if self.end_ids.numel() else torch.zeros(T, dtype=torch.bool,
                                                                                         device=self.device)
        self.pend_end[self.pend_len: self.pend_len + T] = is_end
        self.pend_len += T
        super().end_chunk(logits, token_ids)  # counts tokens, notes the peak with this chunk held
        n_start = int((self.pend_pos[: self.pend_len] < self.cfg.n_start).sum())
        if n_start:
            a, b = self.n_start_held, self.n_start_held + n_start
            for layer in range(self.config.n_layers):
                self.start_k[layer][:, a:b] = self.pend_k[layer][:, :n_start]
                self.start_v[layer][:, a:b] = self.pend_v[layer][:, :n_start]
            self.n_start_held = b
            self._drop_pending(n_start)
        lengths = sentence_lengths(self.pend_end[: self.pend_len].cpu(), self.cfg.min_sentence, self.cfg.max_sentence)
        ends = torch.tensor(lengths, dtype=torch.long).cumsum(0)
        keep_from = self.pend_len - self.cfg.n_recent  # sentences ending before this left the window
        n_out = int((ends <= keep_from).sum()) if lengths else 0
        if n_out:
            self._offload(torch.tensor(lengths[:n_out], dtype=torch.long, device=self.device))
        self._note_peak()

    def _offload(self, lengths: torch.Tensor) -> None:
        """Move the first len(lengths) pending sentences to host and add their mean keys to the device."""
        n_sent = int(lengths.shape[0])
        consumed = int(lengths.sum())
        self._fit_working_set(self.sent_len.length + n_sent)
        sentence_of = torch.repeat_interleave(torch.arange(n_sent, device=self.device), lengths)  # [consumed]
        for layer in range(self.config.n_layers):
            k = self.pend_k[layer][:, :consumed]
            v = self.pend_v[layer][:, :consumed]
            KV, _, D = k.shape
            sums = torch.zeros(KV, n_sent, D, device=self.device).index_add_(1, sentence_of, k.float())
            self.sem_k[layer].append(sums / lengths[None, :, None])
            self.host_k[layer].append(k.transpose(0, 1).cpu())
            self.host_v[layer].append(v.transpose(0, 1).cpu())
        starts = self.host_tokens + torch.cumsum(lengths, 0) - lengths
        self.sent_off.append(starts)
        self.sent_len.append(lengths)
        self.host_tokens += consumed
        self._drop_pending(consumed)

    def _drop_pending(self, n: int) -> None:
        rest = self.pend_len - n
        for buf in self.pend_k + self.pend_v:
            buf[:, :rest] = buf[:, n: self.pend_len].clone()
        self.pend_pos[:rest] = self.pend_pos[n: self.pend_len].clone()
        self.pend_end[:rest] = self.pend_end[n: self.pend_len].clone()
        self.pend_pos[rest:] = -1
        self.pend_len = rest

    # -- rollback --------------------------------------------------------------------------------------
    def _checkpoint(self) -> dict[str, Any]:
        """Counts of the append-only parts and a host copy of the pending rows (they are shifted in place)."""
        p = self.pend_len
        return {"n_tokens": self.n_tokens, "start": self.n_start_held, "sentences": self.sent_len.length,
                "host_tokens": self.host_tokens, "pend_pos": self.pend_pos[:p].cpu().clone(),
                "pend_end": self.pend_end[:p].cpu().clone(),
                "pend": [(k[:, :p].cpu().clone(), v[:, :p].cpu().clone()) for k, v in zip(self.pend_k, self.pend_v)]}

    def _restore(self, mark: dict[str, Any]) -> None:
        self.n_tokens, self.n_start_held, self.host_tokens = mark["n_tokens"], mark["start"], mark["host_tokens"]
        S = mark["sentences"]
        self.sent_off.truncate(S)
        self.sent_len.truncate(S)
        row = self.config.n_kv_heads * self.config.head_dim
        for layer, (pk, pv) in enumerate(mark["pend"]):
            self.sem_k[layer].truncate(S)
            self.host_k[layer].truncate(self.host_tokens * row)
            self.host_v[layer].truncate(self.host_tokens * row)
            self.pend_k[layer][:, : pk.shape[1]] = pk.to(self.device)
            self.pend_v[layer][:, : pv.shape[1]] = pv.to(self.device)
        p = mark["pend_pos"].shape[0]
        self.pend_pos.fill_(-1)
        self.pend_pos[:p] = mark["pend_pos"].to(self.device)
        self.pend_end[:p] = mark["pend_end"].to(self.device)
        self.pend_len = p
        self.selected = [None] * self.config.n_layers

    # -- accounting ------------------------------------------------------------------------------------
    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        if self._plan_error is not None:  # nothing allocated until reserve() finds a plan
            return []
        tensors = [self.start_k[layer], self.start_v[layer], self.pend_k[layer], self.pend_v[layer],
                   self.sem_k[layer].data, self.ws_k[layer], self.ws_v[layer]]
        if layer == 0:
            tensors += [self.pend_pos, self.pend_end, self.end_ids, self.sent_off.data, self.sent_len.data]
        return tensors

    def host_tensors(self, layer: int) -> list[torch.Tensor]:
        return [self.host_k[layer].data, self.host_v[layer].data]

    def observations(self) -> dict[str, Any]:
        return {"sentences": self.sent_len.length, "host_tokens": self.host_tokens,
                "pending_tokens": self.pend_len, "working_set_tokens": self.working}


SentenceKVCache.sentence_end_ids_from_tokenizer = staticmethod(sentence_end_ids_from_tokenizer)  # type: ignore[attr-defined]


@register_policy("sentencekv")
def _make(**kwargs: Any) -> SentenceKVCache:
    return SentenceKVCache(**kwargs)
