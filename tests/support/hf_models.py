"""Tiny Hugging Face clients built without any download: a word-level tokenizer, GPT-2 and BERT from configs.

For the tests, the docs and the benchmark of ``elastic_batches.transformers``: variable-length
texts tokenized by a real ``PreTrainedTokenizerFast``, HF's own collators, and real model
classes at a size that trains in a fraction of a second on a CPU. Needs ``transformers`` and
``tokenizers`` (``pip install "elastic-batches[transformers]"``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CLIENTS", "client", "make_tokenizer", "texts", "tiny_bert", "tiny_gpt2"]

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
CLIENTS = ("gpt2", "bert-mlm", "bert-classify")  # causal LM, masked LM, sequence classification


def make_tokenizer(padding_side: str = "right") -> Any:
    """A word-level fast tokenizer (``[CLS] words [SEP]``) over the words ``w0`` .. ``w39``.

    Args:
        padding_side: Where HF's collators pad: ``"right"`` (default) or ``"left"``.

    Example:
        >>> tokenizer = make_tokenizer()
        >>> tokenizer("w0 w1")["input_ids"]
        [2, 5, 6, 3]
    """
    import tokenizers
    import transformers

    vocab = {**SPECIAL, **{word: i + len(SPECIAL) for i, word in enumerate(WORDS)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    model.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        padding_side=padding_side,
    )


def texts(tokenizer: Any, rows: int, *, labels: bool, seed: int = 0, longest: int = 24) -> list[dict[str, Any]]:
    """Tokenized random texts of 1 to ``longest`` words; with ``labels``, a class label (0-2) each.

    Example:
        >>> samples = texts(make_tokenizer(), 3, labels=True)
        >>> sorted(samples[0]), [s["label"] for s in samples]
        (['attention_mask', 'input_ids', 'label'], [0, 1, 2])
    """
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        length = int(torch.randint(1, longest + 1, (), generator=generator))
        words = torch.randint(len(WORDS), (length,), generator=generator).tolist()
        encoded = dict(tokenizer(" ".join(WORDS[w] for w in words)))
        samples.append({**encoded, "label": i % 3} if labels else encoded)
    return samples


def tiny_gpt2(seed: int = 0, width: int = 32) -> nn.Module:
    """A 2-layer ``GPT2LMHeadModel`` without dropout, its weights drawn from ``seed``.

    Example:
        >>> sum(p.numel() for p in tiny_gpt2().parameters()) > 0
        True
    """
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=len(SPECIAL) + len(WORDS),
        n_positions=64,
        n_embd=width,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_bert(kind: str, seed: int = 0, width: int = 32) -> nn.Module:
    """A 2-layer BERT without dropout: ``"mlm"`` (``BertForMaskedLM``) or ``"classify"`` (3 classes).

    Example:
        >>> type(tiny_bert("classify")).__name__
        'BertForSequenceClassification'
    """
    import transformers

    if kind not in ("mlm", "classify"):
        raise ValueError(f"tiny_bert: kind must be 'mlm' or 'classify', got {kind!r}")
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * width,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=0,
    )  # type: ignore[call-arg]  # num_labels is one of PretrainedConfig's keyword arguments
    cls = transformers.BertForSequenceClassification if kind == "classify" else transformers.BertForMaskedLM
    return cls(config)


def client(name: str, rows: int, seed: int = 0) -> tuple[nn.Module, Any, list[dict[str, Any]]]:
    """One of :data:`CLIENTS`: a fresh model (weights from ``seed``), HF's collator for it, and ``rows`` samples.

    ``"gpt2"``: ``DataCollatorForLanguageModeling(mlm=False)``; ``"bert-mlm"``: with ``mlm=True``
    (dynamic masking, 30%); ``"bert-classify"``: ``DataCollatorWithPadding``.

    Example:
        >>> model, collator, samples = client("bert-classify", rows=4)
        >>> tuple(collator(samples)["input_ids"].shape)[0]
        4
    """
    import transformers

    tokenizer = make_tokenizer()
    collator: Any
    if name == "gpt2":
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        return tiny_gpt2(seed), collator, texts(tokenizer, rows, labels=False, seed=seed)
    if name == "bert-mlm":
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3)
        return tiny_bert("mlm", seed), collator, texts(tokenizer, rows, labels=False, seed=seed)
    if name == "bert-classify":
        collator = transformers.DataCollatorWithPadding(tokenizer)
        return tiny_bert("classify", seed), collator, texts(tokenizer, rows, labels=True, seed=seed)
    raise ValueError(f"client: name must be one of {list(CLIENTS)}, got {name!r}")
