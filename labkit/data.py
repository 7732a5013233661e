"""Synthetic, learnable tasks generated in code (no downloads), deterministic by seed."""

from __future__ import annotations

import math

import torch

from labkit.models import IGNORE_INDEX
from labkit.validate import check_int


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(check_int("seed", seed, 0))


class MarkovTokens:
    """A random first-order Markov chain over `vocab_size` tokens, each with 4 random successors (fewer tokens: all)."""

    def __init__(self, vocab_size: int = 256, seed: int = 0):
        check_int("vocab_size", vocab_size, 2)
        branching = min(4, vocab_size)  # successors per token
        g = _generator(seed)
        self.vocab_size = vocab_size
        succ = torch.stack([torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)])  # (V, k)
        w = torch.rand(vocab_size, branching, generator=g) + 0.1  # (V, k)
        self.transition = torch.zeros(vocab_size, vocab_size).scatter_(1, succ, w / w.sum(1, keepdim=True))  # (V, V)
        self._cdf = self.transition.cumsum(1)  # (V, V)
        self._g = _generator(seed + 1)

    @property
    def entropy_nats(self) -> float:
        """Return the entropy rate in nats/token under the chain's stationary distribution."""
        P = self.transition.double()
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(500):  # power iteration
            pi = pi @ P
        h = -(P * torch.where(P > 0, P.log(), torch.zeros_like(P))).sum(1)  # (V,)
        return float((pi * h).sum())

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw `batch_size` sequences of `seq_len + 1` tokens: (B, T+1) int64."""
        g = generator or self._g
        out = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        out[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        u = torch.rand(seq_len, batch_size, 1, generator=g)  # (T, B, 1) uniforms, one per step
        for t in range(seq_len):  # inverse-CDF sampling of each row's successor
            nxt = torch.searchsorted(self._cdf[out[:, t]], u[t])  # (B, 1)
            out[:, t + 1] = nxt.squeeze(1).clamp_(max=self.vocab_size - 1)
        return out

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator | None = None):
        """Return inputs and next-token targets, each (B, T) int64."""
        seq = self.sample(batch_size, seq_len, generator)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def padded_batch(self, batch_size: int, seq_len: int, min_len: int = 1,
                     generator: torch.Generator | None = None):
        """Return inputs, targets (IGNORE_INDEX past each row's length) and lengths: rows of 1..T real tokens."""
        check_int("min_len", min_len, 1, seq_len)
        g = generator or self._g
        x, y = self.batch(batch_size, seq_len, g)
        lengths = torch.randint(min_len, seq_len + 1, (batch_size,), generator=g)  # (B,)
        pad = torch.arange(seq_len)[None, :] >= lengths[:, None]  # (B, T)
        return x.masked_fill(pad, 0), y.masked_fill(pad, IGNORE_INDEX), lengths


class TeacherTask:
    """Classification labels from a fixed random 'teacher' MLP: learnable by a student MLP."""

    def __init__(self, in_features: int = 32, classes: int = 10, seed: int = 0):
        g = _generator(seed)
        self.in_features, self.classes = in_features, classes
        self.w1 = torch.randn(in_features, 64, generator=g) / math.sqrt(in_features)
        self.w2 = torch.randn(64, classes, generator=g) / 8.0
        self._g = _generator(seed + 1)

    def batch(self, batch_size: int, generator: torch.Generator | None = None):
        """Return inputs (B, in_features) float32 and labels (B,) int64."""
        g = generator or self._g
        x = torch.randn(batch_size, self.in_features, generator=g)
        y = (torch.tanh(x @ self.w1) @ self.w2).argmax(1)
        return x, y
