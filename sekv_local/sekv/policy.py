"""`sekv`: the SeKV cache policy (docs/DESIGN.md §5) behind the common CachePolicy interface.

Per layer the device tier holds: exact tokens (attention sinks and anchors), the pending tokens
(recent window, the current prefill chunk, question and generated tokens, all exact), and per span
and KV head a summary key/value and a routing key. Spans' SVD factors sit in host RAM (FactorStore).
Device rows (exact tokens, pending tokens, span summaries) are kept post-RoPE at their own positions so
a decode step rotates nothing but the rebuilt rows; host factors are pre-RoPE (keys are far more
low-rank before RoPE; compression un-rotates them, which is exact since RoPE is orthogonal) and get
their positions when rebuilt. The "bounded" position strategy re-rotates device rows by the shift.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..cache.attention import attention_with_lse, gqa_attention_parts, merge_attention
from ..cache.base import CachePolicy, register_policy, storage_bytes
from ..dtypes import CACHE_DTYPES
from ..errors import BudgetError, SekvError
from ..models.config import ModelConfig
from ..models.rope import Rope
from ..quant_blocks import BLOCK_BYTES, QK
from .buffers import RowBuffer, VecBuffer
from .config import FILE_CHOICES, SHORTLIST_ABOVE, SHORTLIST_ROWS, SekvConfig
from .factors import FactorStore
from .question import (PinnedRows, block_attention_with_span_lse, pick_spans, question_span_score, voted_spans,
                       spread_to_neighbours)
from .router import Router, bound_scores, key_bounds
from .segmentation import RunningStats, segment, token_surprisal

# (l_min, l_max) ladder the budget planner climbs when summaries would not fit
_SPAN_LADDER = (1, 2, 4)  # multipliers of l_min (capped at l_max / 2)
_ZOOM_LADDER = (1, 2, 4)  # divisors of zoom_k tried when the budget is tight (a smaller zoom pool)
_AUTO_MIN_ZOOM = 16  # "auto" zoom: coarser spans are tried while the pool would hold fewer spans than this
_ROW_STEP = 16  # growth step of the device row buffers: their slack counts against the budget
_POSITION_MARGIN = 64  # "bounded": far memory sits this far inside the trained window
#: read_budget "auto" with select=question: host bytes a decode step may gather, as a share of full KV
AUTO_READ_BUDGET = 0.05
#: device tier when none is given (a fraction of full KV)
DEFAULT_BUDGET = 0.25


class _SpanIds:
    """Process-wide span identities: a span keeps its id while it lives, a span made after a rollback (or in
    another memory) gets a new one, so a copy of the spans elsewhere (the native host rows) can tell which of its
    spans are still these."""

    next = 0

    @classmethod
    def fresh(cls, n: int) -> torch.Tensor:
        ids = torch.arange(cls.next, cls.next + n, dtype=torch.long)
        cls.next += n
        return ids
#: answer tokens whose new span summaries and anchors the question-time pins leave room for
_ANSWER_ROOM = 256
#: how far below every relevance logit the zoom thresholds go when the learned router fills the pool
FILL_THRESHOLD = 1e30


@dataclass
class _Layer:
    exact_k: RowBuffer
    exact_v: RowBuffer
    pend_k: RowBuffer
    pend_v: RowBuffer
    sum_k: RowBuffer
    sum_v: RowBuffer
    route_k: RowBuffer
    bound_k: RowBuffer  # "bounds" router: per span [min | max] of its post-RoPE keys, [KV, S, 2D]
    fac_k: FactorStore  # shared by the layers of a window when share_layers > 1 (sekv+xkv)
    fac_v: FactorStore
    slot: int = 0  # index of this layer inside its window
    window_first: bool = True  # owns (saves, counts) the window's factor stores


class SekvCache(CachePolicy):
    name = "sekv"
    needs_token_scores = True

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device | str = "cpu",
                 budget: float | int | None = 0.25, router_module: Router | None = None,
                 **options: Any) -> None:
        super().__init__(config, rope, device)
        self.cfg = SekvConfig.from_options(options)
        # no budget given: DEFAULT_BUDGET, or the least that holds the minimum plan where a short document
        # needs more (a budget the user gives is refused instead)
        self.budget_given = budget is not None
        if budget is None:
            budget = DEFAULT_BUDGET
        if isinstance(budget, float) and not 0 < budget <= 1:
            raise SekvError(f"sekv: a fractional budget must be in (0, 1], got {budget}")
        self.budget_spec = budget
        use = router_module is not None and self.cfg.trained
        self.router = router_module if use else Router(config, self.cfg)
        self._settle_auto_options()
        dt = CACHE_DTYPES[self.cfg.dtype]
        KV, D = config.n_kv_heads, config.head_dim
        if self.cfg.host_quant != "none" and D % QK:
            raise SekvError(f"sekv: host_quant={self.cfg.host_quant} stores rows of head_dim values in blocks of {QK}; "
                            f"this model's head_dim is {D}")
        dp = self.router.routing_dim
        pin = self.device.type == "cuda"
        dev = self.device
        step = _ROW_STEP
        G = self.cfg.share_layers
        self.layers = []
        for layer in range(config.n_layers):
            slot = layer % G
            if slot == 0:  # one store per window; G = 1: per layer, per KV head ([KV, L, r] x [KV, r, D])
                width = min(G, config.n_layers - layer) * KV * D
                hq = None if self.cfg.host_quant == "none" else self.cfg.host_quant
                stores = (FactorStore(KV, D, dt, pin, hq), FactorStore(KV, D, dt, pin, hq)) if G == 1 else \
                    (FactorStore(1, width, dt, pin, hq), FactorStore(1, width, dt, pin, hq))
            self.layers.append(_Layer(RowBuffer(KV, D, dt, dev, step), RowBuffer(KV, D, dt, dev, step),
                                      RowBuffer(KV, D, dt, dev, step), RowBuffer(KV, D, dt, dev, step),
                                      RowBuffer(KV, D, dt, dev, step), RowBuffer(KV, D, dt, dev, step),
                                      RowBuffer(KV, dp, dt, dev, step), RowBuffer(KV, 2 * D, dt, dev, step),
                                      *stores, slot=slot, window_first=slot == 0))
        self.exact_pos = VecBuffer(torch.long, dev, step)
        self.pend_pos = VecBuffer(torch.long, dev, step)
        self.pend_surprisal = VecBuffer(torch.float32, dev, step)
        self.span_pos = VecBuffer(torch.long, dev, step)
        self.span_len = VecBuffer(torch.long, dev, step)
        self.span_ids = VecBuffer(torch.long, "cpu", step)  # [S] (see _SpanIds)
        self.stats = RunningStats()
        self._zoom_events: list[tuple[int, torch.Tensor]] = []
        self._step_zoom_k = 0  # this step's pool (the planned one, or more with pool=free)
        self._shift = 0
        self._zoom_bytes = 0
        self._doc_read = False  # the document is in; a later prefill is a question (select=question)
        self._question = False  # this chunk is a question's: exact attention over every span, then pins
        self._replay = False  # chunks are an answer decoded elsewhere, fed back (see `replaying`): not questions
        self._pins: list[PinnedRows | None] = [None] * config.n_layers
        self._question_mass: list[torch.Tensor | None] = [None] * config.n_layers  # per layer [S]
        self._question_block = 1
        # reread=far: the ids of the question read so far (None once a fold took some of its rows), and the ids
        # handed back to the engine to read again (their surprisal stays the first reading's)
        self._question_ids: list[int] | None = []
        self._again: list[int] = []
        self._reread_left = 0  # tokens of `_again` still to come back
        self.planned_tokens = config.context_length
        # the vocabulary rows surprisal normalises over (None: all): sorted ids, replaced (never changed in
        # place) as tokens arrive, so a checkpoint holds the set of its time by reference
        self._score_vocab = self._initial_score_vocab()
        self._plan()

    def _initial_score_vocab(self) -> torch.Tensor | None:
        """surprisal_vocab settled: the leading rows of the shortlist, or None for the whole vocabulary."""
        option, vocab = self.cfg.surprisal_vocab, self.config.vocab_size
        if option == "auto":
            option = SHORTLIST_ROWS if vocab > SHORTLIST_ABOVE else "all"
        if option == "all" or option >= vocab:
            return None
        return torch.arange(option, dtype=torch.long)

    def score_rows(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        if self._score_vocab is None:
            return None
        self._score_vocab = torch.unique(torch.cat([self._score_vocab, token_ids.to("cpu", torch.long)]))
        return self._score_vocab

    def _settle_auto_options(self) -> None:
        """Options left "auto": once trained parameters exist, what their file names (routing: the learned
        formula or the union with the attention rule; rank rule: span, row or exact); before, the training-free
        attention rule and the span rule."""
        def settle(option: str, untrained: str) -> str:
            value = getattr(self.cfg, option)
            if value != "auto":
                return value
            return self.router.auto_choices[option] if self.router.trained else untrained

        self.router_kind = settle("router", "attention")
        self._bounds = self.router_kind == "bounds"
        self.rank_rule = settle("rank_rule", "span")
        self.free_pool = settle("pool", "fixed") == "free" and self.cfg.zoom_k == "auto"

    # -- budget ------------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        """Device bytes of one exact token over all layers (K post-RoPE at its own position, V) plus its position."""
        c = self.config
        return c.n_layers * 2 * c.n_kv_heads * c.head_dim * CACHE_DTYPES[self.cfg.dtype].itemsize + 8

    @property
    def pin_row_bytes(self) -> int:
        """Device bytes of one pinned row of one layer: K and V for every KV head plus its position."""
        c = self.config
        return 2 * c.n_kv_heads * c.head_dim * CACHE_DTYPES[self.cfg.dtype].itemsize + 8

    @property
    def router_bytes(self) -> int:
        """Bytes of the router's parameters (projections, thresholds, rank gate): held beside the device tier."""
        return storage_bytes(*self._router_tensors())

    def _router_tensors(self) -> list[torch.Tensor]:
        return [t.detach() for t in (*self.router.parameters(), *self.router.buffers())]

    @property
    def span_bytes(self) -> int:
        """Device bytes of one span over all layers: summary K, V and routing key per KV head + metadata."""
        c = self.config
        width = 2 * c.head_dim + self.router.routing_dim + (2 * c.head_dim if self._bounds else 0)
        return c.n_layers * c.n_kv_heads * width * CACHE_DTYPES[self.cfg.dtype].itemsize + 16

    def reserve(self, n_tokens: int) -> None:
        """Plan the budget for a context of about n_tokens (document + room for the conversation)."""
        self.planned_tokens = max(int(n_tokens), 1)
        self._plan()

    def _plan(self) -> None:
        self._plan_pool()
        self.step_slots = self._read_budget_slots()

    def read_budget_bytes(self) -> int | None:
        """Host bytes a decode step may gather (None: unbounded)."""
        budget = self.cfg.read_budget
        if budget == "auto":
            budget = AUTO_READ_BUDGET if self.cfg.select == "question" else None
        if budget is None:
            return None
        return int(budget * self.config.full_kv_bytes(self.planned_tokens)) if isinstance(budget, float) else int(budget)

    def decode_zoom_k(self) -> int:
        """Spans a decode step routes per layer and KV head: the pool, capped by the read budget when the
        question's pins carry the rest (select=question)."""
        return min(self.zoom_k, self.step_slots) if self.cfg.select == "question" else self.zoom_k

    def pins(self, layer: int) -> PinnedRows | None:
        """`layer`'s pinned spans for the current answer (select=question), None when it has none."""
        return self._pins[layer]

    def _read_budget_slots(self) -> int:
        """Spans a decode step may route and rebuild per layer and KV head: the planned pool, capped by the
        read budget at the worst case of a span (l_max raw rows of K and V as the host tier stores them)."""
        read = self.read_budget_bytes()
        if read is None:
            return self.zoom_k
        c = self.config
        per_slot = c.n_layers * c.n_kv_heads * 2 * self.l_max * c.head_dim * self.host_value_bytes
        return int(min(self.zoom_k, read // per_slot))

    @property
    def host_value_bytes(self) -> float:
        """Bytes one value of the host tier takes (block-quantized: its share of a block's scale too)."""
        if self.cfg.host_quant == "none":
            return float(CACHE_DTYPES[self.cfg.dtype].itemsize)
        return BLOCK_BYTES[self.cfg.host_quant] / QK

    def _plan_pool(self) -> None:
        full = self.config.full_kv_bytes(self.planned_tokens)
        self.budget_bytes = int(self.budget_spec * full) if isinstance(self.budget_spec, float) else int(self.budget_spec)
        while True:
            try:
                return self._plan_pool_within()
            except BudgetError:
                if self.budget_given:
                    raise
                self.budget_bytes = int(1.25 * self.budget_bytes) + 1

    def _plan_pool_within(self) -> None:
        """The plan for budget_bytes (BudgetError when even the cheapest does not fit)."""
        cfg, c = self.cfg, self.config
        full = c.full_kv_bytes(self.planned_tokens)
        budget_tokens = self.budget_bytes // self.token_bytes
        self.recent = max(min(cfg.recent, int(0.15 * budget_tokens)), 8)
        self.chunk_tokens = int(min(1024, max(16, 0.25 * budget_tokens)))
        # cheaper plans in turn: longer minimum spans (fewer summaries), then a smaller zoom pool
        auto = cfg.zoom_k == "auto"
        zooms = [None] if auto else sorted({max(cfg.zoom_k // d, min(cfg.zoom_k, 1)) for d in _ZOOM_LADDER}, reverse=True)
        fallback = None
        for zoom_k in zooms:
            for mult in _SPAN_LADDER:
                l_min, l_max = min(cfg.l_min * mult, cfg.l_max // 2), cfg.l_max
                self.l_min, self.l_max = l_min, l_max
                # growth slack of the row buffers (exact and pending rows, summaries) is allocated too
                base = (cfg.n_sink + self.recent + self.chunk_tokens + l_max + 2 * _ROW_STEP) * self.token_bytes \
                    + _ROW_STEP * self.span_bytes + self.router_bytes
                spans = math.ceil(self.planned_tokens / ((l_min + l_max) / 2))
                if auto:  # the zoom pool takes what the summaries leave, up to every span
                    self.zoom_k = 1
                    fit = (self.budget_bytes - base - spans * self.span_bytes) // self.zoom_pool_bytes()
                    self.zoom_k = int(min(fit, spans))
                    if self.zoom_k < min(_AUTO_MIN_ZOOM, spans):
                        if self.zoom_k >= 1 and fallback is None:
                            fallback = (l_min, self.zoom_k)
                        continue
                else:
                    self.zoom_k = zoom_k
                fixed = base + self.zoom_pool_bytes()
                if fixed + spans * self.span_bytes <= self.budget_bytes:
                    self.fixed_bytes = fixed
                    return
        if fallback is not None:  # a small pool with fine spans beats no plan at all
            self.l_min, self.zoom_k = fallback
            self.fixed_bytes = base + self.zoom_pool_bytes()  # base does not depend on l_min
            return
        self.zoom_k = max(self.zoom_k, 1)
        fixed = base + self.zoom_pool_bytes()
        best = fixed + spans * self.span_bytes  # the cheapest plan tried
        raise BudgetError(
            f"sekv: a budget of {self.budget_bytes / 2**20:.1f} MiB ({self.budget_bytes / full:.1%} of full KV for "
            f"{self.planned_tokens} tokens) cannot hold even the minimum: recent window, prefill chunk and zoom pool "
            f"need {fixed / 2**20:.1f} MiB and span summaries at least {(best - fixed) / 2**20:.1f} MiB. "
            f"Use a budget of at least {math.ceil(100 * best / full)}% (e.g. --budget {min(1.0, 1.25 * best / full):.2f}).")

    @property
    def zoom_dtype(self) -> torch.dtype:
        """Type of the rebuilt (zoomed) rows. Raw spans (rank rule "exact") come back from the host exactly
        as stored, so they stay at the cache dtype: a float32 copy would hold the same values in twice the
        device bytes. Factored spans keep their U @ W products in float32."""
        return CACHE_DTYPES[self.cfg.dtype] if self.rank_rule == "exact" else torch.float32

    def zoom_pool_bytes(self, spans: int | None = None) -> int:
        """One layer's rebuilt K and V rows (at `zoom_dtype`) for `spans` spans (the planned pool by default):
        the zoom working set of a step."""
        c = self.config
        item = self.zoom_dtype.itemsize
        return 2 * c.n_kv_heads * (self.zoom_k if spans is None else spans) * self.l_max * c.head_dim * item

    def max_chunk_tokens(self) -> int:
        # a question read again is read as a fed-back answer: in the pieces the room beside the pins holds
        return self.replay_chunk_tokens() if self._reread_left else self.chunk_tokens

    def max_tokens(self) -> int | None:
        return None if self.cfg.positions == "bounded" else self.config.context_length

    # -- positions ---------------------------------------------------------------------------------
    def is_question_chunk(self, is_prefill: bool) -> bool:
        """Whether the next chunk is a question's (select=question: a prefill after the document, not an answer
        fed back): it attends exactly over every span and chooses the answer's pins."""
        return self.cfg.select == "question" and is_prefill and self._doc_read and self.span_len.length > 0 \
            and not self._replay

    def begin_chunk(self, positions: torch.Tensor, is_prefill: bool) -> None:
        question = self.is_question_chunk(is_prefill)
        if question and self.pend_pos.length - self.recent >= self.l_max:
            # a question longer than a chunk: what its earlier chunks left past the recent window folds, as a
            # prefill's would, so the pending rows stay within the room the plan holds for them (the last
            # answer's pins go first: the question chooses its own)
            self._pins = [None] * self.config.n_layers
            self._compress()
            self._question_ids = None
        self._positions = positions
        self._is_prefill = is_prefill
        self.pend_pos.append(positions)
        if self.cfg.positions == "bounded":
            # RoPE sees only differences: shift everything so the newest query sits inside the trained
            # window; keys that would fall before 0 share position 0 (one fixed distance, as InfLLM).
            self._shift = max(0, int(positions.max()) + 1 + _POSITION_MARGIN - self.config.context_length)
        self._q_cos_sin = self.rope.cos_sin(positions - self._shift)
        self._k_cos_sin = self._q_cos_sin if self._shift == 0 else self.rope.cos_sin(positions)
        self._count_step()
        self._question = question
        if self._question:
            self._begin_question(int(positions.shape[0]))
        self._step_zoom_k = self.zoom_k if not self.free_pool else self._free_zoom_k(int(positions.shape[0]))
        if (not is_prefill or self._replay) and self.cfg.select == "question":
            self._step_zoom_k = min(self._step_zoom_k, self.step_slots)
        elif is_prefill and not question and self.cfg.prefill_reads == "read_budget":
            self._step_zoom_k = min(self._step_zoom_k, self.step_slots)

    def _begin_question(self, n_new: int) -> None:
        """A question arrives: drop the previous answer's pins; its pass rebuilds spans in blocks that fit the
        device room left after the pending rows grow by the question (the planned pool at least)."""
        self._pins = [None] * self.config.n_layers
        free = self.budget_bytes - self.device_bytes_now() - self._pending_growth(n_new)
        n_spans = self.span_len.length
        block = n_spans if self.zoom_pool_bytes(n_spans) <= free else max(free, 0) // self.zoom_pool_bytes(1)
        self._question_block = int(max(block, min(self.zoom_k, n_spans), 1))

    def _pending_growth(self, n_new: int) -> int:
        """Device bytes the pending rows grow by when n_new tokens arrive (they grow in whole steps)."""
        pend = self.layers[0].pend_k
        need = pend.length + n_new
        return max(-(-need // pend.step) * pend.step - pend.data.shape[1], 0) * (self.token_bytes + 4)

    def _pin_room(self) -> int:
        """Pinned rows per layer the device budget holds for an answer: the room after what the tensors hold
        now, the pending rows' growth until the answer's first compression, the summaries and anchors of
        an answer, and a decode step's routed pool."""
        c = self.config
        # the answer's summaries and anchors, plus one growth step of their buffers
        answer = (math.ceil(_ANSWER_ROOM / max(self.l_min, 1)) + _ROW_STEP) * self.span_bytes \
            + (int(self.cfg.anchor_fraction * _ANSWER_ROOM) + _ROW_STEP) * self.token_bytes
        room = self.l_max + _ROW_STEP if self.cfg.answer_room == "auto" else min(self.cfg.answer_room, self.chunk_tokens)
        free = self.budget_bytes - self.device_bytes_now() - self._pending_growth(room) - answer \
            - self.zoom_pool_bytes(self.step_slots)
        return int(max(free, 0) // (c.n_layers * self.pin_row_bytes))

    def _free_zoom_k(self, n_new: int) -> int:
        """pool=free: the spans this step can rebuild within the budget, from the bytes the device tensors
        hold now, the growth of the pending buffers by this step's n_new tokens (they grow in whole
        steps) and one layer's rebuilt rows per span; never fewer than the planned pool (the plan already
        holds room for it)."""
        held = self.device_bytes_now()
        pend = self.layers[0].pend_k
        rows = -(-(pend.length + n_new) // pend.step) * pend.step - pend.data.shape[1]
        growth = max(rows, 0) * (self.token_bytes + self.pend_surprisal.data.element_size())
        free = (self.budget_bytes - held - growth) // self.zoom_pool_bytes(1)
        return int(max(self.zoom_k, min(free, self.span_len.length)))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on pre-RoPE x [..., N, D] (any float dtype -> float32) at positions [N] or [KV, N],
        moved by the position strategy's shift."""
        p = (positions - self._shift).clamp_min(0)
        return self._rotate(x, p)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions.reshape(-1))
        if positions.dim() == 2:
            cos, sin = cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        return self.rope.apply(x.float(), positions, (cos, sin))

    def _placed(self, x_post: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device rows stored post-RoPE at `positions` [N], as attention sees them now (float32)."""
        if self._shift == 0:
            return x_post.float()
        moved = (positions - self._shift).clamp_min(0)
        return self._rotate(x_post, moved - positions)  # rotations compose: RoPE(a) then RoPE(d) = RoPE(a + d)

    # -- attention ---------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        L = self.layers[layer]
        L.pend_k.append(self.rope.apply(k, self._positions, self._k_cos_sin))  # stored at own positions
        L.pend_v.append(v)
        KV, T = self.config.n_kv_heads, q.shape[1]
        q_rot = self.rope.apply(q, self._positions, self._q_cos_sin)
        pos_q = self._positions
        keys, values, biases = [], [], []

        if self.exact_pos.length:
            keys.append(self._placed(L.exact_k.view(), self.exact_pos.view()))
            values.append(L.exact_v.view().float())
            biases.append(torch.zeros(KV, 1, self.exact_pos.length))

        pend_pos = self.pend_pos.view()
        keys.append(self._placed(L.pend_k.view(), pend_pos))
        values.append(L.pend_v.view().float())
        causal = torch.where(pend_pos[None, :] <= pos_q[:, None], 0.0, float("-inf"))  # [T, P]
        biases.append(causal[None].expand(KV, T, -1))

        if self._question:
            return self._attend_question(layer, L, q_rot, keys, values, biases)
        pins = self._pins[layer]
        if pins is not None:
            keys.append(self._placed(pins.k, pins.pos))
            values.append(pins.v.float())
            biases.append(torch.zeros(KV, 1, pins.pos.shape[0]))

        n_spans = self.span_len.length
        if n_spans:
            lengths = self.span_len.view()
            centers = self.span_pos.view() + lengths // 2
            sum_k = self._placed(L.sum_k.view(), centers)  # [KV, S, D]
            log_len = lengths.float().log()
            span_bias = log_len[None, None, :].expand(KV, 1, n_spans)
            if self.cfg.summary_bias != 1.0:
                span_bias = span_bias * self.cfg.summary_bias if self.cfg.summary_bias > 0 \
                    else torch.full_like(span_bias, float("-inf"))
            pinned = None if pins is None else pins.mask_for(n_spans)
            if pinned is not None:  # pinned spans are attended at full resolution: their coarse rows go out
                span_bias = torch.where(pinned[None, None, :], float("-inf"), span_bias)
            k_zoom = min(self._step_zoom_k, n_spans - (0 if pinned is None else int(pinned.sum())))
            if k_zoom:
                chosen = self._route(layer, q, q_rot, sum_k, L, log_len, k_zoom, pinned)  # [KV, k], -1 = unused
                valid = chosen >= 0
                chosen_c = chosen.clamp_min(0)
                zoomed = torch.zeros(KV, n_spans, dtype=torch.long).scatter_add_(1, chosen_c, valid.long()) > 0
                span_bias = torch.where(zoomed[:, None, :], float("-inf"), span_bias)  # expanded: coarse row out
                zk, zv, zpos, zbias = self._rebuild(L, chosen_c, valid)
                self._zoom_bytes = max(self._zoom_bytes, storage_bytes(zk, zv))
                keys.append(self._rope(zk, zpos))
                values.append(zv.float())
                biases.append(zbias[:, None, :])
                self._zoom_events.append((layer, chosen))
            keys.append(sum_k)
            values.append(L.sum_v.view().float())
            biases.append(span_bias)

        return gqa_attention_parts(q_rot, keys, values, biases)

    def _route(self, layer: int, q: torch.Tensor, q_rot: torch.Tensor, sum_k_rot: torch.Tensor, L: _Layer,
               log_len: torch.Tensor, k_zoom: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """Spans to rebuild per KV head [KV, k] (-1 where fewer pass the threshold); spans in `exclude` [S]
        (pinned ones) are never picked."""
        H, KV = q.shape[0], self.config.n_kv_heads
        G = H // KV
        if exclude is not None:  # an excluded span's log-length is -inf: every rule below scores it -inf
            log_len = torch.where(exclude, float("-inf"), log_len)
        if self._bounds:
            # Quest-style upper bound of q.k over the span's tokens at their original positions
            q_own = self.rope.apply(q, self._positions, self._k_cos_sin) if self._shift else q_rot
            bound = bound_scores(q_own, L.bound_k.view().repeat_interleave(G, dim=0))  # [H, T, S]
            score = bound.view(KV, G, -1, bound.shape[-1]).amax(dim=(1, 2))
            if exclude is not None:
                score = score.masked_fill(exclude, float("-inf"))
            return torch.topk(score, k_zoom, dim=-1).indices
        if self.router_kind in ("attention", "union"):
            logits = q_rot @ sum_k_rot.repeat_interleave(G, dim=0).transpose(1, 2) / math.sqrt(q.shape[-1])
            attention = (logits + log_len).view(KV, G, -1, logits.shape[-1]).amax(dim=(1, 2))  # [KV, S]
            if self.router_kind == "attention":
                return torch.topk(attention, k_zoom, dim=-1).indices
        logits = self.router.relevance_logits(layer, q, L.route_k.view(), log_len)  # [H, T, S]
        passed = logits > self.zoom_thresholds()[layer][:, None, None]
        score = torch.where(passed, logits, float("-inf")).view(KV, G, -1, logits.shape[-1]).amax(dim=(1, 2))
        first = []
        if self.router_kind == "union":  # half the pool by the attention rule, the rest by the learned score
            first = [torch.topk(attention, (k_zoom + 1) // 2, dim=-1).indices]
            score = score.scatter(-1, first[0], float("-inf"))
            k_zoom -= first[0].shape[-1]
        top = torch.topk(score, k_zoom, dim=-1)
        return torch.cat(first + [torch.where(torch.isfinite(top.values), top.indices, -1)], dim=-1)

    def zoom_thresholds(self) -> torch.Tensor:
        """Per-layer, per-head thresholds [L, H] a span's relevance logit must pass to be zoomed: the learned
        router's, or with `fill` far below any logit (finite: the native graph takes them as data)."""
        thresholds = self.router.threshold_logit.detach()
        return torch.full_like(thresholds, -FILL_THRESHOLD) if self.cfg.fill else thresholds

    def _rebuild(self, L: _Layer, chosen: torch.Tensor, valid: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of the chosen spans from their factors: K, V [KV, k*pad, D], positions [KV, k*pad],
        bias [KV, k*pad] (0 for real rows, -inf for padding and unused slots)."""
        KV, k = chosen.shape
        pad = int(self.span_len.view().max())
        heads = torch.arange(KV).repeat_interleave(k)
        spans = chosen.reshape(-1).cpu()
        lengths = self.span_len.view()
        dt = self.zoom_dtype
        read = valid.reshape(-1).cpu()  # unused slots read nothing
        if self.cfg.share_layers == 1:
            zk = L.fac_k.rebuild(heads, spans, lengths, pad).to(self.device, dt).view(KV, k * pad, -1)
            zv = L.fac_v.rebuild(heads, spans, lengths, pad).to(self.device, dt).view(KV, k * pad, -1)
            self._count_host_read(L.fac_k.stored_bytes(heads[read], spans[read], lengths)
                                  + L.fac_v.stored_bytes(heads[read], spans[read], lengths))
        else:  # the layer's columns of the window's shared factors: features are (layer, head, dim)
            D = self.config.head_dim
            columns = (L.slot * KV + heads) * D
            one = torch.zeros_like(heads)
            zk = L.fac_k.rebuild(one, spans, lengths, pad, columns, D).to(self.device, dt).view(KV, k * pad, -1)
            zv = L.fac_v.rebuild(one, spans, lengths, pad, columns, D).to(self.device, dt).view(KV, k * pad, -1)
            self._count_host_read(L.fac_k.stored_bytes(one[read], spans[read], lengths, D)
                                  + L.fac_v.stored_bytes(one[read], spans[read], lengths, D))
        t = torch.arange(pad, device=self.device)
        span_start = self.span_pos.view()[chosen]  # [KV, k]
        zpos = (span_start[..., None] + t).view(KV, k * pad)
        ok = (t[None, None, :] < lengths[chosen][..., None]) & valid[..., None]
        zbias = torch.where(ok, 0.0, float("-inf")).view(KV, k * pad)
        return zk, zv, zpos, zbias

    # -- question-time selection ---------------------------------------------------------------------
    def _attend_question(self, layer: int, L: _Layer, q_rot: torch.Tensor, keys: list[torch.Tensor],
                         values: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
        """A question's chunk attends exactly over everything: device rows (`keys`, `values`, `biases`: exact
        and pending rows) and every span's rows, rebuilt from the host tier in blocks of spans (a bounded
        device working set; the blocks' softmaxes are merged into one). The attention mass each span gets
        from the question ranks the spans this layer pins for the answer. q_rot [H, T, D] -> [H, T, D]."""
        KV, T = self.config.n_kv_heads, q_rot.shape[1]
        bias = torch.cat([b.expand(KV, T, -1) for b in biases], dim=2)
        parts = [attention_with_lse(q_rot, torch.cat(keys, dim=1), torch.cat(values, dim=1), bias=bias)]
        span_lse = []
        n_spans = self.span_len.length
        for first in range(0, n_spans, self._question_block):  # a few blocks: the device room bounds them
            ids = torch.arange(first, min(first + self._question_block, n_spans), device=self.device)
            chosen = ids[None, :].expand(KV, -1)
            zk, zv, zpos, zbias = self._rebuild(L, chosen, torch.ones_like(chosen, dtype=torch.bool))
            self._zoom_bytes = max(self._zoom_bytes, storage_bytes(zk, zv))
            out, lse, per_span = block_attention_with_span_lse(q_rot, self._rope(zk, zpos), zv, zbias, ids.numel())
            parts.append((out, lse))
            span_lse.append(per_span)
        total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)  # [H, T]
        mass = question_span_score(torch.exp(torch.cat(span_lse, dim=-1) - total[..., None]), self.cfg.pin_score)
        before = self._question_mass[layer]  # a question longer than one chunk: its best mass per span
        if before is not None:  # spans folded between its chunks had no mass from the earlier ones
            before = torch.cat([before, before.new_zeros(mass.shape[0] - before.shape[0])])
        self._question_mass[layer] = mass if before is None else torch.maximum(before, mass)
        return merge_attention(parts)

    def _pin_question(self) -> None:
        """The question is read: its pass's blocks are gone, and the pending rows give back the prefill chunk's
        room; pin, per layer, the spans with the most question mass in the rows that room holds."""
        for buf in (self.pend_pos, self.pend_surprisal, *(b for L in self.layers for b in (L.pend_k, L.pend_v))):
            buf.shrink()
        rows = self._pin_room()
        asked = [layer for layer, mass in enumerate(self._question_mass) if mass is not None]
        if asked:
            scores = torch.stack([spread_to_neighbours(self._question_mass[layer], self.cfg.pin_spread)
                                  for layer in asked])  # [layers asked, S]
            lengths = self.span_len.view()[: scores.shape[1]]
            common = torch.zeros(0, dtype=torch.long, device=self.device)
            if self.cfg.pin_vote > 0:
                common = pick_spans(voted_spans(scores, lengths, rows), lengths, int(self.cfg.pin_vote * rows))
            own_rows = rows - int(lengths[common].sum())
            scores[:, common] = float("-inf")  # each layer's own picks are other spans
            for i, layer in enumerate(asked):
                own = pick_spans(scores[i], lengths, own_rows)
                self._pin(layer, self.layers[layer], torch.cat([common, own[~torch.isin(own, common)]]))
        self._question_mass = [None] * self.config.n_layers
        self._drop_question_for_reread()
        self._note_peak()

    def _drop_question_for_reread(self) -> None:
        """reread=far on a document longer than the trained window: the question's rows leave the pending rows,
        and tokens_to_read_again hands its ids to the engine, which reads them once more with the pins in place
        (as a fed-back answer is read, in the pieces `max_chunk_tokens` gives meanwhile). Only when every question
        row is still pending."""
        ids, self._question_ids = self._question_ids, []
        if self._shift == 0 or not ids:  # inside the trained window the exact pass's rows are the right ones
            return
        n = len(ids)
        left = self.pend_pos.length - n
        for buf in (self.pend_pos, *(b for L in self.layers for b in (L.pend_k, L.pend_v))):
            buf.truncate(left)
        self.n_tokens -= n
        self._again = ids

    def tokens_to_read_again(self) -> list[int]:
        again, self._again = self._again, []
        if again:  # the chunks that bring them back attend as an answer step does
            self._replay, self._reread_left = True, len(again)
        return again

    def _pinned_fold_fits(self, n_spans: int, n_anchors: int, n_rows: int) -> bool:
        """Whether a fold during an answer (n_spans new spans, n_anchors anchors, n_rows rows that would stay
        pinned on every layer) fits beside a decode step's routed pool within the device budget, counting what
        each buffer's allocation grows by (they grow in whole steps)."""
        if all(p is None for p in self._pins):
            return False
        growth = sum(buf.growth_bytes(n) for L in self.layers
                     for buf, n in ((L.exact_k, n_anchors), (L.exact_v, n_anchors), (L.sum_k, n_spans),
                                    (L.sum_v, n_spans), (L.route_k, n_spans), (L.bound_k, n_spans if self._bounds else 0)))
        growth += self.exact_pos.growth_bytes(n_anchors) + self.span_pos.growth_bytes(n_spans) \
            + self.span_len.growth_bytes(n_spans)
        pins = self.config.n_layers * (n_rows * self.pin_row_bytes + n_spans)  # rows, positions and span masks
        need = self.device_bytes_now() + growth + pins + self.zoom_pool_bytes(self.step_slots)
        return need <= self.budget_bytes

    def _pin(self, layer: int, L: _Layer, take: torch.Tensor) -> None:
        """Keep the rows of spans `take` [n] on the device for the answer (the same spans for all KV heads of
        `layer`); their coarse summary rows leave attention while they are pinned."""
        if take.numel() == 0:
            self._pins[layer] = None
            return
        KV = self.config.n_kv_heads
        chosen = take[None, :].expand(KV, -1)
        zk, zv, zpos, zbias = self._rebuild(L, chosen, torch.ones_like(chosen, dtype=torch.bool))
        real = torch.isfinite(zbias[0])  # padding rows of short spans
        dt = CACHE_DTYPES[self.cfg.dtype]
        pos = self._pin_positions(zpos[0, real])
        mask = torch.zeros(self.span_len.length, dtype=torch.bool, device=self.device)
        mask[take] = True
        self._pins[layer] = PinnedRows(self._rotate(zk[:, real], pos).to(dt), zv[:, real].to(dt), pos, mask)

    def _pin_positions(self, own: torch.Tensor) -> torch.Tensor:
        """Where pinned rows (own positions [R]) are attended: their own positions, or with positions=bounded on a
        document longer than the trained window, side by side in document order just before the rows kept at
        their own positions (the pending rows: the recent window and the question). Rows older than the window
        would otherwise share one position. Not yet shown to matter: on one development document at 16K the
        question's pass pinned the needle's span in every layer and SmolLM2 gave the same wrong answer with
        either placement."""
        if self.cfg.positions != "bounded" or self.cfg.pin_place == "own" or self._shift == 0 or own.numel() == 0:
            return own
        start = int(self.pend_pos.view()[0]) if self.pend_pos.length else int(own.max()) + 1
        rank = torch.argsort(torch.argsort(own, stable=True), stable=True)
        return start - own.numel() + rank

    # -- after each chunk: surprisal, then compress what left the recent window -------------------
    def end_chunk(self, logits: torch.Tensor | None, token_ids: torch.Tensor) -> None:
        T = int(token_ids.shape[0])
        if self._question and self._question_ids is not None and self.cfg.reread == "far":
            self._question_ids.extend(token_ids.tolist())
        if self._reread_left:  # the rows were dropped, their surprisal was not
            self._reread_left -= T
            self._replay = self._reread_left > 0
        else:
            surprisal = torch.zeros(T)
            if logits is not None:
                surprisal = token_surprisal(logits, token_ids)
            self.pend_surprisal.append(surprisal.to(self.device))
        self.n_tokens += T
        # every layer has appended this chunk; at most one layer's rebuilt rows exist at a time
        self._note_peak(extra=self._zoom_bytes)
        self._zoom_bytes = 0
        # a question's chunk folds nothing: what it saw exact stays exact until its pins are chosen
        if self.pend_pos.length - self.recent >= self.l_max and not self._question:
            self._compress()
        self._note_peak()

    def _compress(self) -> None:
        region = self.pend_pos.length - self.recent
        if region <= 0:
            return
        pos = self.pend_pos.view()[:region]
        surprisal = self.pend_surprisal.view()[:region]
        forced = int((pos < self.cfg.n_sink).sum())
        self.stats.update(surprisal[forced:])
        threshold = self.stats.mean + self.cfg.alpha * self.stats.std
        self._adapt_span_length(region)
        seg = segment(surprisal, threshold, self.l_min, self.l_max, self._anchor_quota(region), forced_anchors=forced)
        if seg.consumed == 0:
            return
        t = torch.arange(self.l_max, device=self.device)
        idx = (seg.span_start[:, None] + t[None, :]).clamp(max=region - 1)  # [S, l_max]
        in_span = t[None, :] < seg.span_len[:, None]
        weights = torch.where(in_span, surprisal[idx].clamp_min(0) + 1e-3, 0.0)
        weights = weights / weights.sum(dim=1, keepdim=True)  # surprisal-weighted mean
        centers = pos[seg.span_start] + seg.span_len // 2
        unrotate = self.rope.cos_sin(-pos)
        window_rows: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # sekv+xkv: the window's spans
        n_anchors = int(seg.anchors.numel())
        keep_pinned = self._pinned_fold_fits(int(seg.span_len.numel()), n_anchors, seg.consumed - n_anchors)
        for layer_no, layer in enumerate(self.layers):
            if self._bounds:
                layer.bound_k.append(key_bounds(layer.pend_k.view()[:, idx].float(), in_span))  # own positions
            keys_pre = self.rope.apply(layer.pend_k.view()[:, :region].float(), -pos, unrotate)
            for x, summary, store, is_key in ((keys_pre, layer.sum_k, layer.fac_k, True),
                                              (layer.pend_v.view()[:, :region].float(), layer.sum_v, layer.fac_v, False)):
                padded = torch.where(in_span[None, :, :, None], x[:, idx], 0.0)  # [KV, S, l_max, D]
                mean = torch.einsum("ksld,sl->ksd", padded, weights)
                if self.cfg.share_layers == 1:
                    store.add(padded.transpose(0, 1), seg.span_len, self._energy(layer_no), self.cfg.max_rank,
                              self.rank_rule)
                else:
                    window_rows[0 if is_key else 1].append(padded)
                if is_key:
                    layer.route_k.append(self.router.routing_keys(layer_no, mean).detach())
                    mean = self._rotate(mean, centers)  # the summary row sits at the span's centre
                summary.append(mean)
            if window_rows[0] and (layer_no + 1 == len(self.layers) or self.layers[layer_no + 1].window_first):
                self._add_shared(layer, window_rows, seg.span_len)
                window_rows = ([], [])
            layer.exact_k.append(layer.pend_k.view()[:, seg.anchors])
            layer.exact_v.append(layer.pend_v.view()[:, seg.anchors])
            pins = self._pins[layer_no] if keep_pinned else None
            if pins is not None:  # rows the question saw exact stay exact for its answer: pinned, not folded
                rows = torch.ones(seg.consumed, dtype=torch.bool, device=self.device)
                rows[seg.anchors] = False
                self._pins[layer_no] = pins.extended(layer.pend_k.view()[:, :seg.consumed][:, rows],
                                                     layer.pend_v.view()[:, :seg.consumed][:, rows],
                                                     pos[:seg.consumed][rows], self.span_len.length,
                                                     int(seg.span_len.numel()))
            layer.pend_k.drop_front(seg.consumed)
            layer.pend_v.drop_front(seg.consumed)
        self.exact_pos.append(pos[seg.anchors])
        self.span_pos.append(pos[seg.span_start])
        self.span_len.append(seg.span_len)
        self.span_ids.append(_SpanIds.fresh(int(seg.span_len.numel())))
        self.pend_pos.drop_front(seg.consumed)
        self.pend_surprisal.drop_front(seg.consumed)

    def _add_shared(self, layer: _Layer, rows: tuple[list[torch.Tensor], list[torch.Tensor]],
                    lengths: torch.Tensor) -> None:
        """sekv+xkv: factor each span jointly over the window's layers and KV heads: [G][KV, S, l, D] ->
        one [S, 1, l, G*KV*D] SVD per span (one token basis for the window, as xKV does for whole layers)."""
        cap = self.cfg.max_rank * len(rows[0]) * self.config.n_kv_heads
        for parts, store in ((rows[0], layer.fac_k), (rows[1], layer.fac_v)):
            x = torch.stack(parts).permute(2, 3, 0, 1, 4)  # [S, l, G, KV, D]
            S, l_max = x.shape[:2]
            store.add(x.reshape(S, 1, l_max, -1), lengths, self._energy(None), cap, self.rank_rule)

    def host_bytes_needed(self, n_tokens: int) -> int:
        """Span factors are never larger than the raw f16 spans (full-KV bytes); their buffers grow in
        25% steps and copy when they grow: 1.5x full KV bounds the host tier."""
        return int(1.5 * self.config.full_kv_bytes(n_tokens))

    def room_tokens(self) -> int | None:
        """Tokens that can still be appended without the device tier outgrowing the budget, counted at
        the worst case of what compression makes of them: spans of the current minimum length (one
        summary each) plus the anchor quota."""
        held = self.span_len.length * self.span_bytes + self.exact_pos.length * self.token_bytes
        free = self.budget_bytes - self.fixed_bytes - held
        per_token = self.span_bytes / max(self.l_min, 1) + self.cfg.anchor_fraction * self.token_bytes
        return max(0, int(free / per_token))

    def _energy(self, layer: int | None) -> float | torch.Tensor:
        """SVD energy a span keeps: the trained rank gate's per KV head of `layer`, or the configured
        energy when the router is untrained, its rank gate is off, or the factors are shared by a window of
        layers (layer None): the gate learned ranks for one layer's factors, and a joint basis over G
        layers at those energies lost the short NIAH test's needle (tests/test_methods_real.py)."""
        if layer is None or not self.router.trained or not self.cfg.rank_gate:
            return self.cfg.energy
        return self.router.rank_energy(layer)

    def _remaining_tokens(self, region: int) -> int:
        done = self.n_tokens - self.pend_pos.length
        return max(self.planned_tokens - done, region)

    def _adapt_span_length(self, region: int) -> None:
        """Raise the minimum span length while the worst case of the remaining summaries (every new
        span l_min long) would not fit the budget next to what is already held."""
        held = self.span_len.length * self.span_bytes + self.exact_pos.length * self.token_bytes
        while self.l_min < self.l_max // 2:
            worst = math.ceil(self._remaining_tokens(region) / self.l_min) * self.span_bytes
            if self.fixed_bytes + held + worst <= self.budget_bytes:
                return
            self.l_min *= 2

    def _anchor_quota(self, region: int) -> int:
        """Anchors this region may keep: the exact bytes left after fixed costs and the projected span
        summaries, spread evenly over the tokens still to come."""
        remaining = self._remaining_tokens(region)
        mean_len = float(self.span_len.view().float().mean()) if self.span_len.length else (self.l_min + self.l_max) / 2
        projected_spans = self.span_len.length + remaining / max(mean_len, 1.0)
        free = self.budget_bytes - self.fixed_bytes - projected_spans * self.span_bytes \
            - self.exact_pos.length * self.token_bytes
        allowed = free / self.token_bytes * region / remaining
        return int(max(0.0, min(allowed, self.cfg.anchor_fraction * region)))

    def replay_chunk_tokens(self) -> int:
        """Tokens the next replayed chunk may hold: as many as decode steps would add before the pending rows
        fold (the device room beside the pins was planned for that), or a prefill chunk without pins."""
        if all(p is None for p in self._pins):
            return self.chunk_tokens
        return max(1, self.recent + self.l_max - self.pend_pos.length)

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Prefill chunks inside are an answer another engine decoded (the native one), fed back so this
        memory holds it too: they attend with the answer's pins and the decode step's routed slots, and
        are not a new question. Feed them in pieces of `replay_chunk_tokens`."""
        self._replay = True
        try:
            yield
        finally:
            self._replay = False

    def finish_prefill(self) -> None:
        """Fold whatever left the recent window so the device tier is back to steady state; with
        pool=free the pending buffers give back the prefill chunk's room for the zoom pool to use. After a
        question (select=question) the document's tail stays exact: its pins were chosen with it exact."""
        question = self._doc_read and self.cfg.select == "question"
        if self.pend_pos.length > self.recent and not question:
            self._compress()
        if question:
            self._pin_question()
        self._doc_read = True
        if self.free_pool:
            for buf in (self.pend_pos, self.pend_surprisal, *(b for L in self.layers for b in (L.pend_k, L.pend_v))):
                buf.shrink()

    # -- rollback ----------------------------------------------------------------------------------
    def _checkpoint(self) -> dict[str, Any]:
        return {
            "n_tokens": self.n_tokens, "stats": self.stats.copy(), "doc_read": self._doc_read,
            "score_vocab": self._score_vocab,
            "exact": self.exact_pos.length, "spans": self.span_len.length,
            "pend_pos": self.pend_pos.view().clone(), "pend_s": self.pend_surprisal.view().clone(),
            "pend": [(l.pend_k.view().clone(), l.pend_v.view().clone()) for l in self.layers],
        }

    def _restore(self, mark: dict[str, Any]) -> None:
        self.n_tokens, self.stats = mark["n_tokens"], mark["stats"].copy()
        self._doc_read = mark["doc_read"]
        self._score_vocab = mark["score_vocab"]
        self._pins = [None] * self.config.n_layers
        self._question_mass = [None] * self.config.n_layers
        self._question_ids, self._again, self._reread_left = [], [], 0
        for buf in (self.exact_pos,):
            buf.truncate(mark["exact"])
        for buf in (self.span_pos, self.span_len, self.span_ids):
            buf.truncate(mark["spans"])
        self.pend_pos.truncate(0)
        self.pend_pos.append(mark["pend_pos"])
        self.pend_surprisal.truncate(0)
        self.pend_surprisal.append(mark["pend_s"])
        for layer, (pk, pv) in zip(self.layers, mark["pend"]):
            layer.exact_k.truncate(mark["exact"])
            layer.exact_v.truncate(mark["exact"])
            for buf in (layer.sum_k, layer.sum_v, layer.route_k, layer.bound_k):
                buf.truncate(mark["spans"])
            layer.fac_k.truncate(mark["spans"])
            layer.fac_v.truncate(mark["spans"])
            layer.pend_k.truncate(0)
            layer.pend_k.append(pk)
            layer.pend_v.truncate(0)
            layer.pend_v.append(pv)

    # -- persistence -------------------------------------------------------------------------------
    _GLOBAL = ("exact_pos", "pend_pos", "pend_surprisal", "span_pos", "span_len")
    _LAYER = ("exact_k", "exact_v", "pend_k", "pend_v", "sum_k", "sum_v", "route_k", "bound_k")

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {name: getattr(self, name).view() for name in self._GLOBAL}
        for i, layer in enumerate(self.layers):
            tensors.update({f"L{i}.{name}": getattr(layer, name).view() for name in self._LAYER})
            if layer.window_first:
                tensors.update(layer.fac_k.export_state(f"L{i}.fac_k"))
                tensors.update(layer.fac_v.export_state(f"L{i}.fac_v"))
        tensors.update({f"router.{k}": v.detach() for k, v in self.router.state_dict().items()})
        if self._score_vocab is not None:
            tensors["score_vocab"] = self._score_vocab
        meta = {"n_tokens": self.n_tokens, "planned_tokens": self.planned_tokens, "l_min": self.l_min,
                "stats": [self.stats.count, self.stats.mean, self.stats.m2], "router_trained": self.router.trained,
                "router_auto": dict(self.router.auto_choices)}
        return tensors, meta

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self._restore_router(tensors, meta)
        self.reserve(int(meta["planned_tokens"]))
        self.l_min = int(meta["l_min"])
        for name in self._GLOBAL:
            getattr(self, name).load(tensors[name].to(self.device))
        self.span_ids.load(_SpanIds.fresh(self.span_len.length))
        for i, layer in enumerate(self.layers):
            for name in self._LAYER:
                getattr(layer, name).load(tensors[f"L{i}.{name}"].to(self.device))
            if layer.window_first:
                layer.fac_k.import_state(tensors, f"L{i}.fac_k")
                layer.fac_v.import_state(tensors, f"L{i}.fac_v")
            if not (layer.exact_k.length == layer.exact_v.length == self.exact_pos.length
                    and layer.pend_k.length == layer.pend_v.length == self.pend_pos.length
                    and layer.sum_k.length == layer.route_k.length == self.span_len.length == layer.fac_k.n_spans
                    and layer.bound_k.length == (self.span_len.length if self._bounds else 0)):
                raise ValueError(f"layer {i}: row counts disagree with the saved positions")
        count, mean, m2 = meta["stats"]
        self.stats = RunningStats(int(count), float(mean), float(m2))
        self.n_tokens = int(meta["n_tokens"])
        if "score_vocab" in tensors:  # the shortlist its spans were cut with; a memory saved without one: ours
            self._score_vocab = tensors["score_vocab"].to("cpu", torch.long)
        self._doc_read = True  # a saved memory holds a read document

    def _restore_router(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """A memory was built with its own router (its routing keys and ranks come from it): restore
        that one into a fresh module, never into the engine's shared trained router."""
        saved = {k[len("router."):]: v for k, v in tensors.items() if k.startswith("router.")}
        router = Router(self.config, SekvConfig(routing_dim=int(saved["q_proj"].shape[-1])))
        router.load_state_dict(saved)
        router.trained = bool(meta.get("router_trained", False))
        for option, value in meta.get("router_auto", {}).items():  # what its file named for "auto" options
            if option not in FILE_CHOICES or value not in FILE_CHOICES[option][1]:
                raise ValueError(f"saved router: {option}={value!r} is not a known choice")
            router.auto_choices[option] = value
        router.requires_grad_(False)
        if router.routing_dim != self.router.routing_dim:  # routing-key rows as wide as the saved router's
            for layer in self.layers:
                layer.route_k = RowBuffer(self.config.n_kv_heads, router.routing_dim, layer.route_k.data.dtype,
                                          self.device, _ROW_STEP)
        self.router = router
        self._settle_auto_options()

    # -- accounting & observability ----------------------------------------------------------------
    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        L = self.layers[layer]
        tensors = [L.exact_k.data, L.exact_v.data, L.pend_k.data, L.pend_v.data, L.sum_k.data, L.sum_v.data,
                   L.route_k.data, L.bound_k.data]
        pins = self._pins[layer]
        if pins is not None:
            tensors += [pins.k, pins.v, pins.pos, pins.mask]
        if layer == 0:
            tensors += [self.exact_pos.data, self.pend_pos.data, self.pend_surprisal.data, self.span_pos.data,
                        self.span_len.data, *self._router_tensors()]
            if self._score_vocab is not None:
                tensors.append(self._score_vocab)
        return tensors

    def host_tensors(self, layer: int) -> list[torch.Tensor]:
        L = self.layers[layer]
        tensors = L.fac_k.tensors() + L.fac_v.tensors() if L.window_first else []  # a shared store counts once
        return tensors + [self.span_ids.data] if layer == 0 else tensors

    def reset_observations(self) -> None:
        super().reset_observations()
        self._zoom_events.clear()

    def observations(self) -> dict[str, Any]:
        """Zoomed spans since the last reset: per span, how many (layer, KV head, step) picked it."""
        n_spans = self.span_len.length
        pinned = [(l, p.mask_for(n_spans).nonzero().flatten()) for l, p in enumerate(self._pins) if p is not None]
        out: dict[str, Any] = {"spans": n_spans, "exact_tokens": self.exact_pos.length,
                               "pending_tokens": self.pend_pos.length, "zoomed": [],
                               "pinned": len(set().union(*(set(s.tolist()) for _, s in pinned))),
                               "host_reads_per_step_bytes": round(self.host_reads.per_step),
                               "host_reads_question_bytes": self.host_reads.question_bytes}
        # a pinned span counts as zoomed by each of its layer's KV heads at every decode step
        steps = max(self.host_reads.steps, 1)
        events = list(self._zoom_events) + [(l, s[None, :].expand(self.config.n_kv_heads * steps, -1))
                                            for l, s in pinned]
        if not events or not n_spans:
            return out
        layers = torch.cat([torch.full((ev.numel(),), l) for l, ev in events])
        spans = torch.cat([ev.reshape(-1) for _, ev in events])
        ok = (spans >= 0) & (spans < n_spans)
        counts = torch.bincount(spans[ok], minlength=n_spans)
        per_layer = torch.zeros(self.config.n_layers, n_spans, dtype=torch.long)
        per_layer.index_put_((layers[ok], spans[ok]), torch.ones_like(spans[ok]), accumulate=True)
        hit = torch.nonzero(counts).flatten()
        starts, lengths = self.span_pos.view()[hit].tolist(), self.span_len.view()[hit].tolist()
        for s, start, length, count in zip(hit.tolist(), starts, lengths, counts[hit].tolist()):
            layers_hit = torch.nonzero(per_layer[:, s]).flatten().tolist()
            out["zoomed"].append({"span": s, "start": start, "length": length, "hits": count,
                                  "layers": layers_hit})
        return out


@register_policy("sekv")
def _make(**kwargs: Any) -> SekvCache:
    """SeKV: semantic spans with summaries on the device, SVD factors in host RAM, budget-sized zoom-in."""
    return SekvCache(**kwargs)


@register_policy("sekv+xkv")
def _make_shared(**kwargs: Any) -> SekvCache:
    """SeKV whose span factors are shared across windows of `share_layers` layers (default 2)."""
    kwargs.setdefault("share_layers", 2)
    cache = SekvCache(**kwargs)
    cache.name = "sekv+xkv"
    return cache
