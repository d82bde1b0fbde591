"""Training samples, made locally and kept apart from the evaluation suite.

Text: docstrings of CPython's own standard-library modules (prose that ships with every CPython),
cleaned into paragraphs; the evaluation's haystacks come from `pydoc_data.topics` instead, and a
test checks that the two share no long passages. Seeds: training sample i uses seed
TRAIN_SEED_BASE + i, far above any evaluation suite seed (`suite_seed(base, i)` for small bases).

Two kinds of sample, alternating:
* retrieval: a passage with a few "The access code for <name> is <number>." facts; the query is a
  chat turn asking for one of them followed by the true answer;
* continuation: a passage and the text that follows it (plain next-token distillation).
"""

from __future__ import annotations

import importlib
import random
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache

from ..models.prompt import PromptBuilder
from ..models.tokenizer import Tokenizer

TRAIN_SEED_BASE = 7_000_000_000

# Pure-Python stdlib modules with long prose docstrings (none is part of pydoc_data.topics).
_MODULES = ("argparse", "asyncio.events", "asyncio.streams", "base64", "bdb", "calendar", "cmd", "codecs",
            "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses",
            "datetime", "decimal", "difflib", "doctest", "email.message", "email.parser", "enum", "filecmp",
            "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac",
            "html.parser", "http.client", "http.cookiejar", "http.server", "imaplib", "inspect", "ipaddress",
            "json", "json.decoder", "locale", "logging", "logging.handlers", "mailbox", "mimetypes",
            "multiprocessing.pool", "netrc", "numbers", "optparse", "pathlib", "pickletools", "pkgutil",
            "platform", "plistlib", "poplib", "pprint", "profile", "pstats", "queue", "quopri", "random",
            "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
            "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
            "threading", "timeit", "tokenize", "trace", "traceback", "turtle", "typing", "unittest.case",
            "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref",
            "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zipimport")

_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|[$%#]|[\w.]+\(.*\)\s*$|[-=*~^]{3,})")


SHINGLE_WORDS = 10


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    """Every run of n consecutive words (lower case): two texts share a passage when they share one."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}


@lru_cache(maxsize=1)
def docstring_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs (>= 200 characters) from the listed modules' docstrings, in a fixed order;
    a paragraph that shares a 10-word passage with the evaluation's pydoc text is left out (some
    docstrings repeat the reference manual)."""
    import inspect

    from ..eval.tasks import natural_text

    evaluation = shingles(natural_text(10**8))

    out: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:  # a module missing from this Python build (e.g. no turtle without Tk)
                continue
            objects = [module] + [getattr(module, a) for a in sorted(vars(module)) if not a.startswith("_")]
            for obj in objects:
                if getattr(obj, "__module__", name) != name and obj is not module:
                    continue
                doc = inspect.getdoc(obj) or ""
                for block in re.split(r"\n\s*\n", doc):
                    lines = [ln.strip() for ln in block.splitlines() if ln.strip() and not _CODE_LINE.match(ln)]
                    text = " ".join(lines)
                    if len(text) >= 200 and text.count(" ") > 30 and not shingles(text) & evaluation:
                        out.append(text)
    return tuple(dict.fromkeys(out))  # drop repeats, keep order


@dataclass
class TrainSample:
    """context: ids the memory is built from (prompt prefix + passage); query: ids read against the
    memory (a chat turn and its answer, or the passage's continuation)."""

    kind: str
    seed: int
    context: list[int]
    query: list[int]


def _passage(rng: random.Random, n_tokens: int) -> str:
    """Paragraphs from a random start until about n_tokens (by a chars-per-token estimate; callers trim)."""
    paragraphs = docstring_paragraphs()
    i = rng.randrange(len(paragraphs))
    picked: list[str] = []
    chars = 0
    while chars < n_tokens * 5:
        picked.append(paragraphs[i % len(paragraphs)])
        chars += len(picked[-1]) + 2
        i += 1
    return "\n\n".join(picked)


def _name(rng: random.Random) -> str:
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3))).title()


def make_sample(index: int, context_tokens: int, query_tokens: int, tokenizer: Tokenizer,
                prompt: PromptBuilder) -> TrainSample:
    """Sample `index` (deterministic): about `context_tokens` of context and <= `query_tokens` of query."""
    seed = TRAIN_SEED_BASE + index
    rng = random.Random(seed)
    if index % 2 == 0:
        text = _passage(rng, context_tokens)
        ids = tokenizer.encode(text)
        prefix, _ = prompt.document_tokens("")
        body = context_tokens - len(prefix)
        return TrainSample("continuation", seed, prefix + ids[:body], ids[body: body + query_tokens])
    facts = {_name(rng): str(rng.randrange(10**6, 10**7)) for _ in range(4)}
    text = _passage(rng, context_tokens)
    sentences = re.split(r"(?<=\. )", text)
    for name, code in facts.items():
        sentences.insert(rng.randrange(len(sentences) + 1), f"The access code for {name} is {code}. ")
    prefix, doc = prompt.document_tokens("".join(sentences))
    doc = doc[: context_tokens - len(prefix)]
    # a fact cut off by the trim would make a question without an answer: ask about one that is in
    kept = tokenizer.decode(doc)
    present = [n for n in facts if f"{n} is {facts[n]}" in kept] or list(facts)[:1]
    name = rng.choice(present)
    if f"{name} is {facts[name]}" not in kept:  # nothing survived the trim: state the fact at the end
        doc = doc[: len(doc) - 24] + tokenizer.encode(f" The access code for {name} is {facts[name]}.")
    turn = prompt.turn_tokens([], f"What is the access code for {name}? Answer with the number only.")
    answer = tokenizer.encode(f"{facts[name]}")
    return TrainSample("retrieval", seed, prefix + doc, (turn + answer)[-query_tokens:])
