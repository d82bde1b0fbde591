"""`--engine auto`: the llama.cpp engine where it runs the method and model, the torch engine otherwise.

The llama.cpp engine (native SeKV decode in llama.cpp's kernels) is the fast path; it runs method `sekv`
on llama- and gemma3-architecture models with a built native library. Anything else runs in the torch engine, and
the user is told why in one line (engine notices), so the slower path is never taken silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import SekvError
from .base import EngineOptions

AUTO = "auto"
#: methods the llama.cpp engine runs
NATIVE_METHODS = ("sekv",)
#: GGUF architectures the native graph builds
NATIVE_ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class EngineChoice:
    """The engine to build, and why `auto` did not take the llama.cpp engine (None: it did, or none was asked)."""

    name: str
    reason: str | None = None

    def notice(self) -> str | None:
        return None if self.reason is None else f"engine torch: {self.reason}"


def _wants_cuda(device: str) -> bool:
    """Whether the engine will run on CUDA (a device torch cannot see counts: the engine's start says so)."""
    from .torch_engine import resolve_device

    try:
        return resolve_device(device).startswith("cuda")
    except SekvError:
        return True


def native_library_missing(cuda: bool) -> str | None:
    """Why the native library cannot be loaded without a build (None: it is there)."""
    from ..native.build import library_path

    try:
        library_path(auto_build=False, cuda=cuda)
    except SekvError as exc:
        return f"the llama.cpp engine's native library is not built ({exc}; `bash native/install.sh` builds it)"
    return None


def choose_engine(requested: str, gguf_path: str | Path, options: EngineOptions) -> EngineChoice:
    """The engine `requested` names; for `auto`, the llama.cpp engine unless the method, the model's
    architecture, an option or the native library rules it out (checked without loading weights)."""
    if requested != AUTO:
        return EngineChoice(requested)
    if options.method not in NATIVE_METHODS:
        return EngineChoice("torch", f"method '{options.method}' runs in the torch engine")
    from ..models.gguf_file import open_model_file

    arch = open_model_file(gguf_path).architecture
    if arch not in NATIVE_ARCHITECTURES:
        return EngineChoice("torch", f"the llama.cpp engine does not run '{arch}' models yet")
    if dict(options.method_options).get("positions") == "bounded":
        return EngineChoice("torch", "the llama.cpp engine does not run positions=bounded yet")
    # a CUDA library is looked for when the engine starts (a plan for it may need the toolkit); a failed start
    # falls back too (create_engine)
    missing = None if _wants_cuda(options.device) else native_library_missing(cuda=False)
    if missing is not None:
        return EngineChoice("torch", missing)
    return EngineChoice("llama.cpp")
