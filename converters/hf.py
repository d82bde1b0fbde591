"""`sekv-local convert hf`: a Hugging Face checkpoint directory -> GGUF, optionally with a baked router.

The heavy lifting is llama.cpp's own converter (`convert_hf_to_gguf.py` with its `conversion/`
package and the `gguf-py` it was written against), taken from the source distribution of the
llama-cpp-python release this project pins, so the GGUF it writes is exactly what that llama.cpp
expects. The sdist comes from PyPI through pip (`pip download --no-deps --no-binary`) once; the
three pieces are extracted into the cache folder, keyed by the version. The converter runs in a
subprocess of this Python; it needs `transformers` and `sentencepiece` (the `convert` extra).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable

from sekv_local.errors import ModelError, SekvError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_MAX_MEMBER_BYTES = 64 * 1024 * 1024


def llama_cpp_version() -> str:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        raise SekvError("llama-cpp-python is not installed; run native/install.sh") from None


def converter_dir(cache_root: Path | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Folder holding llama.cpp's HF converter for the installed llama-cpp-python (fetched once)."""
    from sekv_local.models.registry import cache_dir

    version = llama_cpp_version()
    root = (cache_root or cache_dir().parent) / f"llama.cpp-convert-{version}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    if log:
        log(f"fetching llama.cpp's converter from the llama-cpp-python {version} source distribution (once)")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as work:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                 "--disable-pip-version-check", "-q", f"llama-cpp-python=={version}", "-d", work],
                                capture_output=True, text=True)
        archives = list(Path(work).glob("llama_cpp_python-*.tar.gz"))
        if result.returncode != 0 or not archives:
            raise SekvError(f"could not download the llama-cpp-python {version} source distribution from PyPI "
                            f"(needed once for its HF converter): {result.stderr.strip()[-500:]}")
        staging = Path(work) / "convert"
        _extract_converter(archives[0], staging)
        try:
            os.replace(staging, root)
        except OSError:
            if not (root / "convert_hf_to_gguf.py").is_file():  # another process won the race: fine
                raise
    return root


def _extract_converter(archive: Path, dest: Path) -> None:
    """Extract only the converter's files from the sdist, refusing links and paths that leave `dest`."""
    dest.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            inner = parts[1] if len(parts) == 2 else ""
            if not inner.startswith("vendor/llama.cpp/"):
                continue
            rel = inner[len("vendor/llama.cpp/"):]
            if not any(rel == m or rel.startswith(m) for m in _MEMBERS) or not member.isfile():
                continue
            target = (dest / rel).resolve()
            if dest.resolve() not in target.parents or member.size > _MAX_MEMBER_BYTES:
                raise SekvError(f"unexpected file in the llama-cpp-python sdist: {member.name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:  # type: ignore[union-attr]
                shutil.copyfileobj(src, out)
    if not (dest / "convert_hf_to_gguf.py").is_file():
        raise SekvError(f"{archive.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py")


def check_checkpoint(folder: Path) -> str:
    """The checkpoint's model_type after checking the folder has what the converter needs."""
    if not folder.is_dir():
        raise ModelError(f"{folder} is not a folder (give the Hugging Face checkpoint directory)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, OSError) as exc:
        raise ModelError(f"{config_file} is not readable JSON ({exc})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_TYPES:
        raise ModelError(f"{folder}: model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_TYPES)})")
    if not list(folder.glob("*.safetensors")):
        raise ModelError(f"{folder} has no .safetensors weights (convert .bin checkpoints to safetensors first)")
    if not any((folder / name).is_file() for name in ("tokenizer.model", "tokenizer.json")):
        raise ModelError(f"{folder} has no tokenizer (tokenizer.model or tokenizer.json)")
    return model_type


def convert_hf(folder: str | Path, out: str | Path, router: str | Path | None = None, outtype: str = "f16",
               log: Callable[[str], None] | None = None) -> Path:
    """Write `out`: the checkpoint in `folder` as a GGUF (llama.cpp's converter), with `router` baked in."""
    from sekv_local.persistence import atomic_write

    from .bake import bake

    folder, out = Path(folder), Path(out)
    check_checkpoint(folder)
    if outtype not in ("f32", "f16", "bf16", "q8_0"):
        raise SekvError(f"--outtype must be f32, f16, bf16 or q8_0, got {outtype}")
    script = converter_dir(log=log) / "convert_hf_to_gguf.py"
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as work:
        plain = Path(work) / "model.gguf"
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # use the converter's own gguf-py
        if log:
            log(f"converting {folder} with llama.cpp's convert_hf_to_gguf.py ({outtype})")
        result = subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(plain),
                                 "--outtype", outtype], capture_output=True, text=True, env=env)
        if result.returncode != 0 or not plain.is_file():
            raise SekvError(f"llama.cpp's converter failed on {folder}:\n{(result.stderr or result.stdout)[-1500:]}")
        if router is not None:
            return bake(plain, router, out)
        with atomic_write(out) as tmp:
            shutil.copyfile(plain, tmp)
    return out
