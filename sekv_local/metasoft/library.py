"""The meta-library and selector: the only trained parameters of Meta-Soft (the model stays frozen).

* library [m, n_embd]: m basis vectors in the model's input-embedding space, kept near-orthogonal by a
  regularizer during training (`orthogonality()` measures it: mean squared off-diagonal cosine).
* static_logits [k, m]: a prompt-independent combination (stage 1 of training; the `static` ablation).
* selector: global features of the prompt -> logits [k, m] added to the static ones (zero-initialised,
  so stage 2 starts from stage 1's tokens). Features = the mean pre-RoPE query of every head in the
  first `feature_layers` layers over the document's tokens ([feature_layers * n_heads * head_dim]; a
  linear read-out of those layers' normalised hidden states, which the cache sees anyway).
* weights: Gumbel-softmax over the library per soft token; hard (one-hot, straight-through) when
  asked, always hard at inference, so a soft token is one library vector.

Untrained defaults: library = embedding rows of fixed question words, soft token i = library row i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SekvError

#: words whose embeddings start the untrained library (question- and fact-like words)
SEED_WORDS = (
    "What", " is", " the", " number", " code", " answer", " value", " name", " key", " special", " magic",
    "?", ":", " of", " for", " which", " who", " when", " where", " how", " many", " does", " fact", " said",
    " called", " equals", " first", " last", " important", " remember", " find", " question", " variable",
    " assigned", " digits", " text", " document", " mentioned", " about", " story", " person", " place",
    " date", " year", " result", " total", " one", " two", " three", " new", " access", " secret",
    " password", " ID", " list", " item", " section", " chapter", " title", " main", " point", " reason",
    " because", " therefore",
)


class SoftTokenLibrary(nn.Module):
    """library [m, E], static_logits [k, m], selector features [F*H*D] -> hidden -> [k*m]."""

    def __init__(self, n_embd: int, feature_dim: int, n_library: int = 64, n_soft: int = 16,
                 hidden: int = 64) -> None:
        super().__init__()
        if not 1 <= n_soft <= n_library:
            raise SekvError(f"metasoft: need 1 <= soft tokens ({n_soft}) <= library size ({n_library})")
        self.n_library, self.n_soft, self.feature_dim, self.hidden = n_library, n_soft, feature_dim, hidden
        self.library = nn.Parameter(torch.zeros(n_library, n_embd))
        self.static_logits = nn.Parameter(torch.zeros(n_soft, n_library))
        self.selector_in = nn.Linear(feature_dim, hidden)
        self.selector_out = nn.Linear(hidden, n_soft * n_library)
        nn.init.zeros_(self.selector_out.weight)
        nn.init.zeros_(self.selector_out.bias)

    @classmethod
    def untrained(cls, embed: torch.Tensor, seed_ids: list[int], feature_dim: int, n_soft: int = 16,
                  hidden: int = 64) -> "SoftTokenLibrary":
        """Library rows = embed[seed_ids] (embed [vocab, E]); soft token i = row i (a strong diagonal)."""
        lib = cls(embed.shape[1], feature_dim, len(seed_ids), n_soft, hidden)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            lib.library.copy_(embed[torch.tensor(seed_ids)].float())
            lib.static_logits.fill_(-4.0)
            lib.static_logits[torch.arange(n_soft), torch.arange(n_soft)] = 4.0
            nn.init.normal_(lib.selector_in.weight, std=feature_dim ** -0.5, generator=generator)
            nn.init.zeros_(lib.selector_in.bias)
        return lib

    def logits(self, features: torch.Tensor | None, static: bool = False) -> torch.Tensor:
        """Combination logits [k, m]; features [feature_dim] (ignored when static)."""
        if static or features is None:
            return self.static_logits
        h = F.gelu(self.selector_in(F.layer_norm(features.float(), (self.feature_dim,))))
        return self.static_logits + self.selector_out(h).view(self.n_soft, self.n_library)

    def weights(self, features: torch.Tensor | None, static: bool = False, hard: bool = True,
                tau: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sparse combination weights [k, m] (rows sum to 1). With a generator: Gumbel noise (training);
        hard: one-hot forward, soft gradient (straight-through)."""
        logits = self.logits(features, static)
        if generator is not None:
            u = torch.rand(logits.shape, generator=generator).clamp_(1e-9, 1 - 1e-9)
            logits = logits - torch.log(-torch.log(u))
        soft = torch.softmax(logits / tau, dim=-1)
        if not hard:
            return soft
        one_hot = F.one_hot(soft.argmax(-1), self.n_library).to(soft.dtype)
        return one_hot + soft - soft.detach()

    def soft_tokens(self, features: torch.Tensor | None, static: bool = False, **kw) -> torch.Tensor:
        """The k soft-token embeddings [k, E]."""
        return self.weights(features, static, **kw) @ self.library

    def orthogonality(self) -> torch.Tensor:
        """Mean squared off-diagonal cosine of the library rows (0 = orthogonal)."""
        unit = F.normalize(self.library, dim=-1)
        gram = unit @ unit.T
        off = gram - torch.eye(self.n_library, device=gram.device)
        return (off ** 2).sum() / (self.n_library * (self.n_library - 1))

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
