"""Architecture hyperparameters read from GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ModelError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and settings of a Llama-family decoder, as the GGUF states them.

    The fields after `rope_freq_factors` describe the Gemma 3 additions; their defaults are the plain
    Llama layout, so llama / mistral / qwen2 configs never set them.
    """

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
    # -- Gemma 3 ------------------------------------------------------------------------------------
    #: per layer, True = local layer: attends only to the last `sliding_window` positions (itself
    #: included) and uses the local RoPE below; () = every layer is global (full causal attention)
    local_layers: tuple[bool, ...] = ()
    sliding_window: int | None = None  # keys a local-layer query sees, itself included
    rope_base_local: float | None = None  # RoPE base of local layers (None = rope_base)
    rope_scale_local: float = 1.0  # linear position scaling of local layers (llama.cpp: never scaled)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (attn_q_norm / attn_k_norm)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before the residual add
    mlp_activation: str = "silu"  # of the gate in the gated MLP: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(n_embd))
    attention_scale: float | None = None  # softmax scale of q.k (None = 1/sqrt(head_dim))
    final_logit_softcap: float = 0.0  # logits -> c * tanh(logits / c) when > 0

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
        if self.local_layers and len(self.local_layers) != self.n_layers:
            raise ModelError(f"the layer pattern names {len(self.local_layers)} layers, the model has {self.n_layers}")
        if any(self.local_layers) and (self.sliding_window is None or self.sliding_window < 1):
            raise ModelError(f"local (sliding-window) layers need a positive window, got {self.sliding_window}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ModelError(f"unknown MLP activation '{self.mlp_activation}' (known: {', '.join(MLP_ACTIVATIONS)})")
        if self.attention_scale is not None and not self.attention_scale > 0:
            raise ModelError(f"attention scale must be positive, got {self.attention_scale}")
        if self.final_logit_softcap < 0:
            raise ModelError(f"final logit softcap must be >= 0, got {self.final_logit_softcap}")

    @property
    def has_local_layers(self) -> bool:
        """Whether some layers use sliding-window attention (Gemma 3)."""
        return any(self.local_layers)

    def is_local(self, layer: int) -> bool:
        """Whether `layer` is a sliding-window (local) layer."""
        return bool(self.local_layers) and self.local_layers[layer]

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Layers with full causal attention, in order (every layer unless some are local)."""
        return tuple(i for i in range(self.n_layers) if not self.is_local(i))

    def global_config(self) -> "ModelConfig":
        """The model as cache methods and the SeKV router see it: its global layers only (local layers keep
        exact sliding windows outside any method). Itself when every layer is global."""
        if not self.has_local_layers:
            return self
        return dataclasses.replace(self, n_layers=len(self.global_layers), local_layers=(), sliding_window=None,
                                   rope_base_local=None)

    def window(self, layer: int) -> int | None:
        """Keys a query of `layer` may see (itself included), or None for full causal attention."""
        return self.sliding_window if self.is_local(layer) else None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    def full_kv_bytes(self, n_tokens: int) -> int:
        """The baseline every budget is a share of: tokens x layers x 2 (K,V) x kv_heads x head_dim x 2 bytes
        (f16), every layer at full context."""
        return n_tokens * self.n_layers * 2 * self.n_kv_heads * self.head_dim * 2

    def full_kv_held_bytes(self, n_tokens: int) -> int:
        """What full KV actually holds for n_tokens: sliding-window layers keep only their window (Gemma 3's
        local layers: 512 tokens), so on such a model it is far less than `full_kv_bytes`."""
        rows = sum(min(n_tokens, self.window(layer) or n_tokens) for layer in range(self.n_layers))
        return rows * 2 * self.n_kv_heads * self.head_dim * 2
