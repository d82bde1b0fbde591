"""Reading a GGUF model file: metadata, architecture config and dequantized tensors."""

from __future__ import annotations

import math
import struct
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from .config import ModelConfig
from .gguf_reader import GGUFContents, GGUFFormatError, plain_value

# Tensor types the torch engine dequantizes (quantized blocks via the gguf package); others are refused up front.
SUPPORTED_TENSOR_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                          "Q4_K", "Q5_K", "Q6_K"}


class GGUFModelFile:
    """A GGUF file opened read-only (memory-mapped; metadata arrays decoded on demand)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        with open(self.path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelError(f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            self._contents = GGUFContents(self.path)
        except (GGUFFormatError, OSError, ValueError) as exc:
            raise ModelError(f"cannot read GGUF file {self.path}: {exc}") from exc
        self._fields = self._contents.fields
        self._tensors = self._contents.tensors

    def metadata(self, key: str, default: Any = None) -> Any:
        """The value of one metadata key (scalars, strings and arrays as lists), or `default`."""
        if key not in self._fields:
            return default
        try:
            return plain_value(self._fields[key])
        except (UnicodeDecodeError, ValueError, IndexError, TypeError, struct.error) as exc:  # damaged value bytes
            raise ModelError(f"{self.path.name}: metadata '{key}' is unreadable ({exc.__class__.__name__}); "
                             "the file is damaged") from None

    def keys(self) -> list[str]:
        return list(self._fields)

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
            vocab = len(self._fields["tokenizer.ggml.tokens"])
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
        info = self._tensors.get(name)
        if info is None:
            raise ModelError(f"{self.path.name}: missing tensor '{name}'")
        type_name = tensor_type_name(info.type_id)
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelError(f"{self.path.name}: tensor '{name}' has unsupported type {type_name}")
        # GGUF lists dims fastest-first; numpy/torch want slowest-first.
        shape = tuple(reversed(info.dims))
        try:
            array = dequantized(info.data, info.type_id, shape)
        except Exception as exc:
            raise ModelError(f"{self.path.name}: cannot decode tensor '{name}' ({type_name}): {exc}") from exc
        if expected_shape is not None and tuple(array.shape) != tuple(expected_shape):
            raise ModelError(
                f"{self.path.name}: tensor '{name}' has shape {tuple(array.shape)}, expected {tuple(expected_shape)}"
            )
        return torch.from_numpy(array)


def tensor_type_name(type_id: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def dequantized(data: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes [n_bytes] uint8 -> a writable float32 array of `shape` (slowest dim first)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    kind = GGMLQuantizationType(type_id)
    if kind == GGMLQuantizationType.F32:
        return np.array(data.view(np.float32).reshape(shape), dtype=np.float32, copy=True)
    if kind == GGMLQuantizationType.F16:
        return data.view(np.float16).reshape(shape).astype(np.float32)
    if kind == GGMLQuantizationType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    from ..native.bindings import dequantize_loaded

    fast = dequantize_loaded(data, type_id, int(np.prod(shape, dtype=np.int64)))
    if fast is not None:  # ggml's own conversion, where the native library is loaded
        return fast.reshape(shape)
    blocks = data.reshape(quant_shape_to_byte_shape(shape, kind))
    return np.array(dequantize(blocks, kind), dtype=np.float32, copy=True).reshape(shape)


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
