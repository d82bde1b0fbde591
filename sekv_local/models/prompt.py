"""Prompt layout for long-document chat: [prefix][document][turn suffix][answer][turn suffix]...

The document is tokenized on its own so that its cache can be built once and reused across questions;
the chat template around it is rendered with sentinels and split at them.

A GGUF without a chat template (a base model such as Gemma 3 270M) gets a completion-style QA layout
instead, which a base model continues naturally:

    <bos>Read the document below and answer questions about it.

    Document:
    {document}

    Question: {question 1}
    Answer: {answer 1}

    Question: {question 2}
    Answer:

Its answers end at the end of their line (`answer_ends_at_newline`): a base model would otherwise go
on writing the next "Question:" itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
import jinja2.sandbox

from ..errors import SekvError
from .tokenizer import Tokenizer

_DOC = "\x00SEKV_DOCUMENT\x00"
_ASK = "\x00SEKV_QUESTION\x00"
_ANS = "\x00SEKV_ANSWER\x00"

DEFAULT_INSTRUCTION = "Read the document below and answer questions about it."


@dataclass
class Turn:
    question: str
    answer: str


class PromptBuilder:
    """Renders the GGUF's chat template around a document and a conversation (or, for a GGUF without
    one, the completion-style QA layout of the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, instruction: str = DEFAULT_INSTRUCTION) -> None:
        self.tokenizer = tokenizer
        self.instruction = instruction
        template = tokenizer.chat_template
        if template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)
        else:
            self._template = None

    @property
    def completion(self) -> bool:
        """Whether this is the completion-style layout (the GGUF has no chat template)."""
        return self._template is None

    @property
    def answer_ends_at_newline(self) -> bool:
        """Whether an answer ends at the first line break after its first words (completion layout),
        besides the model's end-of-generation tokens."""
        return self.completion

    def _render_completion(self, turns: list[Turn], question: str | None, answer: str | None) -> str:
        """The completion-style QA layout, `_DOC` in place of the document."""
        text = f"{self.instruction}\n\nDocument:\n{_DOC}\n\n"
        for turn in turns:
            text += f"Question: {turn.question}\nAnswer: {turn.answer}\n\n"
        if question is not None:
            text += f"Question: {question}\nAnswer:" + (f" {answer}" if answer is not None else "")
        return text

    def _render(self, turns: list[Turn], question: str | None, answer: str | None) -> str:
        """The conversation with `_DOC` in place of the document (and `_ASK`/`_ANS` sentinels)."""
        if self._template is None:
            return self._render_completion(turns, question, answer)
        first_user = f"{self.instruction}\n\n{_DOC}\n\n"
        messages = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": (first_user if i == 0 else "") + turn.question})
            messages.append({"role": "assistant", "content": turn.answer})
        if question is not None:
            messages.append({"role": "user", "content": (first_user if not turns else "") + question})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return self._template.render(messages=messages, add_generation_prompt=answer is None,
                                     bos_token="", eos_token="")

    def document_prefix(self) -> str:
        """Text that goes before the document (system prompt, start of the first user message)."""
        return self._render([], _ASK, None).split(_DOC)[0]

    def turn_text(self, turns: list[Turn], question: str) -> str:
        """Text to feed after the document (first turn) or after the last answer (later turns),
        ending where the assistant's answer starts."""
        rendered = self._render(turns, question, None)
        if not turns:
            return rendered.split(_DOC, 1)[1]
        before = self._render(turns[:-1], turns[-1].question, turns[-1].answer + _ANS).split(_ANS)[0]
        if not rendered.startswith(before):
            raise SekvError("this model's chat template re-renders earlier turns; multi-turn reuse of the cache "
                            "is not possible with it")
        return rendered[len(before):]

    def document_tokens(self, document: str) -> tuple[list[int], list[int]]:
        """(prefix ids, document ids); the prefix parses control tokens, the document never does
        (a book that contains '<|im_end|>' must not end the turn). The completion layout starts with
        BOS when the GGUF asks for one (Gemma is not usable without it); the chat-template path is unchanged."""
        prefix = self.tokenizer.encode(self.document_prefix(), special=True)
        if self.completion and self.tokenizer.add_bos and self.tokenizer.bos_id >= 0:
            prefix = [self.tokenizer.bos_id] + prefix
        return prefix, self.tokenizer.encode(document)

    def turn_tokens(self, turns: list[Turn], question: str) -> list[int]:
        """Ids of the turn text; the user's question is not parsed for control tokens."""
        text = self.turn_text(turns, question)
        head, _, tail = text.partition(question)
        if not _:
            return self.tokenizer.encode(text, special=True)
        return (self.tokenizer.encode(head, special=True) + self.tokenizer.encode(question)
                + self.tokenizer.encode(tail, special=True))

    def conversation_tokens(self, turns: list[Turn], question: str) -> list[int]:
        """Ids of a whole conversation after the document: every turn of `turns` (question and answer)
        and then `question`, as the session would have fed them one turn at a time."""
        ids: list[int] = []
        for i, turn in enumerate(turns):
            ids += self.turn_tokens(turns[:i], turn.question) + self.tokenizer.encode(turn.answer)
        return ids + self.turn_tokens(turns, question)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
