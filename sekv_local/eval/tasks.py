"""Seeded, fully local RULER-style task generators (no downloads).

Every sample is a pure function of ``(task, target_tokens, seed, depth)`` and the injected token
counter: all randomness comes from ``random.Random(seed)`` (never the global generator), and the
haystack text is fixed. Haystacks:

* ``pydoc``: natural English prose cleaned from CPython's ``pydoc_data.topics`` (code blocks,
  grammar rules, headings and doctest sessions removed; topics in sorted order; ~45k words, about
  65K tokens). The text ships with the interpreter, so documents are identical for a given Python
  version (``Sample.meta["python"]`` records it).
* ``book``: for documents over 32K tokens, the pydoc prose followed by the standard library's own
  docstrings cleaned the same way (``book.py``; over 200K tokens, so a 128K-token document never
  repeats a paragraph).
* ``noise``: RULER's noise ("The grass is green. The sky is blue. ...") repeated.
* ``words``: a numbered word list (common-words extraction).

Lengths are fitted with the model's tokenizer, passed in as ``count_tokens``, so that
``FIT_LOW * target_tokens <= count_tokens(document) <= target_tokens``. The fit measures a few
prefixes and interpolates (secant, then bisection) on the number of haystack units (words,
noise sentences or list entries); it never calls ``count_tokens`` once per sentence.

Needle depth is the fraction of the *haystack* characters that precede the needle (0 = start,
1 = end); needles always go in at a sentence boundary, the one nearest the requested depth. The
requested depth is ``Question.meta["depth"]``; the depth reached is ``meta["achieved_depth"]``.

The document holds only the context; the question (with its answer-format instruction) is in
``Question.text``, so several questions can be asked against one cached document.
"""

from __future__ import annotations

import bisect
import math
import platform
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate, compress
from typing import Any, TypeVar

TokenCounter = Callable[[str], int]

TASKS: tuple[str, ...] = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
    "doc_qa",
    "multiturn_niah",
)
#: Tasks whose documents take a ``depth`` (the others ignore it).
DEPTH_TASKS: frozenset[str] = frozenset(
    {"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "doc_qa", "multiturn_niah"}
)
#: A fitted document has between ``FIT_LOW * target_tokens`` and ``target_tokens`` tokens.
FIT_LOW = 0.95
#: :func:`generate_suite` gives sample ``i`` the seed ``base_seed * SUITE_SEED_STRIDE + i``.
SUITE_SEED_STRIDE = 100003

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

ADJECTIVES: tuple[str, ...] = (
    "brave", "calm", "eager", "fancy", "gentle", "happy", "jolly", "kind", "lively", "proud",
    "silly", "witty", "zealous", "ancient", "bitter", "bold", "bright", "busy", "clever", "cold",
    "crisp", "curious", "daring", "dusty", "fierce", "fluffy", "frosty", "giant", "golden", "grumpy",
    "hidden", "hollow", "humble", "icy", "loud", "lucky", "mighty", "misty", "noble", "quiet",
    "rapid", "rough", "royal", "rusty", "shiny", "silent", "sleepy", "smooth", "snowy", "sour",
    "steady", "stormy", "sunny", "swift", "tall", "tender", "tiny", "vivid", "wild", "wise",
)
NOUNS: tuple[str, ...] = (
    "lion", "tiger", "falcon", "otter", "badger", "beaver", "bison", "camel", "cobra", "crane",
    "dolphin", "eagle", "ferret", "gecko", "heron", "hyena", "jaguar", "koala", "lemur", "llama",
    "lynx", "moose", "newt", "owl", "panda", "parrot", "pelican", "puffin", "rabbit", "raven",
    "salmon", "seal", "shark", "sparrow", "spider", "swan", "toad", "turtle", "walrus", "wolf",
    "anchor", "basket", "candle", "castle", "comet", "garden", "harbor", "island", "lantern", "meadow",
    "mirror", "mountain", "orchard", "pebble", "river", "saddle", "temple", "thunder", "valley", "violin",
)

NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."

# (fact, question) templates for doc_qa; {e} is the entity, {a} the answer.
QA_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("The capital of the fictional country of {e} is {a}.",
     "What is the capital of the fictional country of {e}?"),
    ("Dr. {e} was born in the town of {a}.", "In which town was Dr. {e} born?"),
    ("The river {e} flows into the Lake of {a}.", "Into which lake does the river {e} flow?"),
    ("The ship {e} was built in the harbour of {a}.", "In which harbour was the ship {e} built?"),
    ("The guild of {e} keeps its treasure in the fortress of {a}.",
     "In which fortress does the guild of {e} keep its treasure?"),
)


