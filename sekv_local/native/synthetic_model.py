"""A llama-architecture GGUF with random weights and a synthetic vocabulary, of any shape.

For speed and engine-against-engine checks on a machine that cannot fetch the real model (the GPU
machine reaches no network and takes at most 64 MiB of files): a decode step costs the same whatever
the weights hold, and two engines given the same weights must agree whatever they are. Never used to
claim anything about answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SekvError


@dataclass(frozen=True)
class LlamaShape:
    """Defaults: SmolLM2-135M's shape (the project's default model)."""

    n_layer: int = 30
    n_embd: int = 576
    n_head: int = 9
    n_head_kv: int = 3
    n_ff: int = 1536
    n_vocab: int = 49152
    context_length: int = 1 << 17
    rope_base: float = 100000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv or (self.n_embd // self.n_head) % 2:
            raise SekvError("synthetic model: n_embd must split into an even head dim and n_head into KV groups")
        if self.n_vocab < 512:
            raise SekvError("synthetic model: n_vocab must be >= 512 (special and byte tokens come first)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def write_random_llama(path: str | Path, shape: LlamaShape = LlamaShape(), seed: int = 0) -> Path:
    """Write the GGUF (f16 weights ~ N(0, 0.02), unit norms); returns its path."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("sekv-local synthetic llama")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then plain pieces
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(shape.n_vocab - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (shape.n_vocab - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(shape.n_vocab)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def weight(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(shape.n_embd, dtype=np.float32)
    kv = shape.n_head_kv * shape.head_dim
    writer.add_tensor("token_embd.weight", weight(shape.n_vocab, shape.n_embd))
    for i in range(shape.n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(shape.n_embd, shape.n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv, shape.n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv, shape.n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(shape.n_embd, shape.n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(shape.n_embd, shape.n_ff))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weight(shape.n_vocab, shape.n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
