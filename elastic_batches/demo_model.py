"""The demo's model and data, which the benchmarks train too: a tiny causal LM and its language.

:class:`TinyLM` is a pre-norm causal transformer; :class:`MarkovLanguage` draws sequences from a
random Markov chain over a few dozen tokens, a language a small model learns in a few hundred
steps (its :meth:`~MarkovLanguage.entropy` is the best loss possible); :func:`lm_loss` is the
next-token cross-entropy, a mean over the batch's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

__all__ = ["MarkovLanguage", "TinyLM", "lm_loss"]


class MarkovLanguage(Dataset[dict[str, torch.Tensor]]):
    """Sequences drawn from a random Markov chain: each token has a few likely successors.

    Args:
        samples: Sequences in the dataset.
        seq_len: Tokens the model reads per sequence (each sample holds ``seq_len + 1``: the
            last is only a target).
        vocab_size: Tokens of the language.
        seed: Seed of the chain and of the sequences.

    Example:
        >>> from elastic_batches.demo_model import MarkovLanguage
        >>> language = MarkovLanguage(samples=4, seq_len=8, vocab_size=16, seed=0)
        >>> len(language), tuple(language[0]["tokens"].shape), 0 < language.entropy() < 3
        (4, (9,), True)
    """

    def __init__(self, samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab_size, vocab_size, generator=g) * 3.0
        self.transitions = logits.softmax(dim=-1)
        tokens = torch.empty(samples, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (samples,), generator=g)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(self.transitions[tokens[:, t]], 1, generator=g).squeeze(1)
        self.tokens = tokens

    def entropy(self) -> float:
        """Mean next-token entropy under the chain's stationary distribution (nats): the best loss possible."""
        p = self.transitions.double()
        stationary = torch.full((p.shape[0],), 1.0 / p.shape[0], dtype=torch.float64)
        for _ in range(200):
            stationary = stationary @ p
        per_token = -(p * p.clamp_min(1e-30).log()).sum(dim=-1)
        return float(stationary @ per_token)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[index]}


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A pre-norm causal transformer language model.

    Args:
        vocab_size: Tokens of the vocabulary.
        dim: Embedding width.
        heads: Attention heads (``dim`` must be a multiple of it).
        layers: Transformer blocks.
        seq_len: The longest sequence (learned positions).

    Example:
        >>> import torch
        >>> from elastic_batches.demo_model import TinyLM
        >>> model = TinyLM(vocab_size=16, dim=8, heads=2, layers=1, seq_len=8)
        >>> tuple(model(torch.zeros(3, 8, dtype=torch.long)).shape)
        (3, 8, 16)
    """

    def __init__(self, vocab_size: int = 64, dim: int = 64, heads: int = 4, layers: int = 2, seq_len: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on ``batch["tokens"]``: a mean over every predicted token.

    Example:
        >>> import torch
        >>> from elastic_batches.demo_model import TinyLM, lm_loss
        >>> model = TinyLM(vocab_size=16, dim=8, heads=2, layers=1, seq_len=8)
        >>> lm_loss(model, {"tokens": torch.randint(16, (2, 9))}).dim()
        0
    """
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
