"""A tiny causal language model on generated text, trained with elastic microbatches.

What it shows:

- dict samples with ``input_ids`` / ``attention_mask`` / ``labels`` of varying length and the raw
  string next to them;
- ``pad_values``: each batch is padded in the loader's worker, sorted longest first, and each
  microbatch is cut to its own longest sample;
- ``count_fn``: the loss is a mean over non-ignored tokens, and the accumulated gradient is the
  gradient of that mean over the whole batch (checked against one full-batch step);
- a simulated device (``MemoryBudget``) too small for a whole batch: the step measures each
  microbatch under it (``memory="auto"`` finds the active budget, as it finds a GPU's probe),
  the tokens controller predicts the split from what it measured (at most one OOM to settle)
  and gives batches of longer text more microbatches.

Run it: ``python examples/causal_lm.py`` (``--quick`` for a few seconds' run).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget

ALPHABET = " abcdefghijklmnopqrstuvwxyz.,"
BOS, VOCAB = 1, len(ALPHABET) + 2  # 0 pads, 1 starts a text, characters from 2
PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "labels": -100}
WORDS = "the a cat dog sees runs under over small big red tree house river near far quickly slowly".split()


def generate_text(rng: random.Random) -> str:
    """A sentence of a log-normal number of words (a long tail of long texts)."""
    words = max(1, int(rng.lognormvariate(math.log(6), 0.6)))
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


class TextDataset(torch.utils.data.Dataset):
    """Generated sentences as dict samples: token ids, attention mask, next-token labels, the text."""

    def __init__(self, size: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.texts = [generate_text(rng) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        text = self.texts[index]
        ids = torch.tensor([BOS] + [ALPHABET.index(c) + 2 for c in text])
        labels = torch.cat([ids[1:], torch.tensor([-100])])  # predict the next character
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, "text": text}


class TinyCausalLM(nn.Module):
    """Token and position embeddings, one causal self-attention block, a head."""

    def __init__(self, dim: int = 64, heads: int = 4, max_length: int = 512) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(max_length, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows, length = input_ids.shape
        x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        q, k, v = self.qkv(self.norm1(x)).view(rows, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        mask = causal & attention_mask[:, None, None, :].bool()  # a query never sees padding or the future
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(rows, length, -1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def make_loss_fn(model: nn.Module):
    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        logits = model(mb["input_ids"], mb["attention_mask"])
        return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100)  # token mean

    return loss_fn


def count_fn(mb: dict[str, Any]) -> torch.Tensor:
    return (mb["labels"] != -100).sum()  # the tokens the loss above is a mean over


def gradient_error(model: nn.Module, batch: eb.ElasticBatch, split_count: int = 3) -> float:
    """Relative difference between the accumulated gradient and one full-batch token-mean step (float64)."""
    elastic, reference = copy.deepcopy(model).double(), copy.deepcopy(model).double()
    step = eb.ElasticStep(elastic, controller=eb.SplitController(split_count=split_count))
    step.backward(batch, make_loss_fn(elastic), count_fn=count_fn)
    make_loss_fn(reference)(batch.unwrap()).backward()
    got = torch.cat([p.grad.flatten() for p in elastic.parameters()])
    want = torch.cat([p.grad.flatten() for p in reference.parameters()])
    return float((got - want).norm() / want.norm())


def measure_step_bytes(model: nn.Module, batch: eb.ElasticBatch) -> int:
    """Peak bytes of one whole-batch forward and backward, on the simulated device."""
    probe = copy.deepcopy(model)
    with MemoryBudget() as budget:
        make_loss_fn(probe)(batch.unwrap()).backward()
    return budget.peak_bytes


def main(quick: bool = False, steps: int | None = None, memory_fraction: float = 0.3) -> dict:
    """Train, print one line per step, and return a summary (what the tests check)."""
    torch.manual_seed(0)
    steps = steps if steps is not None else (8 if quick else 200)
    batch_size = 16 if quick else 32
    dataset = TextDataset(size=steps * batch_size)
    controller = eb.SplitController(unit="tokens")  # learn the microbatch size in padded positions
    loader = eb.MicrobatchingDataLoader(
        dataset, batch_size=batch_size, shuffle=True, pad_values=PAD_VALUES, controller=controller
    )
    model = TinyCausalLM(dim=32 if quick else 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = eb.ElasticStep(model, controller=controller)
    loss_fn = make_loss_fn(model)

    first = next(iter(loader))
    error = gradient_error(model, first)
    budget = MemoryBudget(limit_bytes=int(memory_fraction * measure_step_bytes(model, first)))
    print(f"gradient vs one full-batch step: relative difference {error:.1e}")
    print(f"simulated device: {budget.limit_bytes / 2**20:.2f} MiB, {memory_fraction:.0%} of a whole batch")

    losses, counts = [], []
    for index, batch in enumerate(loader):
        if index == steps:
            break
        with budget:
            loss = step.backward(batch, loss_fn, count_fn=count_fn)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        longest = max(batch.padding.row_lengths())
        losses.append(float(loss))
        counts.append(controller.split_count)
        print(
            f"step {index:3d}  loss {loss:.3f}  longest text {longest:3d}  microbatches {controller.split_count}  "
            f"ooms so far {controller.oom_count}"
        )
    summary = {
        "first_loss": losses[0],
        "final_loss": sum(losses[-3:]) / len(losses[-3:]),
        "ooms": controller.oom_count,
        "max_split_count": max(counts),
        "gradient_error": error,
    }
    print(summary)
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of a smaller model")
    parser.add_argument("--steps", type=int, default=None)
    main(**vars(parser.parse_args()))