@dataclass
class Question:
    """One question about a sample's document.

    ``match`` is ``"all"`` (every reference must appear; see :func:`.scoring.string_match_all`) or
    ``"part"`` (any reference). ``meta`` holds e.g. ``depth`` (requested needle depth, needle tasks
    only), ``achieved_depth``, ``key`` and, for multi-turn NIAH, ``turn``."""

    text: str
    answers: list[str]
    match: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """A generated document with its questions.

    ``meta`` holds ``n_tokens`` (``count_tokens(document)``), ``depth`` (requested, or ``None``),
    ``haystack``, ``offset``/``units`` (where the haystack starts and how many units it has),
    ``needles`` (each inserted text with requested and achieved depth) and ``python``."""

    task: str
    seed: int
    target_tokens: int
    document: str
    questions: list[Question]
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# haystack corpora

@dataclass(frozen=True)
class _Corpus:
    """A haystack as a cyclic sequence of pieces (words or sentences) that each end with their
    separator; ``ends[i]`` says piece ``i`` closes a sentence; ``starts`` are allowed offsets."""

    name: str
    pieces: tuple[str, ...]
    ends: tuple[bool, ...]
    starts: tuple[int, ...]


#: documents longer than this (in tokens) take their haystack from the book; the pydoc prose is ~65K tokens
BOOK_FROM_TOKENS = 32768
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(])")
_UNDERLINE = re.compile(r"[*=\-^~]+")
_MAX_SENTENCE_CHARS = 400


def clean_pydoc_topics(topics: dict[str, str]) -> list[list[str]]:
    """Plain prose paragraphs (each a list of sentences) from ``pydoc_data.topics``, in sorted
    topic order (:func:`clean_prose` on each blank-line-separated block)."""
    return [p for key in sorted(topics) for block in re.split(r"\n[ \t]*\n", topics[key])
            if (p := clean_prose(block)) is not None]


def clean_prose(block: str) -> list[str] | None:
    """The sentences of one paragraph of reStructuredText-like documentation, or None when it is not
    plain prose. Headings, indented code, grammar rules (``::=``), doctest sessions, lists of names and
    paragraphs that do not end in a full stop are dropped, as are sentences over 400 characters (so
    needles can sit near any depth); ``*emphasis*`` markers are removed and words hyphenated across line
    ends are re-joined."""
    lines = [line for line in block.split("\n") if line.strip()]
    if not lines or ">>>" in block or "::=" in block:
        return None
    if len(lines) > 1 and _UNDERLINE.fullmatch(lines[-1].strip()):
        return None  # heading
    text = re.sub(r"\s+", " ", " ".join(line.strip() for line in lines)).strip()
    text = re.sub(r"^(?:\*|\d+\.)\s+", "", text).replace("*", "")
    text = re.sub(r"(?<=\w)- (?=\w)", "-", text)  # re-join words hyphenated at line ends
    if not text.endswith(".") or len(text.split()) < 6:
        return None
    if sum(c.isalpha() or c == " " for c in text) < 0.85 * len(text):
        return None  # code-like
    sentences = [s for s in _SENTENCE_SPLIT.split(text) if len(s) <= _MAX_SENTENCE_CHARS]
    return sentences or None


@lru_cache(maxsize=1)
def _pydoc_paragraphs() -> tuple[tuple[str, ...], ...]:
    from pydoc_data.topics import topics

    return tuple(tuple(p) for p in clean_pydoc_topics(topics))


@lru_cache(maxsize=1)
def natural_text(max_chars: int = 200_000) -> str:
    """Plain English prose (CPython's own documentation, cleaned), paragraphs separated by blank lines."""
    return "\n\n".join(" ".join(p) for p in _pydoc_paragraphs())[:max_chars]


