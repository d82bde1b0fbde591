"""Reading a GGUF model file: metadata, architecture config and dequantized tensors."""

from __future__ import annotations

import math
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from .config import ModelConfig

# Tensor types the torch engine dequantizes (via the gguf package); others are refused up front.
SUPPORTED_TENSOR_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                          "Q4_K", "Q5_K", "Q6_K"}


class GGUFModelFile:
    """A GGUF file opened read-only (memory-mapped by the gguf package)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        with open(self.path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelError(f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # the gguf package raises assorted errors on truncated/corrupt files
            raise ModelError(f"cannot read GGUF file {self.path}: {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}

    def metadata(self, key: str, default: Any = None) -> Any:
        """The value of one metadata key (scalars, strings and arrays), or `default`."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError, TypeError) as exc:  # damaged value bytes
            raise ModelError(f"{self.path.name}: metadata '{key}' is unreadable ({exc.__class__.__name__}); "
                             "the file is damaged") from None

    def keys(self) -> list[str]:
        return list(self._reader.fields.keys())

    @property
    def architecture(self) -> str:
        return str(self.metadata("general.architecture", ""))

    @cached_property
    def config(self) -> ModelConfig:
        arch = self.architecture

        def need(key: str) -> Any:
            value = self.metadata(f"{arch}.{key}")
            if value is None:
                raise ModelError(f"{self.path.name}: missing metadata '{arch}.{key}'")
            return value

        n_embd = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = int(self.metadata(f"{arch}.attention.key_length", n_embd // n_heads))
        scaling = str(self.metadata(f"{arch}.rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            raise ModelError(f"{self.path.name}: RoPE scaling '{scaling}' is not supported by the torch engine")
        factor = float(self.metadata(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        freq_factors = None
        if self.has_tensor("rope_freqs.weight"):
            freq_factors = tuple(float(x) for x in self.tensor("rope_freqs.weight").flatten().tolist())
        vocab = self.metadata(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        n_layers = int(need("block_count"))
        extra = self._gemma3_settings(arch, n_layers, n_embd, n_heads, head_dim) if arch == "gemma3" else {}
        return ModelConfig(
            architecture=arch,
            n_layers=n_layers,
            n_embd=n_embd,
            n_ff=int(need("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(self.metadata(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            vocab_size=int(vocab),
            context_length=int(need("context_length")),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_base=float(self.metadata(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(self.metadata(f"{arch}.rope.dimension_count", head_dim)),
            rope_scale=factor,
            rope_interleaved=arch in ("llama", "mistral"),
            name=str(self.metadata("general.name", self.path.stem)),
            rope_freq_factors=freq_factors,
            **extra,
        )

    def _gemma3_settings(self, arch: str, n_layers: int, n_embd: int, n_heads: int, head_dim: int) -> dict[str, Any]:
        """The Gemma 3 fields of ModelConfig, decided the way llama.cpp decides them
        (src/models/gemma3.cpp, llama_model_base::load_swa_pattern, llama_hparams::set_swa_pattern).

        * Local layers: when `gemma3.attention.sliding_window` > 0, `attention.sliding_window_pattern`
          is either a per-layer bool array, or a period n (default 6) with layer i local iff
          i % n < n - 1 (n = 0: all local): 5 local layers, then 1 global, repeated.
        * RoPE: local layers use `rope.freq_base_swa` (default 10000) and no position scaling;
          global layers use `rope.freq_base` and the GGUF's rope scaling.
        * Attention scale: 1/sqrt(key_length), except for the 27B model (62 layers) where Gemma uses
          1/sqrt(n_embd / n_heads); llama.cpp takes it from the layer count, not from metadata.
        * Norm weights are used as stored: the GGUF converter already added Gemma's +1.
        """
        window = int(self.metadata(f"{arch}.attention.sliding_window", 0) or 0)
        local: tuple[bool, ...] = ()
        if window > 0:
            pattern = self.metadata(f"{arch}.attention.sliding_window_pattern", 6)
            if isinstance(pattern, (list, tuple)):
                if len(pattern) != n_layers:
                    raise ModelError(f"{self.path.name}: sliding_window_pattern has {len(pattern)} entries for "
                                     f"{n_layers} layers")
                local = tuple(bool(x) for x in pattern)
            else:
                n = int(pattern)
                local = tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
        scale_dim = n_embd // n_heads if n_layers == 62 else head_dim
        return dict(
            local_layers=local,
            sliding_window=window if any(local) else None,
            rope_base_local=float(self.metadata(f"{arch}.rope.freq_base_swa", 10000.0)),
            rope_scale_local=1.0,
            qk_norm=True,
            post_norms=True,
            mlp_activation="gelu_tanh",
            embed_scale=math.sqrt(n_embd),
            attention_scale=1.0 / math.sqrt(scale_dim),
            final_logit_softcap=float(self.metadata(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        )

    def router_params(self) -> Any:
        """The trained SeKV router baked into this file (`sekv.*` metadata), or None when it has none.
        Raises RouterFileError when the data is corrupt or was trained for other dims."""
        from ..sekv.router_file import read_gguf_router

        params = read_gguf_router(self.metadata, self.keys(), self.path.name)
        if params is not None:
            params.check_model(self.config.global_config(), self.path.name)
        return params

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str, expected_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Dequantized float32 tensor in PyTorch (row-major) order, e.g. a linear weight as [out, in]."""
        from gguf.quants import dequantize

        info = self._tensors.get(name)
        if info is None:
            raise ModelError(f"{self.path.name}: missing tensor '{name}'")
        type_name = info.tensor_type.name
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelError(f"{self.path.name}: tensor '{name}' has unsupported type {type_name}")
        try:
            array = dequantize(info.data, info.tensor_type)
        except Exception as exc:
            raise ModelError(f"{self.path.name}: cannot decode tensor '{name}' ({type_name}): {exc}") from exc
        # GGUF lists dims fastest-first; numpy/torch want slowest-first.
        shape = tuple(int(d) for d in reversed(info.shape))
        array = np.array(array, dtype=np.float32, copy=True).reshape(shape)  # writable, owned
        if expected_shape is not None and tuple(array.shape) != tuple(expected_shape):
            raise ModelError(
                f"{self.path.name}: tensor '{name}' has shape {tuple(array.shape)}, expected {tuple(expected_shape)}"
            )
        return torch.from_numpy(array)


def open_model_file(path: str | Path) -> GGUFModelFile:
    """The GGUFModelFile of `path`, shared within a process while the file is unchanged: parsing a model's
    metadata (its vocabulary arrays) takes seconds, and a bench builds an engine per cell."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise ModelError(f"model file not found: {p}") from None
    return _open_unchanged(str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


def forget_opened_models() -> None:
    """Drop the shared GGUFModelFiles (a timing that must open the model as a user's command does)."""
    _open_unchanged.cache_clear()


@lru_cache(maxsize=4)
def _open_unchanged(path: str, inode: int, size: int, mtime_ns: int) -> GGUFModelFile:
    return GGUFModelFile(path)
