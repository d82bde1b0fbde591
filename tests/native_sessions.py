"""A document read by the torch engine and then by the llama.cpp engine with native prefill, for the tests that
compare the two memories."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sekv_local.documents import Document
from sekv_local.engines import create_engine
from sekv_local.session import Session, SessionSettings
from sekv_local.models.tokenizer import Tokenizer


def read_with_both_engines(gguf: Path, tokenizer: Tokenizer, document: str, settings: SessionSettings
                           ) -> tuple[dict[str, Session], list[int]]:
    """Sessions {"torch", "llama.cpp"} that ingested `document`, torch first, and the token counts the torch model
    ran since (appended as it runs): the model is shared by both engines in one process, so each is the llama.cpp
    engine's."""
    sessions, torch_tokens = {}, []
    for engine in ("torch", "llama.cpp"):
        options = dataclasses.replace(settings, engine=engine).engine_options()
        if engine == "llama.cpp":
            options.method_options["prefill"] = "native"
        eng = create_engine(engine, gguf, tokenizer, options)
        if engine == "llama.cpp":
            model = eng.reference.model
            forward = model.forward
            model.forward = lambda ids, *a, **kw: (torch_tokens.append(int(ids.shape[0])), forward(ids, *a, **kw))[1]
        sessions[engine] = Session(eng, Document.from_text(document), dataclasses.replace(settings, engine=engine), gguf)
        sessions[engine].ingest()
    return sessions, torch_tokens
