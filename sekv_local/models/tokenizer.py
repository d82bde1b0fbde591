"""Tokenizer and chat template from the GGUF itself (llama.cpp's tokenizer, vocab only)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import ModelError


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp logs straight to fd 2; silence it while loading a vocabulary."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)
        os.close(devnull)


class Tokenizer:
    """Token ids exactly as llama.cpp makes them, so the torch engine and llama.cpp see identical input."""

    def __init__(self, gguf_path: str | Path) -> None:
        import llama_cpp

        try:
            with _quiet_stderr():
                self._llm = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
        except Exception as exc:
            raise ModelError(f"cannot load the tokenizer of {gguf_path}: {exc}") from exc
        vocab = llama_cpp.llama_model_get_vocab(self._llm._model.model)
        self.n_vocab = self._llm.n_vocab()
        self.eos_id = self._llm.token_eos()
        self.bos_id = self._llm.token_bos()
        self.add_bos = bool(self._llm._model.add_bos_token())
        self.end_of_generation_ids = frozenset(
            i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i))
        self.chat_template: str | None = self._llm.metadata.get("tokenizer.chat_template")

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text` (no BOS). `special=True` parses control tokens like <|im_start|>."""
        if not text:
            return []
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of `ids` (control tokens render as nothing). Stream decoders need bytes: one
        UTF-8 character may span tokens."""
        return self._llm.detokenize(list(ids)) if ids else b""

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pending = b""

    def push(self, token_id: int) -> str:
        self._pending += self.tokenizer.decode_bytes([token_id])
        try:
            text = self._pending.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data":
                text = self._pending[: exc.start].decode("utf-8", errors="replace")
                self._pending = self._pending[exc.start:]
                return text
            text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text
