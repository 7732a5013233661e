"""A model's stages (chapters 05 and 06b): embedding, blocks and head as modules sharing the model's parameters."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from labkit.models import GPT, MLP, Block, token_loss

ACTION_KINDS = ("F", "B", "W")  # a stage's timed actions (labkit.dist.time_actions): forward, backward (input and
#                                weights), weight-only backward (zero bubble)
LOSS_KIND = "L"  # the last stage's loss of one micro-batch: part of that micro-batch's forward


class EmbedStage(nn.Module):
    """Token (and position) embedding of a GPT: (B, T) int64 -> (B, T, C). Shares the GPT's parameters."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop, self.cfg = gpt.tok_emb, gpt.pos_emb, gpt.drop, gpt.cfg

    def forward(self, idx):  # (B, T)
        return GPT.embed(self, idx)  # the GPT's own embedding, on the parameters this stage shares


class GPTHeadStage(nn.Module):
    """Final norm, output head (tied to the token embedding when the GPT ties them), and the loss given targets."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.norm, self.head = gpt.norm, gpt.head

    def forward(self, x, targets=None):  # x: (B, T, C), targets: (B, T)
        logits = self.head(self.norm(x))  # (B, T, V)
        return logits if targets is None else token_loss(logits, targets)  # () with targets


class MLPHeadStage(nn.Module):
    """Classifier head of an MLP and its loss."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.head = mlp.head

    def forward(self, x, targets):  # x: (B, hidden), targets: (B,)
        return F.cross_entropy(self.head(x), targets)


def split_stages(model: nn.Module) -> list[nn.Module]:
    """Return the model's stages in order (GPT: embedding, blocks, head; MLP: layers, head), sharing its parameters.

    The last stage takes (x, targets) and returns the loss; a tied weight appears in two stages.
    """
    if isinstance(model, GPT):
        return [EmbedStage(model), *model.blocks, GPTHeadStage(model)]
    if isinstance(model, MLP):
        return [*model.layers, MLPHeadStage(model)]
    raise TypeError(f"split_stages supports labkit GPT and MLP models, got {type(model).__name__}")


def stage_name(i: int, stage: nn.Module) -> str:
    """Name stage i for reports: "embedding", "block i", "layer i" or "head"."""
    if isinstance(stage, EmbedStage):
        return "embedding"
    if isinstance(stage, (GPTHeadStage, MLPHeadStage)):
        return "head"
    return f"block {i}" if isinstance(stage, Block) else f"layer {i}"