@lru_cache(maxsize=1)
def _pydoc_corpus() -> _Corpus:
    """The pydoc prose as words; paragraphs end with a blank line; offsets at paragraph starts."""
    return _word_corpus("pydoc", _pydoc_paragraphs())


@lru_cache(maxsize=1)
def _book_corpus() -> _Corpus:
    """The book (sekv_local/eval/book.py: the pydoc prose, then the standard library's docstrings) as words."""
    from .book import book_paragraphs

    return _word_corpus("book", book_paragraphs())


def _haystack(target_tokens: int) -> _Corpus:
    """pydoc prose up to BOOK_FROM_TOKENS (every document the project measured before the book existed),
    the book beyond: pydoc alone would repeat itself within one document."""
    return _pydoc_corpus() if target_tokens <= BOOK_FROM_TOKENS else _book_corpus()


def _word_corpus(name: str, paragraphs: Sequence[Sequence[str]]) -> _Corpus:
    """Paragraphs of sentences as words; paragraphs end with a blank line; offsets at paragraph starts."""
    pieces: list[str] = []
    ends: list[bool] = []
    starts: list[int] = []
    for paragraph in paragraphs:
        starts.append(len(pieces))
        for s_idx, sentence in enumerate(paragraph):
            words = sentence.split(" ")
            last_sep = "\n\n" if s_idx == len(paragraph) - 1 else " "
            pieces.extend(w + " " for w in words[:-1])
            pieces.append(words[-1] + last_sep)
            ends.extend([False] * (len(words) - 1) + [True])
    return _Corpus(name, tuple(pieces), tuple(ends), tuple(starts))


@lru_cache(maxsize=1)
def _noise_corpus() -> _Corpus:
    """RULER noise as sentences (every piece ends a sentence); always starts at "The grass"."""
    sentences = [s + " " for s in _SENTENCE_SPLIT.split(NOISE)]
    return _Corpus("noise", tuple(sentences), (True,) * len(sentences), (0,))


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """Lower-case words (4-10 letters) of the pydoc prose, sorted: the common-words vocabulary."""
    words = {w for p in _pydoc_paragraphs() for s in p for w in re.findall(r"\b[a-z]{4,10}\b", s)}
    return tuple(sorted(words))


_T = TypeVar("_T")


def _cyclic(seq: Sequence[_T], start: int, n: int) -> list[_T]:
    """``n`` items of ``seq`` from ``start``, wrapping around."""
    out: list[_T] = []
    start %= len(seq)
    while n > 0:
        take = min(n, len(seq) - start)
        out += seq[start:start + take]
        n -= take
        start = 0
    return out


def _assemble(corpus: _Corpus, start: int, n: int,
              inserts: Sequence[tuple[float, str]]) -> tuple[str, list[float]]:
    """``n`` haystack pieces from ``start`` with each ``(depth, text)`` of ``inserts`` placed at
    the sentence boundary nearest ``depth`` (a fraction of the haystack characters). A truncated
    last sentence is closed with a full stop. Inserts that land on the same boundary keep their
    order. Returns the document and the achieved depth of each insert."""
    seg = _cyclic(corpus.pieces, start, n)
    flags = _cyclic(corpus.ends, start, n)
    if seg:
        last = seg[-1].rstrip()
        seg[-1] = (last if last[-1] in ".!?" else last.rstrip(",;:") + ".") + " "
    bounds = [0, *compress(range(1, n), flags[:-1])] + ([n] if n else [])
    cum = [0, *accumulate(map(len, seg))]
    total = cum[-1]
    bpos = [cum[b] for b in bounds]
    placed: list[int] = []
    achieved: list[float] = []
    for depth, _ in inserts:
        want = depth * total
        j = bisect.bisect_left(bpos, want)
        k = min((i for i in (j - 1, j) if 0 <= i < len(bpos)), key=lambda i: abs(bpos[i] - want))
        placed.append(bounds[k])
        achieved.append(bpos[k] / total if total else 0.0)
    parts: list[str] = []
    prev = 0
    for i in sorted(range(len(inserts)), key=placed.__getitem__):
        parts.append("".join(seg[prev:placed[i]]))
        parts.append(inserts[i][1] + " ")
        prev = placed[i]
    parts.append("".join(seg[prev:]))
    return "".join(parts).rstrip(), achieved


