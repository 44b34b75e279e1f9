"""The demo's data: the shipped text, a character tokenizer, a batch sampler."""

from __future__ import annotations

from importlib import resources

import torch


def load_text() -> str:
    """The plain English text shipped in the package (``demo/data.txt``)."""
    return resources.files(__package__).joinpath("data.txt").read_text(encoding="utf-8")


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of characters."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


class BatchSampler:
    """Random windows of ``tokens``; rank r takes rows ``[r*B, (r+1)*B)`` of each
    step's global batch of ``world_size*B`` windows.

    The global batch of a step depends only on ``(seed, step)``, so every rank
    draws the same one and the ranks' slices never overlap; the run is
    reproducible and does not depend on how many steps came before.
    """

    def __init__(self, tokens: torch.Tensor, *, global_batch: int, seq_len: int,
                 rank: int, world_size: int, seed: int) -> None:
        if global_batch % world_size:
            raise ValueError(
                f"global batch {global_batch} is not divisible by world size {world_size}")
        if tokens.numel() <= seq_len:
            raise ValueError(f"text of {tokens.numel()} tokens is too short for seq_len {seq_len}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.rank = rank

    def global_starts(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = self.tokens.numel() - self.seq_len  # a window needs seq_len + 1 tokens
        return torch.randint(0, high, (self.global_batch,), generator=g)  # (B_global,)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for this rank at ``step``, each (B_local, seq_len)."""
        lo = self.rank * self.local_batch
        starts = self.global_starts(step)[lo:lo + self.local_batch]  # (b,)
        offsets = torch.arange(self.seq_len + 1)  # (s+1,)
        windows = self.tokens[starts[:, None] + offsets]  # (b, s+1)
        return windows[:, :-1], windows[:, 1:]  # (b, s), (b, s)
