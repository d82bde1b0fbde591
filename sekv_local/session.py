"""A document loaded once and a conversation about it: the API the CLI, TUI and bench share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .documents import Document, read_document
from .engines import EngineOptions, SamplingConfig, create_engine
from .engines.base import Engine
from .errors import DocumentError, SekvError
from .models.prompt import PromptBuilder, Turn
from .models.registry import DEFAULT_MODEL, resolve_model
from .models.tokenizer import StreamDecoder, Tokenizer

ProgressFn = Callable[[int, int], None]

#: tokens kept free after the document for a question and its answer
ANSWER_RESERVE = 384


@dataclass
class Answer:
    """One finished (or stopped) answer with what it cost."""

    question: str
    text: str
    n_tokens: int
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    memory: dict[str, Any]
    observations: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "question": self.question, "answer": self.text, "answer_tokens": self.n_tokens,
            "prompt_tokens": self.prompt_tokens, "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "decode_tokens_per_s": round(self.n_tokens / self.decode_s, 2) if self.decode_s else None,
            "memory": self.memory, "observations": self.observations,
        }


@dataclass(frozen=True)
class SessionSettings:
    model: str = DEFAULT_MODEL
    engine: str = "torch"
    method: str = "full"
    budget: float | int | None = None
    threads: int | None = None
    chunk_size: int = 1024
    device: str = "cpu"
    max_new_tokens: int = 256
    sampling: SamplingConfig = SamplingConfig()
    method_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SekvError("max new tokens must be >= 1")

    def engine_options(self) -> EngineOptions:
        return EngineOptions(method=self.method, budget=self.budget, threads=self.threads,
                             chunk_size=self.chunk_size, device=self.device,
                             method_options=dict(self.method_options))


class Session:
    """Holds one engine whose context starts with one document; questions are appended after it.

    `ask` streams an answer; the conversation stays in the cache (multi-turn) unless
    `reset_conversation()` rolls the context back to just after the document.
    """

    def __init__(self, engine: Engine, document: Document, settings: SessionSettings, model_path: Path) -> None:
        self.engine = engine
        self.document = document
        self.settings = settings
        self.model_path = model_path
        self.prompt = PromptBuilder(engine.tokenizer)
        self.turns: list[Turn] = []
        self.answers: list[Answer] = []
        self.document_tokens = 0
        self._prefix_tokens = 0
        self._doc_ids: list[int] | None = None
        self.ingest_s = 0.0
        self._after_document: Any = None
        self.folds = 0  # times the conversation was folded back to the document and its latest turns

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, document: Document | str | Path, settings: SessionSettings = SessionSettings(),
               show_progress: bool = True, tokenizer: Tokenizer | None = None,
               engine: Engine | None = None) -> "Session":
        """Resolve the model (pulling the default one on first use) and build the engine; no ingest yet."""
        doc = document if isinstance(document, Document) else read_document(document)
        model_path = resolve_model(settings.model, show_progress=show_progress)
        if engine is None:
            tokenizer = tokenizer or Tokenizer(model_path)
            engine = create_engine(settings.engine, model_path, tokenizer, settings.engine_options())
        return cls(engine, doc, settings, model_path)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def ingest(self, progress: ProgressFn | None = None) -> None:
        """Feed the document once (chunked prefill); refuses up front if it cannot fit."""
        prefix, doc_ids = self.prompt.document_tokens(self.document.text)
        needed = len(prefix) + len(doc_ids) + ANSWER_RESERVE
        limit = self.engine.max_context()
        if needed > limit:
            raise DocumentError(
                f"{self.document.name} is {len(doc_ids)} tokens; with the prompt and room for an answer that is "
                f"{needed} tokens, but engine '{self.engine.name}' with method '{self.settings.method}' holds at "
                f"most {limit} (model trained context {self.engine.config.context_length}). "
                f"{_fitting_advice(needed, limit, self.engine.config.context_length)}")
        self.engine.reset()
        self.engine.reserve(len(prefix) + len(doc_ids))  # budgets are fractions of the document's full KV
        self._check_host_memory(len(prefix) + len(doc_ids) + ANSWER_RESERVE, len(doc_ids))
        self.turns.clear()
        self.answers.clear()
        start = time.perf_counter()
        self.engine.feed(prefix + doc_ids, progress=progress)
        self.engine.finish_prefill()
        self.ingest_s = time.perf_counter() - start
        self.document_tokens = len(doc_ids)
        self._prefix_tokens = len(prefix)
        self._after_document = self.engine.mark()

    def _check_host_memory(self, n_tokens: int, doc_tokens: int) -> None:
        """Refuse before reading when the method's host tier for n_tokens will not fit in host RAM."""
        from .resources import available_host_bytes

        needed = self.engine.host_bytes_needed(n_tokens)
        available, source = available_host_bytes()
        if not needed or available is None or needed <= available:
            return
        fits = int(doc_tokens * available / needed)
        raise DocumentError(
            f"{self.document.name} is {doc_tokens} tokens; method '{self.settings.method}' keeps its full-resolution "
            f"copy in host RAM: about {needed / 2**20:,.0f} MiB for this document, but {available / 2**20:,.0f} MiB "
            f"are available ({source}). A document of up to about {fits} tokens fits; or use a method without a "
            f"host tier (--method snapkv or streaming), or free memory.")

    def adopt(self, source: "Session") -> None:
        """Take `source`'s memory of the same document instead of reading it again: the state right after
        its ingest (its conversation is rolled back first), copied. This engine must import `source`'s
        engine state: the llama.cpp engine takes the torch engine's, whose prefill it runs anyway."""
        if not source.ingested:
            raise SekvError("the session to adopt from has not read its document")
        if source.document.sha256 != self.document.sha256:
            raise SekvError(f"cannot adopt the memory of {source.document.name}: it is another document")
        source.reset_conversation()
        tensors, meta = source.engine.export_state()
        self.engine.reset()
        self.engine.import_state({k: v.clone() for k, v in tensors.items()}, meta)
        self.turns.clear()
        self.answers.clear()
        self.document_tokens = source.document_tokens
        self._prefix_tokens = source._prefix_tokens
        self.ingest_s = source.ingest_s
        self._after_document = self.engine.mark()

    @property
    def ingested(self) -> bool:
        return self._after_document is not None

    # -- persistence ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Save the document's memory (safetensors + JSON header, atomic). The conversation is not
        part of it: it is cleared first, so the file reopens to the state right after reading."""
        from .persistence import file_sha256, save_memory

        if not self.ingested:
            raise SekvError("nothing to save: no document ingested yet")
        self.reset_conversation()
        tensors, engine_meta = self.engine.export_state()
        s = self.settings
        header = {
            "model": {"name": s.model, "file_sha256": file_sha256(self.model_path),
                      "architecture": self.engine.config.architecture, "n_layers": self.engine.config.n_layers,
                      "n_kv_heads": self.engine.config.n_kv_heads, "head_dim": self.engine.config.head_dim},
            "engine": s.engine, "method": s.method, "budget": s.budget, "method_options": dict(s.method_options),
            "document": {"name": self.document.name, "sha256": self.document.sha256, "tokens": self.document_tokens},
            "ingest_s": self.ingest_s, "state": engine_meta,
        }
        save_memory(path, tensors, header)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, document: Document | str | Path, settings: SessionSettings = SessionSettings(),
             show_progress: bool = True, tokenizer: Tokenizer | None = None) -> "Session":
        """Reopen a saved memory for `document`. Method, budget and method options come from the file;
        a file built from another model file or another version of the document is refused."""
        from .persistence import MemoryFileError, file_sha256, load_memory

        tensors, header = load_memory(path)  # verifies the checksum before anything trusts the header
        doc = document if isinstance(document, Document) else read_document(document)
        if header["document"]["sha256"] != doc.sha256:
            raise MemoryFileError(f"{path} was built from a different document than {doc.name} "
                                  f"(or the document changed since); read it again instead")
        settings = SessionSettings(**{**settings.__dict__, "method": header["method"], "budget": header["budget"],
                                      "method_options": tuple(sorted(header["method_options"].items())),
                                      "engine": header["engine"]})
        session = cls.create(doc, settings, show_progress=show_progress, tokenizer=tokenizer)
        if header["model"]["file_sha256"] != file_sha256(session.model_path):
            raise MemoryFileError(f"{path} was built with another model file ({header['model']['name']}); "
                                  f"it cannot be used with {session.settings.model}")
        session.engine.import_state(tensors, header["state"])
        session.document_tokens = int(header["document"]["tokens"])
        session._prefix_tokens = len(session.prompt.document_tokens("")[0])
        session.ingest_s = float(header.get("ingest_s", 0.0))
        session._after_document = session.engine.mark()
        return session

    # -- conversation ----------------------------------------------------------------------------
    def reset_conversation(self) -> None:
        """Forget the questions and answers; keep the document's cache."""
        if not self.ingested:
            raise SekvError("no document ingested yet")
        self.engine.rollback(self._after_document)
        self.turns.clear()

    def ask(self, question: str, max_new_tokens: int | None = None, keep_history: bool = True) -> Iterator[str]:
        """Stream the answer to `question` as text pieces. When done (or stopped early by closing the
        iterator) the answer is recorded in `self.answers` and, with `keep_history`, kept in the cache."""
        if not self.ingested:
            self.ingest()
        question = question.strip()
        if not question:
            raise SekvError("empty question")
        max_new = max_new_tokens or self.settings.max_new_tokens
        if not keep_history:
            self.reset_conversation()
        ids = self.prompt.turn_tokens(self.turns, question)
        if not self._fits(len(ids) + max_new):
            ids = self._fold_conversation(question, max_new)
        stats = self.engine.stats
        p0, d0 = stats.prefill_s, stats.decode_s
        self.engine.reset_observations()
        self.engine.feed(ids)
        self.engine.finish_prefill()
        decoder = StreamDecoder(self.tokenizer)
        pieces: list[str] = []
        n = 0
        ends_at_newline = self.prompt.answer_ends_at_newline
        try:
            tokens = self.engine.generate(max_new, self.settings.sampling)
            for token in tokens:
                piece = decoder.push(token)
                head = piece.split("\n", 1)[0]
                if ends_at_newline and head != piece and ("".join(pieces) + head).strip():
                    # completion layout: the answer's line is done. A token that also carries answer
                    # text is kept (fed into the cache by resuming the generator once); a bare
                    # line break is not, as an end-of-generation token is not.
                    if head:
                        n += 1
                        pieces.append(head)
                        yield head
                        next(tokens, None)
                    break
                n += 1
                if piece:
                    pieces.append(piece)
                    yield piece
            else:
                tail = decoder.flush()
                if tail:
                    pieces.append(tail)
                    yield tail
        finally:
            text = "".join(pieces).strip()
            self.turns.append(Turn(question, text))
            self.answers.append(Answer(
                question=question, text=text, n_tokens=n, prompt_tokens=len(ids),
                prefill_s=self.engine.stats.prefill_s - p0, decode_s=self.engine.stats.decode_s - d0,
                memory=self.engine.memory().as_dict(), observations=self._located(self.engine.observations())))
            if not keep_history:
                self.reset_conversation()

    def _fits(self, n_tokens: int) -> bool:
        """Whether n_tokens more fit the context and the method's budget."""
        room = self.engine.room_tokens()
        return self.engine.n_tokens + n_tokens <= self.engine.max_context() and (room is None or n_tokens <= room)

    def _fold_conversation(self, question: str, max_new: int) -> list[int]:
        """The conversation outgrew the context or the budget: start again from the document (its memory
        stays) with as many of the latest turns as fit in half the room, read again (a compressing method
        folds them into its memory like the document). Returns the ids to feed for `question`."""
        self.engine.rollback(self._after_document)
        room = self.engine.room_tokens()
        limit = min(self.engine.max_context() - self.engine.n_tokens, room if room is not None else 1 << 30)
        kept: list[Turn] = []
        ids = self.prompt.turn_tokens([], question)
        for start in range(len(self.turns) - 1, -1, -1):
            candidate = self.prompt.conversation_tokens(self.turns[start:], question)
            if len(candidate) + max_new > limit // 2:
                break
            kept, ids = self.turns[start:], candidate
        self.turns[:] = kept
        self.folds += 1
        return ids

    def passage(self, start_token: int, n_tokens: int) -> str:
        """Document text of tokens [start, start + n) (token offsets within the document)."""
        if self._doc_ids is None:
            self._doc_ids = self.prompt.document_tokens(self.document.text)[1]
        return self.tokenizer.decode(self._doc_ids[max(0, start_token): max(0, start_token + n_tokens)])

    def _located(self, observations: dict[str, Any]) -> dict[str, Any]:
        """Add document token offsets (and the text) to zoomed spans that lie in the document."""
        zoomed = observations.get("zoomed")
        if not zoomed:
            return observations
        located = []
        for z in zoomed:
            offset = z["start"] - self._prefix_tokens
            if 0 <= offset < self.document_tokens:
                located.append({**z, "doc_token": offset, "text": self.passage(offset, z["length"])})
        return {**observations, "zoomed": sorted(located, key=lambda z: -z["hits"])}

    def answer(self, question: str, **kwargs: Any) -> Answer:
        """Non-streaming `ask`: the finished Answer."""
        for _ in self.ask(question, **kwargs):
            pass
        return self.answers[-1]


def _fitting_advice(needed: int, limit: int, trained_context: int) -> str:
    """What lets a document of `needed` tokens run when the engine and method hold `limit`."""
    shorter = f"or a shorter document (at most about {max(0, limit - ANSWER_RESERVE - 64)} tokens)."
    if needed > trained_context:
        # every method but SeKV with bounded positions stops at the trained context: RoPE beyond it is
        # out of distribution, and only SeKV stores pre-RoPE keys it can re-place inside the window
        longer_model = "a model trained for longer contexts (--model gemma3-270m: 32K), " \
            if trained_context < 32768 else ""
        return ("Beyond the model's trained context use SeKV with its memory placed inside that window "
                f"(--engine torch --method sekv@positions=bounded --budget 0.25), {longer_model}{shorter}")
    return f"Use an engine and method that hold the model's trained context ({trained_context} tokens) {shorter}"