# --------------------------------------------------------------------------------------------
# length fitting

def _fit(build: Callable[[int], tuple[str, _T]], target_tokens: int, count_tokens: TokenCounter,
         units_per_token: float) -> tuple[str, _T, int, int]:
    """Find a unit count ``n`` with ``FIT_LOW * target <= count_tokens(build(n)[0]) <= target``.

    ``build(n)`` must grow (roughly monotonically) with ``n``. Starts from ``units_per_token``,
    then interpolates between the best bracketing counts (secant steps), falling back to
    bisection; typically 2-4 calls of ``count_tokens``. Returns ``(doc, info, n, n_tokens)``."""
    lo_ok = math.ceil(FIT_LOW * target_tokens)
    aim = (lo_ok + target_tokens) / 2
    doc, info = build(0)
    t0 = count_tokens(doc)
    if t0 > target_tokens:
        raise ValueError(f"target_tokens={target_tokens} is too small: the fixed content alone "
                         f"(needles, common words, ...) is {t0} tokens")
    if t0 >= lo_ok:
        return doc, info, 0, t0
    lo_n, lo_t = 0, t0
    hi: tuple[int, int] | None = None
    n = max(1, round((aim - t0) * units_per_token))
    for step in range(64):
        doc, info = build(n)
        t = count_tokens(doc)
        if lo_ok <= t <= target_tokens:
            return doc, info, n, t
        if t < lo_ok:
            lo_n, lo_t = n, t
        else:
            hi = (n, t)
        if hi is None:  # extrapolate from (0, t0) and (lo_n, lo_t)
            slope = (lo_t - t0) / lo_n
            n = lo_n * 2 if slope <= 0 else lo_n + max(1, math.ceil((aim - lo_t) / slope))
            continue
        hi_n, hi_t = hi
        if hi_n - lo_n <= 1:
            break
        if step < 8 and hi_t > lo_t:
            guess = lo_n + round((aim - lo_t) * (hi_n - lo_n) / (hi_t - lo_t))
        else:
            guess = (lo_n + hi_n) // 2
        n = min(max(guess, lo_n + 1), hi_n - 1)
    raise ValueError(f"could not fit a document between {lo_ok} and {target_tokens} tokens "
                     f"(one haystack unit is too coarse for this tokenizer/length)")


# --------------------------------------------------------------------------------------------
# random content

def _keys(rng: random.Random, k: int) -> list[str]:
    """``k`` distinct adjective-noun keys such as ``brave-lion``."""
    keys: list[str] = []
    while len(keys) < k:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _values(rng: random.Random, k: int, digits: int = 7) -> list[str]:
    """``k`` distinct ``digits``-digit numbers as strings."""
    values: list[str] = []
    while len(values) < k:
        value = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        if value not in values:
            values.append(value)
    return values


_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st",
           "t", "th", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th", "nd", "m")


def _names(rng: random.Random, k: int) -> list[str]:
    """``k`` invented proper names (e.g. ``Velmora``) that are not pydoc words and none of which
    contains another (so substring scoring is unambiguous)."""
    taken = set(_vocabulary())
    names: list[str] = []
    while len(names) < k:
        syllables = rng.randint(2, 3)
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
        name = (name + rng.choice(_CODAS)).capitalize()
        low = name.lower()
        if not 5 <= len(name) <= 10 or low in taken:
            continue
        if any(low in other.lower() or other.lower() in low for other in names):
            continue
        names.append(name)
    return names


def _depth_or_random(rng: random.Random, depth: float | None) -> float:
    return rng.random() if depth is None else depth


# --------------------------------------------------------------------------------------------
# task generators: each returns (document, questions, meta) and draws all randomness before fitting

_Generated = tuple[str, list[Question], dict[str, Any]]


