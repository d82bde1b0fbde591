"""Architecture hyperparameters read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and settings of a Llama-family decoder, as the GGUF states them."""

    architecture: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_scale: float  # linear position scaling factor (1.0 = none)
    rope_interleaved: bool  # llama-arch GGUFs permute Q/K so RoPE rotates adjacent pairs
    name: str = ""
    rope_freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (llama 3.1 `rope_freqs`)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"unsupported architecture '{self.architecture}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"head count {self.n_heads} is not a multiple of KV head count {self.n_kv_heads}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ModelError(f"RoPE dimension {self.rope_dim} does not fit head dim {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rope_dim // 2:
            raise ModelError(f"rope_freqs has {len(self.rope_freq_factors)} entries, expected {self.rope_dim // 2}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    def full_kv_bytes(self, n_tokens: int) -> int:
        """DESIGN §4 baseline: tokens x layers x 2 (K,V) x kv_heads x head_dim x 2 bytes (f16)."""
        return n_tokens * self.n_layers * 2 * self.n_kv_heads * self.head_dim * 2
