"""A Llama-family decoder (llama / mistral / qwen2, and gemma3) in PyTorch, attention delegated to a cache policy.

Gemma 3 adds, all switched on by ModelConfig fields (see config.py): embeddings scaled by sqrt(n_embd),
per-head RMSNorm of q and k before RoPE, RMSNorm of the attention and MLP outputs before each residual
add, a GELU(tanh)-gated MLP, and sliding-window local layers (masking and their RoPE are the cache
policy's job). GGUF norm weights already include Gemma's +1, so every norm is a plain RMSNorm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .gguf_file import GGUFModelFile

if TYPE_CHECKING:
    import numpy as np

    from ..cache.base import CachePolicy


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., n] with weight [n]."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


#: logits rows computed at once when only each row's log-normaliser and one gathered logit are needed
SCORE_BLOCK_BYTES = 4 * 2**20
#: the feed-forward block runs over rows so that its [rows, 2 FF] float32 activations (counted twice: the
#: projection and the gated product) stay under this
MLP_BLOCK_BYTES = 4 * 2**20


@dataclass
class ChunkScores:
    """What a chunk's logits say about its own tokens, computed without a [T, vocab] tensor.

    last: [1, vocab] the last row's logits (they predict the next token); nll: [T - 1] float32,
    -log p(tokens[t + 1] | tokens[..t]) for t < T - 1; first_nll: -log p(tokens[0]) from the row before the
    chunk, which only the caller has (None: unknown); rows: the vocabulary ids [R] the probabilities normalise
    over (the cache's `score_rows`; None: all of them).
    """

    last: torch.Tensor
    nll: torch.Tensor
    first_nll: float | None = None
    rows: torch.Tensor | None = None

    def predicted_by(self, previous: np.ndarray | None, first_token: int) -> ChunkScores:
        """Fill first_nll from the logits [vocab] of the row before the chunk (None: nothing predicted it)."""
        if previous is not None:
            self.first_nll = token_nll(previous, int(first_token), self.rows)
        return self

    @classmethod
    def from_logits(cls, logits: torch.Tensor, tokens: torch.Tensor) -> "ChunkScores":
        """From logits [T, vocab] that exist anyway (or [1, vocab]: the last row only, no nll)."""
        logits = logits.float()
        T = int(tokens.shape[0])
        if logits.shape[0] != T or T < 2:
            return cls(logits[-1:], logits.new_zeros(0))
        nll = torch.logsumexp(logits[:-1], dim=-1) - logits[:-1].gather(1, tokens[1:, None].to(logits.device))[:, 0]
        return cls(logits[-1:], nll)


def token_nll(logits: np.ndarray, token: int, rows: torch.Tensor | None = None) -> float:
    """-log p(token) from one row of logits [vocab], normalised over `rows` [R] (None: the whole vocabulary)."""
    row = torch.from_numpy(logits).float()
    return float(torch.logsumexp(row if rows is None else row[rows], dim=-1) - row[token])


class DecoderLayer(nn.Module):
    """Weights of one block; Q, K, V fused into one matmul and gate/up into another (fewer CPU calls).

    q_norm/k_norm [head_dim] and post_attn_norm/post_ffn_norm [n_embd] are Gemma 3's (None otherwise).
    """

    def __init__(self, wqkv: torch.Tensor, bqkv: torch.Tensor | None, wo: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 post_attn_norm: torch.Tensor | None = None, post_ffn_norm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("wqkv", wqkv)  # [(H + 2 KV) * D, n_embd]
        self.register_buffer("bqkv", bqkv)  # [(H + 2 KV) * D] or None
        self.register_buffer("wo", wo)  # [n_embd, H * D]
        self.register_buffer("w_gate_up", w_gate_up)  # [2 n_ff, n_embd]
        self.register_buffer("w_down", w_down)  # [n_embd, n_ff]
        self.register_buffer("attn_norm", attn_norm)
        self.register_buffer("ffn_norm", ffn_norm)
        self.register_buffer("q_norm", q_norm)  # [D] or None
        self.register_buffer("k_norm", k_norm)  # [D] or None
        self.register_buffer("post_attn_norm", post_attn_norm)  # [n_embd] or None
        self.register_buffer("post_ffn_norm", post_ffn_norm)  # [n_embd] or None


class Transformer(nn.Module):
    """Decoder over one sequence. tokens [T] -> logits [T or 1, vocab]."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], out_norm: torch.Tensor,
                 lm_head: torch.Tensor | None) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("embed", embed)  # [vocab, n_embd]
        self.layers = nn.ModuleList(layers)
        self.register_buffer("out_norm", out_norm)
        self.register_buffer("lm_head", lm_head)  # None when tied to the embedding
        # Cache policies attend with the default 1/sqrt(head_dim) scale; a model with another scale gets
        # its queries pre-multiplied (what llama.cpp does for gemma3: ggml_scale on Qcur).
        scale = config.attention_scale
        self.q_scale = 1.0 if scale is None else scale * math.sqrt(config.head_dim)
        self.act = F.silu if config.mlp_activation == "silu" else _gelu_tanh

    @classmethod
    def from_gguf(cls, gguf_file: GGUFModelFile, device: torch.device | str = "cpu") -> "Transformer":
        cfg = gguf_file.config
        t = gguf_file.tensor
        H, KV, D, E, FF = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_embd, cfg.n_ff
        layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            wq, wk, wv = t(p + "attn_q.weight", (H * D, E)), t(p + "attn_k.weight", (KV * D, E)), t(p + "attn_v.weight", (KV * D, E))
            bqkv = None
            if gguf_file.has_tensor(p + "attn_q.bias"):
                bqkv = torch.cat([t(p + "attn_q.bias", (H * D,)), t(p + "attn_k.bias", (KV * D,)), t(p + "attn_v.bias", (KV * D,))])
            gemma: dict[str, torch.Tensor] = {}
            if cfg.qk_norm:
                gemma.update(q_norm=t(p + "attn_q_norm.weight", (D,)), k_norm=t(p + "attn_k_norm.weight", (D,)))
            if cfg.post_norms:
                gemma.update(post_attn_norm=t(p + "post_attention_norm.weight", (E,)),
                             post_ffn_norm=t(p + "post_ffw_norm.weight", (E,)))
            layers.append(DecoderLayer(
                wqkv=torch.cat([wq, wk, wv]), bqkv=bqkv, wo=t(p + "attn_output.weight", (E, H * D)),
                w_gate_up=torch.cat([t(p + "ffn_gate.weight", (FF, E)), t(p + "ffn_up.weight", (FF, E))]),
                w_down=t(p + "ffn_down.weight", (E, FF)),
                attn_norm=t(p + "attn_norm.weight", (E,)), ffn_norm=t(p + "ffn_norm.weight", (E,)), **gemma,
            ))
        embed = t("token_embd.weight", (cfg.vocab_size, E))
        lm_head = t("output.weight", (cfg.vocab_size, E)) if gguf_file.has_tensor("output.weight") else None
        model = cls(cfg, embed, layers, t("output_norm.weight", (E,)), lm_head)
        return model.to(device)

    def forward(self, tokens: torch.Tensor | None, cache: "CachePolicy",
                logits: Literal["last", "all", "none", "scores"] = "last",
                embeddings: torch.Tensor | None = None) -> torch.Tensor | ChunkScores | None:
        """Run `tokens` [T] (positions come from the cache's begin_chunk) through all layers.

        embeddings [T, n_embd]: input vectors in the embedding table's space, instead of `tokens`
        (Meta-Soft's soft tokens); the model's embedding scale applies to them as to looked-up rows.
        Returns logits [T, vocab] ("all"), [1, vocab] ("last"), None ("none") or, for "scores", the
        chunk's ChunkScores (`tokens` needed), whose logits rows exist only a block at a time.
        """
        cfg = self.config
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = F.embedding(tokens, self.embed) if embeddings is None else embeddings  # [T, E]
        T = x.shape[0]
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_eps)
            qkv = F.linear(h, layer.wqkv, layer.bqkv)  # [T, (H + 2KV) D]
            q = qkv[:, : H * D].view(T, H, D).transpose(0, 1)  # [H, T, D]
            k = qkv[:, H * D: (H + KV) * D].view(T, KV, D).transpose(0, 1)  # [KV, T, D]
            v = qkv[:, (H + KV) * D:].view(T, KV, D).transpose(0, 1)  # [KV, T, D]
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, cfg.rms_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_eps)
            if self.q_scale != 1.0:
                q = q * self.q_scale
            attn = cache.attend(i, q, k, v)  # [H, T, D]
            out = F.linear(attn.transpose(0, 1).reshape(T, H * D), layer.wo)  # [T, E]
            if layer.post_attn_norm is not None:
                out = rms_norm(out, layer.post_attn_norm, cfg.rms_eps)
            x = x + out
            x = x + self._mlp(layer, x)
        if logits == "none":
            return None
        if logits == "last":
            x = x[-1:]
        x = rms_norm(x, self.out_norm, cfg.rms_eps)
        if logits == "scores":
            return self._scores(x, tokens, cache.score_rows(tokens))
        return self._head(x)

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward block's output [T, E] for x [T, E], in blocks of rows: a long chunk's [T, 2 FF]
        activations were the largest allocation of a prefill (24 MiB at 1,024 tokens on SmolLM2)."""
        T = x.shape[0]
        rows = max(1, MLP_BLOCK_BYTES // (4 * 2 * layer.w_gate_up.shape[0]))
        if rows >= T:
            return self._mlp_rows(layer, x)
        out = torch.empty_like(x)
        for first in range(0, T, rows):
            out[first: first + rows] = self._mlp_rows(layer, x[first: first + rows])
        return out

    def _mlp_rows(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        h = rms_norm(x, layer.ffn_norm, cfg.rms_eps)
        gate, up = F.linear(h, layer.w_gate_up).chunk(2, dim=-1)  # [rows, FF] each
        out = F.linear(self.act(gate) * up, layer.w_down)  # [rows, E]
        if layer.post_ffn_norm is not None:
            out = rms_norm(out, layer.post_ffn_norm, cfg.rms_eps)
        return out

    @property
    def _output(self) -> torch.Tensor:
        """The output matrix [vocab, n_embd] (tied to the embeddings when the file has none of its own)."""
        return self.lm_head if self.lm_head is not None else self.embed

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, n_embd] -> logits [N, vocab]."""
        return self._softcap(F.linear(x, self._output))

    def _scores(self, x: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> ChunkScores:
        """x [T, n_embd] final-normed -> ChunkScores. Over the whole vocabulary one block of logits rows at a
        time; over a shortlist `rows` [R] (ids, the chunk's tokens among them) one block of its output rows at
        a time, so that only R rows of the output matrix are read."""
        T = x.shape[0]
        nll = torch.empty(max(T - 1, 0), dtype=torch.float32, device=x.device)
        if rows is None:
            step = max(1, SCORE_BLOCK_BYTES // (4 * self.config.vocab_size))
            for first in range(0, T - 1, step):
                block = self._head(x[first: min(first + step, T - 1)]).float()  # [b, vocab]
                target = tokens[first + 1: first + 1 + block.shape[0], None]
                nll[first: first + block.shape[0]] = torch.logsumexp(block, dim=-1) - block.gather(1, target)[:, 0]
        elif T > 1:
            xs, output = x[:-1], self._output
            step = max(64, SCORE_BLOCK_BYTES // (4 * (T - 1)))
            rows_dev = rows.to(x.device)
            lse = torch.cat([torch.logsumexp(self._softcap(xs @ output[rows_dev[a: a + step]].T).float(), dim=-1,
                                             keepdim=True) for a in range(0, rows_dev.shape[0], step)], dim=1)
            target = self._softcap((xs * output[tokens[1:]]).sum(-1)).float()  # [T - 1]
            nll = torch.logsumexp(lse, dim=1) - target
        return ChunkScores(self._head(x[-1:]), nll, rows=rows)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (ggml_gelu, Gemma's `gelu_pytorch_tanh`)."""
    return F.gelu(x, approximate="tanh")