def _needle_document(rng: random.Random, corpus: _Corpus, target_tokens: int,
                     count_tokens: TokenCounter, inserts: list[tuple[float, str]],
                     units_per_token: float) -> tuple[str, list[float], dict[str, Any]]:
    """Fit ``corpus`` (from a random paragraph start) with ``inserts`` to the target length."""
    start = rng.choice(corpus.starts)
    doc, achieved, n, n_tokens = _fit(lambda n: _assemble(corpus, start, n, inserts),
                                      target_tokens, count_tokens, units_per_token)
    meta = {
        "n_tokens": n_tokens, "haystack": corpus.name, "offset": start, "units": n,
        "needles": [{"text": text, "depth": d, "achieved_depth": a}
                    for (d, text), a in zip(inserts, achieved)],
    }
    return doc, achieved, meta


def _niah(rng: random.Random, target_tokens: int, count_tokens: TokenCounter, depth: float | None,
          n_keys: int, n_values: int, multi_question: str | None) -> _Generated:
    """Shared NIAH generator: ``n_keys`` keys with ``n_values`` values each. The first needle goes
    at ``depth``, the others at random depths. ``multi_question`` is ``None`` (ask for key 0's
    single number), ``"values"`` (all values of key 0) or ``"keys"`` (the numbers of all keys)."""
    d = _depth_or_random(rng, depth)
    keys = _keys(rng, n_keys)
    values = _values(rng, n_keys * n_values)
    pairs = [(keys[i // n_values], values[i]) for i in range(n_keys * n_values)]
    depths = [d] + [rng.random() for _ in pairs[1:]]
    inserts = [(dd, NIAH_NEEDLE.format(key=k, value=v)) for dd, (k, v) in zip(depths, pairs)]
    doc, achieved, meta = _needle_document(rng, _haystack(target_tokens), target_tokens, count_tokens,
                                           inserts, 0.75)
    if multi_question is None:
        text = (f"What is the special magic number for {keys[0]} mentioned in the provided text? "
                "Answer with the number only.")
        answers, qkeys = [values[0]], keys[0]
    elif multi_question == "values":
        text = (f"What are all the special magic numbers for {keys[0]} mentioned in the provided "
                "text? Answer with the numbers only.")
        answers, qkeys = values[:n_values], keys[0]
    else:
        listed = ", ".join(keys[:-1]) + f" and {keys[-1]}"
        text = (f"What are all the special magic numbers for {listed} mentioned in the provided "
                "text? Answer with the numbers only.")
        answers, qkeys = list(values), list(keys)
    n_asked = len(answers)
    qmeta = {"depth": d, "achieved_depth": achieved[0], "key": qkeys,
             "achieved_depths": achieved[:n_asked]}
    meta["depth"] = d
    return doc, [Question(text, answers, "all", qmeta)], meta


def _multiturn_niah(rng: random.Random, target_tokens: int, count_tokens: TokenCounter,
                    depth: float | None) -> _Generated:
    """Three needles (different keys) at ``depth``, ``depth + 1/3`` and ``depth + 2/3`` (wrapped
    into [0, 1]); three questions, one per needle, asked in a random order (``meta["turn"]``)."""
    d = _depth_or_random(rng, depth)
    keys, values = _keys(rng, 3), _values(rng, 3)
    depths = [x - 1.0 if x > 1.0 else x for x in (d + k / 3 for k in range(3))]
    inserts = [(dd, NIAH_NEEDLE.format(key=k, value=v)) for dd, k, v in zip(depths, keys, values)]
    doc, achieved, meta = _needle_document(rng, _haystack(target_tokens), target_tokens, count_tokens,
                                           inserts, 0.75)
    order = list(range(3))
    rng.shuffle(order)
    questions = [
        Question(f"What is the special magic number for {keys[i]} mentioned in the provided text? "
                 "Answer with the number only.", [values[i]], "all",
                 {"depth": depths[i], "achieved_depth": achieved[i], "key": keys[i], "turn": t + 1})
        for t, i in enumerate(order)
    ]
    meta["depth"] = d
    return doc, questions, meta


def _variable_tracking(rng: random.Random, target_tokens: int, count_tokens: TokenCounter,
                       depth: float | None) -> _Generated:
    """RULER VT on noise: ``VAR A = 12345.`` then 4 hops ``VAR B = VAR A.``, one statement in each
    fifth of the document (in chain order). ``depth`` is ignored."""
    names: list[str] = []
    noise_upper = NOISE.upper()
    while len(names) < 5:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names and name not in noise_upper:
            names.append(name)
    value = _values(rng, 1, digits=5)[0]
    statements = [f"VAR {names[0]} = {value}."]
    statements += [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(4)]
    depths = [rng.uniform(i / 5, (i + 1) / 5) for i in range(5)]
    doc, _, meta = _needle_document(rng, _noise_corpus(), target_tokens, count_tokens,
                                    list(zip(depths, statements)), 0.2)
    text = (f"Find all variables that are assigned the value {value} in the text above. "
            "Answer with the variable names only.")
    meta["depth"] = None
    return doc, [Question(text, list(names), "all", {"value": value, "chain": list(names)})], meta


class _WordPool:
    """Uncommon words for common-words extraction, in a fixed per-sample order: the pydoc
    vocabulary (shuffled), then invented three-syllable words, generated on demand. No word
    contains, or is contained in, a common word."""

    _SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")

    def __init__(self, rng: random.Random, common: list[str]) -> None:
        self.common = common
        self.words = [w for w in _vocabulary() if self._ok(w)]
        rng.shuffle(self.words)
        self.seen = set(_vocabulary())
        self.rng = random.Random(rng.getrandbits(64))

    def _ok(self, word: str) -> bool:
        return not any(c in word or word in c for c in self.common)

    def take(self, n: int) -> list[str]:
        while len(self.words) < n:
            word = "".join(self.rng.choice(self._SYLLABLES) for _ in range(3))
            if word not in self.seen and self._ok(word):
                self.seen.add(word)
                self.words.append(word)
        return self.words[:n]


def _word_list(items: list[str]) -> str:
    return "\n".join(f"{i}. {w}" for i, w in enumerate(items, 1))


def _common_words(rng: random.Random, target_tokens: int, count_tokens: TokenCounter,
                  depth: float | None) -> _Generated:
    """RULER CWE: a numbered list where 10 words appear ``c`` times and the others ``u`` times.
    RULER's ``c=30, u=3`` from about 4k tokens up; shorter lists scale down to ``c=3, u=1`` so the
    common words fit. The list size is fitted; ``depth`` is ignored."""
    vocab = _vocabulary()
    common: list[str] = []
    while len(common) < 10:
        w = rng.choice(vocab)
        if not any(w in c or c in w for c in common):
            common.append(w)
    pool = _WordPool(rng, common)
    shuffle_seed = rng.getrandbits(32)
    probe = _word_list(pool.take(200))
    tokens_per_item = max(count_tokens(probe), 1) / 200
    budget_items = FIT_LOW * target_tokens / tokens_per_item
    c = int(min(30, max(3, budget_items // 40)))
    u = max(1, c // 10)

    def build(n: int) -> tuple[str, None]:
        items = common * c + pool.take(n) * u
        random.Random(shuffle_seed * 1_000_003 + n).shuffle(items)
        return _word_list(items), None

    doc, _, n, n_tokens = _fit(build, target_tokens, count_tokens, 1 / (u * tokens_per_item))
    text = ("Above is a numbered list of words. In these words, some appear more often than others. "
            "What are the 10 most common words in the above list? Answer with the 10 words only.")
    meta = {"n_tokens": n_tokens, "haystack": "words", "units": n, "depth": None,
            "freq_common": c, "freq_uncommon": u}
    return doc, [Question(text, list(common), "all", {"freq_common": c, "freq_uncommon": u})], meta


def _doc_qa(rng: random.Random, target_tokens: int, count_tokens: TokenCounter,
            depth: float | None) -> _Generated:
    """Synthetic-fact QA: one template, 1 relevant fact at ``depth`` and 8 distractor facts (other
    invented entities, same template) at random depths in pydoc prose; scored by any-match."""
    d = _depth_or_random(rng, depth)
    t_idx = rng.randrange(len(QA_TEMPLATES))
    fact, question = QA_TEMPLATES[t_idx]
    names = _names(rng, 18)
    entities, answers = names[:9], names[9:]
    depths = [d] + [rng.random() for _ in range(8)]
    inserts = [(dd, fact.format(e=e, a=a)) for dd, e, a in zip(depths, entities, answers)]
    doc, achieved, meta = _needle_document(rng, _haystack(target_tokens), target_tokens, count_tokens,
                                           inserts, 0.75)
    text = question.format(e=entities[0]) + " Answer with the name only."
    qmeta = {"depth": d, "achieved_depth": achieved[0], "entity": entities[0], "template": t_idx}
    meta["depth"] = d
    return doc, [Question(text, [answers[0]], "part", qmeta)], meta


_GENERATORS: dict[str, Callable[[random.Random, int, TokenCounter, float | None], _Generated]] = {
    "niah_single": lambda r, t, c, d: _niah(r, t, c, d, 1, 1, None),
    "niah_multikey": lambda r, t, c, d: _niah(r, t, c, d, 4, 1, None),
    "niah_multivalue": lambda r, t, c, d: _niah(r, t, c, d, 1, 4, "values"),
    "niah_multiquery": lambda r, t, c, d: _niah(r, t, c, d, 4, 1, "keys"),
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
    "doc_qa": _doc_qa,
    "multiturn_niah": _multiturn_niah,
}


# --------------------------------------------------------------------------------------------
# public API

def generate_sample(task: str, target_tokens: int, seed: int, count_tokens: TokenCounter,
                    depth: float | None = None) -> Sample:
    """Generate one sample of ``task`` whose document has between ``FIT_LOW * target_tokens`` and
    ``target_tokens`` tokens by ``count_tokens`` (the model tokenizer; works from 256 to 65536+).

    ``depth`` in [0, 1] places the (first) needle for tasks in :data:`DEPTH_TASKS`; ``None`` draws
    it from the seed. ``variable_tracking`` and ``common_words`` ignore it. Deterministic: the
    same arguments (and Python version, which fixes the pydoc text) give the same sample."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if int(target_tokens) != target_tokens or target_tokens < 1:
        raise ValueError(f"target_tokens must be a positive integer, got {target_tokens!r}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    rng = random.Random(seed)
    document, questions, meta = _GENERATORS[task](rng, int(target_tokens), count_tokens, depth)
    meta["python"] = platform.python_version()
    return Sample(task, seed, int(target_tokens), document, questions, meta)


def suite_seed(base_seed: int, index: int) -> int:
    """Seed of sample ``index`` in a suite: ``base_seed * SUITE_SEED_STRIDE + index``."""
    return base_seed * SUITE_SEED_STRIDE + index


def suite_depths(n_samples: int) -> list[float]:
    """Evenly spaced needle depths for a suite: ``i / (n - 1)``, or ``[0.5]`` when ``n == 1``."""
    if n_samples == 1:
        return [0.5]
    return [i / (n_samples - 1) for i in range(n_samples)]


def generate_suite(task: str, target_tokens: int, n_samples: int, base_seed: int,
                   count_tokens: TokenCounter) -> list[Sample]:
    """``n_samples`` samples of ``task``; sample ``i`` uses seed :func:`suite_seed` and, for
    :data:`DEPTH_TASKS`, depth :func:`suite_depths` ``[i]`` so the depth x length heat map has
    even coverage (other tasks get ``depth=None``)."""
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    depths = suite_depths(n_samples)
    return [
        generate_sample(task, target_tokens, suite_seed(base_seed, i), count_tokens,
                        depths[i] if task in DEPTH_TASKS else None)
        for i in range(n_samples)
    ]


_LENGTH = re.compile(r"(\d+(?:\.\d+)?)\s*(k?)")


def parse_length(text: str) -> int:
    """Parse a token length: ``"4096"`` -> 4096, ``"4k"``/``"4K"`` -> 4096 (``k`` = 1024 tokens),
    ``"1.5k"`` -> 1536. Raises ``ValueError`` for anything else, zero, or a fractional count."""
    m = _LENGTH.fullmatch(str(text).strip().lower())
    if not m:
        raise ValueError(f"invalid length {text!r}: use a token count like '4096' or '4k' (k = 1024)")
    number, unit = m.groups()
    if not unit and "." in number:
        raise ValueError(f"invalid length {text!r}: a plain token count must be an integer")
    value = float(number) * (1024 if unit else 1)
    if value != int(value) or value < 1:
        raise ValueError(f"invalid length {text!r}: must be a positive whole number of tokens")
    return int(value)
