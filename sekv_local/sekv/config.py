"""All SeKV settings in one validated dataclass (defaults: docs/DESIGN.md §8)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..dtypes import check_cache_dtype
from ..errors import config_check, reject_unknown

POSITION_STRATEGIES = ("original", "bounded")
PIN_PLACES = ("near", "own")
#: when a question is read a second time, with its answer's pins in place (see SekvConfig.reread)
REREADS = ("off", "far")
RANK_RULES = ("auto", "span", "row", "exact")
#: what `rank_rule=auto` runs once a trained router is loaded: its file names one ("span" when it does not)
AUTO_RANK_RULES = ("span", "row", "exact")
ROUTERS = ("auto", "projection", "attention", "bounds", "union")
#: what `router=auto` runs once a trained router is loaded: its file names one ("projection" when it does not)
AUTO_ROUTERS = ("projection", "union")
POOLS = ("auto", "fixed", "free")
#: surprisal_vocab=auto: a shortlist of this many leading rows (plus the text's own tokens) for vocabularies
#: larger than SHORTLIST_ABOVE rows
SHORTLIST_ROWS = 16384
SHORTLIST_ABOVE = 65536
SELECTIONS = ("question", "step")
PREFILL_READS = ("pool", "read_budget")
HOST_QUANTS = ("none", "q8_0", "q4_0")
PIN_SCORES = ("max", "last", "mean", "lift")  # sekv/question.py: question_span_score
#: what `pool=auto` runs once a trained router is loaded: its file names one ("fixed" when it does not)
AUTO_POOLS = ("fixed", "free")
#: the options whose "auto" a trained router's file settles: option -> (the file's info key, choices; the
#: first is what a file that names none gets)
FILE_CHOICES = {"router": ("auto_router", AUTO_ROUTERS), "rank_rule": ("rank_rule", AUTO_RANK_RULES),
                "pool": ("zoom_pool", AUTO_POOLS)}


@dataclass(frozen=True)
class SekvConfig:
    """SeKV hyperparameters.

    alpha: boundary where surprisal > mean + alpha * std (running statistics).
    l_min, l_max: span length limits in tokens (candidates closer than l_min are not cut).
    n_sink: attention-sink tokens at the start, always exact.
    recent: most recent tokens kept exact (document tail, question, generated tokens).
    anchor_fraction: at most this fraction of compressed tokens stays exact as anchors (high-surprisal
        boundary tokens); the budget may lower it further.
    zoom_k: spans rebuilt per layer and KV head per step (hard top-k: the zoom pool's size); "auto" sizes the
        pool to fill the device budget left after summaries and exact rows (capped by the number of spans).
    pool: with zoom_k "auto", "fixed" zooms the planned pool at every step; "free" also lets a step's pool take
        the device room that step leaves unused, measured from the tensors held at its start: after the
        document is read, the room reserved for a prefill chunk (the pending buffers give it back) holds more
        rebuilt spans while the question is read and the answer decoded; never past the budget (see RESULTS
        "Gemma 3"); "auto": what the trained router's file names ("fixed" when it names nothing or there is none).
    energy: SVD rank per span = smallest rank keeping this fraction of the squared singular values.
    max_rank: rank cap per span.
    rank_rule: "span" keeps `energy` of the span's squared singular values (the authors' rule); "row" keeps
        `energy` of every token row's own squared norm, so a few distinctive tokens (a needle's digits) are
        not averaged away: higher ranks where a span holds them, host bytes only; "exact" keeps every span
        raw in host RAM (no SVD; energy, max_rank and the rank gate unused): lossless zoom-ins for the host
        bytes of full KV, rebuilt at `dtype` (the values as stored; factored spans are rebuilt in float32), so
        the same device bytes hold twice the zoom pool (see RESULTS "Gemma 3"); "auto": what the trained
        router's file names ("span" when it names nothing or there is none).
    select: what a decode step reads back. "question": when a question (any prefill after the document)
        arrives, its tokens attend exactly over every span's rows (one pass over the host tier), and the spans
        holding most of its attention mass, per layer, are pinned on the device for the answer (as many rows
        as the device budget leaves free); each decode step adds `read_budget`'s worth of routed spans beside
        them (the default: chosen on development seeds, measured in RESULTS "Selective zoom"). "step": every
        decode step routes and rebuilds its whole zoom pool (the earlier default: accurate, but each step reads
        most of the document back).
    pin_score: how select=question ranks spans by the question's attention: the most any head gives a span from
        any question token ("max"), from the question's last token ("last"), averaged over its tokens ("mean"), or
        the most any head gives it from any token over what that head gives it from the question's median token
        ("lift", the default: discounts the mass position alone draws, next to the sinks and the recent window).
    pin_vote: with select=question, the share of each layer's pin room that holds the spans most layers would pin
        on their own (the same spans in every layer); the rest of the room each layer fills by its own score.
        1.0 by default: a needle's span tops only the layers whose heads match the question's words.
    pin_spread: with select=question, each span's neighbours in the document get this fraction of its score
        before the pins are picked (0 = off), so a fact that a span boundary cut in two (a needle's key in one
        span, its value's digits in the next) is pinned whole. Off by default: on development seeds it rescued
        such a needle at 7K but, where the pin room holds only a few spans (2K), the neighbours it pins can
        push out the needle's own span (RESULTS "Selective zoom").
    read_budget: host bytes a decode step may gather (routed spans' stored rows or factors): a fraction of the
        full-KV bytes (float <= 1) or bytes (int); "auto": 0.05 with select=question, unbounded with
        select=step. Caps the routed pool of a decode step; prefill chunks keep the device-sized pool unless
        prefill_reads says otherwise.
    prefill_reads: what a prefill chunk of the document reads back: "pool", the device-sized zoom pool (at 25% a
        chunk zooms into most spans, so reading a document costs what full attention costs, growing with its
        square); "read_budget", the spans a decode step may read (the read budget), so that each chunk reads a
        bounded share and a long document reads in time linear in its length.
    answer_room: with select=question, the tokens an answer may add on the device before its rows fold into
        spans: the room kept free beside the pins. "auto": l_max + 16 (the torch engine folds every l_max
        decoded tokens); the llama.cpp engine sets its decode room, since it folds only when that fills. Never
        more than a prefill chunk: an answer decoded outside this memory folds back one chunk at a time.
    routing_dim: d', the routing space; the untrained projection keeps the d' lowest-frequency RoPE dims.
    threshold: initial per-head zoom threshold on sigmoid relevance.
    router: "auto" ("projection" when trained router parameters are loaded, else "attention"),
        "projection" (docs/DESIGN.md §5.4 formula through the Router module) or "attention" (zoom where the
        coarse summary rows get the most attention logit; training-free) or "bounds" (Quest-style: per span
        the element-wise min and max of its keys give an upper bound of q.k over its tokens; 2*head_dim more
        device values per span and KV head, training-free) or "union" (half the zoom pool by the attention
        rule, the other half by the learned router: the two choose different spans, see RESULTS "Gemma 3").
    share_layers: G > 1 factors each span jointly over G adjacent layers and all KV heads (one token basis
        per span for the window, xKV's cross-layer sharing applied to span factors: `sekv+xkv`).
    summary_bias: multiplier of the +log|S| bias of unexpanded spans' summary rows (1 = docs/DESIGN.md §5.5;
        0 = drop unexpanded spans from attention, an ablation).
    positions: "original" keeps every token's own position; "bounded" places all memory (spans,
        anchors) at positions inside the trained window (InfLLM-style), for documents longer than it.
    pin_place: with positions=bounded on a document longer than the trained window, where a question's pinned
        spans are attended: "near", side by side in document order just before the recent window (one distinct
        position per row, inside the window); "own", at their own positions, which puts every row older than the window at one
        far position (the ablation; the two have not yet been told apart on a document).
    reread: "far": with positions=bounded on a document longer than the trained window, once a question's pass
        has chosen the pins, the question is read again as an answer step would see it (pins near, routed
        slots), so its rows and the first answer token come from that placement rather than from the exact
        pass, which attended every span with every row older than the window at one far position; "off"
        keeps the exact pass's rows (a question's rows, the only ones re-read, are few).
    dtype: storage type of exact K/V, summaries and host factors.
    host_quant: "none" keeps the host tier (span rows and factors) at `dtype`; "q8_0" or "q4_0" keeps it in
        llama.cpp's blocks of 32 values (34 or 18 bytes per 32 values instead of 64 at f16), dequantized as a
        zoom reads it: less host RAM, the same device tier (RESULTS "A block-quantized host tier").
    trained: use the model's trained router (baked into its GGUF, or packaged for a built-in model) when
        it has one; False runs the untrained defaults (an ablation).
    fill: with the learned router, fill the zoom pool with the best-ranked spans even where they fall below
        the trained thresholds (the pool's memory is reserved either way; the thresholds then save no
        memory, only work). False: a span is zoomed only if it passes its head's threshold (fewer spans
        rebuilt; it lost accuracy at 25% in RESULTS, so filling is the default).
    rank_gate: with the learned router, each span keeps the SVD energy its layer's trained rank gate chose
        (less host memory); False keeps `energy` and uses only the trained routing (an ablation).
    surprisal_vocab: the vocabulary rows a token's surprisal normalises over. "all": the whole vocabulary; an
        integer K: the first K rows plus every token id the memory has seen (document, questions, answers), so
        every target is in it and the model's mass on the text's own words is counted; "auto": 16384 where the
        vocabulary has more than 65,536 rows (Gemma 3's 262K rows made the exact normaliser most of a prefill's
        work), "all" otherwise. Only the cuts between spans depend on it (RESULTS "Stock llama.cpp with flash
        attention; ...; surprisal over a shortlist").
    """

    alpha: float = 1.0
    l_min: int = 8
    l_max: int = 64
    n_sink: int = 4
    recent: int = 128
    anchor_fraction: float = 0.05
    zoom_k: int | str = "auto"
    energy: float = 0.999
    max_rank: int = 32
    rank_rule: str = "auto"
    select: str = "question"
    pin_score: str = "lift"
    pin_spread: float = 0.0
    pin_vote: float = 1.0
    read_budget: float | int | str = "auto"
    prefill_reads: str = "pool"
    answer_room: int | str = "auto"
    routing_dim: int = 32
    threshold: float = 0.05
    router: str = "auto"
    pool: str = "auto"
    share_layers: int = 1
    summary_bias: float = 1.0
    positions: str = "original"
    pin_place: str = "near"
    reread: str = "off"
    dtype: str = "f16"
    host_quant: str = "none"
    trained: bool = True
    fill: bool = True
    rank_gate: bool = True
    surprisal_vocab: int | str = "auto"

    def __post_init__(self) -> None:
        need = config_check("sekv")

        need(self.alpha >= 0, "alpha must be >= 0")
        need(1 <= self.l_min <= self.l_max, "need 1 <= l_min <= l_max")
        need(self.l_max >= 2 * self.l_min, "l_max must be >= 2 * l_min (so long spans split into valid spans)")
        need(self.n_sink >= 0 and self.recent >= 1, "n_sink >= 0 and recent >= 1")
        need(0 <= self.anchor_fraction <= 1, "anchor_fraction must be in [0, 1]")
        need(self.zoom_k == "auto" or (isinstance(self.zoom_k, int) and self.zoom_k >= 0),
             "zoom_k must be 'auto' or an integer >= 0")
        need(0 < self.energy <= 1, "energy must be in (0, 1]")
        need(self.max_rank >= 1, "max_rank must be >= 1")
        need(self.rank_rule in RANK_RULES, f"rank_rule must be one of {RANK_RULES}")
        need(self.select in SELECTIONS, f"select must be one of {SELECTIONS}")
        need(self.pin_score in PIN_SCORES, f"pin_score must be one of {PIN_SCORES}")
        need(isinstance(self.pin_spread, (int, float)) and not isinstance(self.pin_spread, bool)
             and 0 <= self.pin_spread <= 1, "pin_spread must be a number in [0, 1]")
        need(isinstance(self.pin_vote, (int, float)) and not isinstance(self.pin_vote, bool)
             and 0 <= self.pin_vote <= 1, "pin_vote must be a number in [0, 1]")
        need(self.read_budget == "auto" or (isinstance(self.read_budget, float) and 0 < self.read_budget <= 1)
             or (isinstance(self.read_budget, int) and not isinstance(self.read_budget, bool) and self.read_budget > 0),
             "read_budget must be 'auto', a fraction in (0, 1] or a positive number of bytes")
        need(self.prefill_reads in PREFILL_READS, f"prefill_reads must be one of {PREFILL_READS}")
        need(self.answer_room == "auto" or (isinstance(self.answer_room, int) and not isinstance(self.answer_room, bool)
                                            and self.answer_room > 0), "answer_room must be 'auto' or a positive integer")
        need(self.routing_dim >= 2 and self.routing_dim % 2 == 0, "routing_dim must be an even number >= 2")
        need(0 < self.threshold < 1, "threshold must be in (0, 1)")
        need(self.share_layers >= 1, "share_layers must be >= 1")
        need(self.summary_bias >= 0, "summary_bias must be >= 0")
        need(self.router in ROUTERS, f"router must be one of {ROUTERS}")
        need(self.pool in POOLS, f"pool must be one of {POOLS}")
        need(self.positions in POSITION_STRATEGIES, f"positions must be one of {POSITION_STRATEGIES}")
        need(self.pin_place in PIN_PLACES, f"pin_place must be one of {PIN_PLACES}")
        need(self.reread in REREADS, f"reread must be one of {REREADS}")
        check_cache_dtype("sekv", self.dtype)
        need(self.host_quant in HOST_QUANTS, f"host_quant must be one of {HOST_QUANTS}")
        need(isinstance(self.trained, bool), "trained must be true or false")
        need(isinstance(self.fill, bool), "fill must be true or false")
        need(isinstance(self.rank_gate, bool), "rank_gate must be true or false")
        need(self.surprisal_vocab in ("auto", "all") or (isinstance(self.surprisal_vocab, int)
                                                         and not isinstance(self.surprisal_vocab, bool)
                                                         and self.surprisal_vocab >= 0),
             "surprisal_vocab must be 'auto', 'all' or an integer >= 0")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "SekvConfig":
        reject_unknown("sekv", options, {f.name for f in fields(cls)})
        return cls(**options)
