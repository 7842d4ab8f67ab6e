"""Real text for the sparsification example: load, split into sentences, hold out, tokenize, batch.

The default corpus ships with Python itself: the help topics of ``pydoc_data.topics`` (the
language reference pages that ``help("if")`` prints, about 465,000 characters), so nothing is
downloaded. Any UTF-8 text file works instead (``--text``). Paragraphs are blocks separated by
blank lines; indented blocks (code, grammar rules) and heading underlines are dropped, the rest is
split into sentences. The held-out sentences come from paragraphs the training never sees.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_RULE = re.compile(r"^[*=\-~^#]{3,}$")


def default_corpus() -> str:
    """The text of every ``pydoc_data.topics`` help page, pages separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def read_corpus(path: Path | None) -> str:
    """The text of ``path`` (UTF-8), or :func:`default_corpus` when ``path`` is None."""
    if path is None:
        return default_corpus()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"text must be a readable text file, got {path} (not a file)")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {path} holds no text")
    return text


def paragraphs(text: str) -> list[str]:
    """Prose paragraphs of ``text``: blank-line separated blocks, lines joined, code and headings dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip() and not _RULE.match(line.strip())]
        if not lines or lines[0].startswith((" ", "\t")):
            continue
        para = " ".join(line.strip() for line in lines)
        if para:
            out.append(para)
    return out


def sentences(paragraph: str, min_words: int = 5, max_words: int = 80) -> list[str]:
    """Sentences of one paragraph with ``min_words`` to ``max_words`` words."""
    found = (s.strip() for s in _SENTENCE_END.split(paragraph))
    return [s for s in found if min_words <= len(s.split()) <= max_words]


@dataclass
class Corpus:
    """Training paragraphs and held-out sentences (from other paragraphs)."""

    train: list[str]
    held_out: list[str]


def split_corpus(text: str, n_held_out: int, seed: int) -> Corpus:
    """Shuffle the paragraphs of ``text`` with ``seed``; held-out sentences come from the first ones.

    Args:
        text: the corpus.
        n_held_out: number of held-out sentences (at least 2, for retrieval).
        seed: shuffling seed.

    Returns:
        :class:`Corpus`; at least half of the paragraphs stay for training.
    """
    paras = paragraphs(text)
    random.Random(seed).shuffle(paras)
    held, used = [], 0
    while used < len(paras) and len(held) < n_held_out and used < len(paras) // 2:
        held.extend(sentences(paras[used]))
        used += 1
    held = held[:n_held_out]
    if len(held) < 2 or used >= len(paras):
        raise ValueError(f"the text is too short: {len(paras)} prose paragraphs gave {len(held)} held-out sentences "
                         f"(need at least 2, and paragraphs left for training)")
    return Corpus(train=paras[used:], held_out=held)


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text ([CLS] / [SEP] for BERT, BOS for Llama)."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return list(full[:i]), list(full[i + len(bare):])
    return [], []


def _room(tokenizer, seq_len: int) -> tuple[int, list[int], list[int]]:
    head, tail = special_tokens(tokenizer)
    room = seq_len - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"seq_len must leave room for a token next to the {len(head) + len(tail)} special tokens, "
                         f"got {seq_len}")
    return room, head, tail


def sentence_ids(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """Token ids of each text with special tokens, truncated to ``seq_len`` tokens in all."""
    room, head, tail = _room(tokenizer, seq_len)
    return [head + tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"][:room] + tail for t in texts]


def window_ids(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """The texts tokenized as one stream, cut into windows of ``seq_len`` tokens (special tokens included).

    Every window has exactly ``seq_len`` tokens except possibly the last (no padding is needed).
    """
    room, head, tail = _room(tokenizer, seq_len)
    stream = []
    for t in texts:
        stream.extend(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"])
    return [head + stream[i:i + room] + tail for i in range(0, len(stream), room)]


def equal_length_batches(seqs: list[list[int]], batch_size: int) -> list[tuple[list[int], torch.Tensor]]:
    """Batches of sequences of one length each (no padding, so no padded query rows in the statistics).

    Returns:
        ``[(indices into seqs, int64 ids (b, n)), ...]`` in order of length.
    """
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(i)
    out = []
    for n in sorted(by_len):
        idx = by_len[n]
        for j in range(0, len(idx), batch_size):
            part = idx[j:j + batch_size]
            out.append((part, torch.tensor([seqs[i] for i in part], dtype=torch.long)))
    return out
