"""Small models for the workbook: a GPT-style decoder (nanoGPT-like, llama options) and an MLP.

The whole decoder is in this file. Shapes in comments: B batch, T sequence, C width, H heads,
H_kv key/value heads (H unless grouped-query), D = C // H head width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from labkit.validate import ParameterError, check_choice, check_divides, check_int

ATTENTION = ("manual", "sdpa", "flash", "efficient")  # GPTConfig.attn's choices: written out; torch's SDPA on the
#   device (on a CPU its flash kernel, which saves what CUDA's flash saves but its random state); CUDA's flash and
#   memory-efficient kernels (a plan's fake step saves what each saves on a GPU; a real step needs CUDA)
IGNORE_INDEX = -100  # a target the loss skips (padding); data.py pads targets with it


@dataclass
class GPTConfig:
    """Shape of a GPT-style decoder. Defaults: a few hundred CPU steps learn a synthetic task."""

    n_layer: int = 4  # transformer blocks
    n_embd: int = 128  # width C
    n_head: int = 4  # attention heads H; must divide n_embd
    n_kv_head: int | None = None  # key/value heads H_kv dividing n_head (grouped-query attention); None: n_head
    block_size: int = 64  # longest sequence T the position table covers
    vocab_size: int = 256  # tokens V
    dropout: float = 0.0  # dropout probability in attention and MLP
    bias: bool = True  # biases in Linear and LayerNorm (llama: False)
    mlp: str = "gelu"  # "gelu" (GPT-2) or "swiglu" (llama)
    mlp_hidden: int | None = None  # MLP hidden width; None: 4*C for gelu, the llama rule for swiglu
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm)
    pos: str = "learned"  # "learned" position table or "rope" rotary embeddings
    attn: str = "manual"  # one of ATTENTION: "manual" (softmax(QK^T)V, T×T scores kept), "sdpa" (the fused kernel
    #                       torch picks on the device), "flash" or "efficient" (CUDA's kernels: planned on fake tensors)
    fused_qkv: bool = True  # one Linear for q, k and v (GPT-2) or three (llama; tensor parallelism splits them by head)
    tie_weights: bool = True  # share token embedding and output head (GPT-2: True, llama: False)
    logits_fp32: bool = False  # upcast the logits to fp32 before the loss, as torchtitan's Llama does (a 16-bit step
    #                            then holds an fp32 copy of the (B, T, V) logits and of their gradient)

    def __post_init__(self):
        for name in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size"):
            check_int(f"GPTConfig.{name}", getattr(self, name), 1)
        check_divides("GPTConfig.n_embd", self.n_embd, "n_head", self.n_head)
        if self.n_kv_head is not None and check_int("GPTConfig.n_kv_head", self.n_kv_head, 1):
            check_divides("GPTConfig.n_head", self.n_head, "n_kv_head", self.n_kv_head)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        for name, allowed in (("mlp", ("gelu", "swiglu")), ("norm", ("layer", "rms")),
                              ("pos", ("learned", "rope")), ("attn", ATTENTION)):
            check_choice(f"GPTConfig.{name}", getattr(self, name), allowed)
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError("GPTConfig: rope needs an even head width n_embd // n_head")

    @property
    def kv_width(self) -> int:
        """Return the width of the keys (and of the values): H_kv heads of width C // H."""
        return self.n_embd // self.n_head * (self.n_head if self.n_kv_head is None else self.n_kv_head)

    @property
    def hidden(self) -> int:
        """Return the MLP hidden width."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        h = int(2 * 4 * self.n_embd / 3)  # llama: 2/3 of 4C, rounded up to a multiple of 256
        return 256 * ((h + 255) // 256)

    def n_params(self) -> int:
        """Return the parameter count, computed from the shapes (no model built)."""
        C, V, L = self.n_embd, self.vocab_size, self.n_layer
        norm = 2 * C if (self.norm == "layer" and self.bias) else C
        W = self.kv_width
        attn = 2 * C * C + 2 * C * W + ((2 * C + 2 * W) if self.bias else 0)  # q and the projection; k and v
        if self.mlp == "gelu":
            mlp = 2 * C * self.hidden + ((self.hidden + C) if self.bias else 0)
        else:
            mlp = 3 * C * self.hidden + ((2 * self.hidden + C) if self.bias else 0)
        total = L * (attn + mlp + 2 * norm) + norm + V * C
        if self.pos == "learned":
            total += self.block_size * C
        if not self.tie_weights:
            total += V * C  # the output head (no bias, as in GPT-2 and llama)
        return total


GPT2_124M = GPTConfig(n_layer=12, n_embd=768, n_head=12, block_size=1024, vocab_size=50257)
GPT2_1_5B = GPTConfig(n_layer=48, n_embd=1600, n_head=25, block_size=1024, vocab_size=50257)
LLAMA_7B = GPTConfig(n_layer=32, n_embd=4096, n_head=32, block_size=4096, vocab_size=32000, bias=False,
                     mlp="swiglu", mlp_hidden=11008, norm="rms", pos="rope", attn="sdpa", tie_weights=False)


class RMSNorm(nn.Module):
    """Scale by the reciprocal root-mean-square (llama's norm)."""

    eps = 1e-6

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., C)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.n_embd, bias=cfg.bias) if cfg.norm == "layer" else RMSNorm(cfg.n_embd)


def _rope_table(T: int, D: int, device, dtype):  # -> cos, sin: (T, D/2) each
    """Return the rotary embedding's cosines and sines of T positions for heads of width D."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))  # (D/2,)
    ang = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv  # (T, D/2)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rope(x, cos, sin):  # x: (B, H, T, D); cos, sin: (T, D/2)
    """Rotate each pair of x's channels by its position's angle (RoPE)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, H, T, D/2) each
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _cuda_attention(kernel: str, q, k, v, dropout_p: float):
    """Return causal attention by CUDA's flash or memory-efficient SDPA kernel called as SDPA calls it: autograd saves
    what its backward takes (derivatives.yaml) at its meta function's shapes, on fake tensors as on a GPU. "flash" on
    fp32 inputs runs the memory-efficient kernel, as SDPA picks on CUDA (flash takes fp16 and bf16 only)."""
    try:
        if kernel == "flash" and q.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True)[0]
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, True)[0]
    except NotImplementedError:
        raise ParameterError(f"GPTConfig.attn={kernel!r} runs CUDA's {kernel} attention kernel: a real step needs a "
                             f"CUDA device, not {q.device.type} (a plan runs it on fake tensors; "
                             "attn='sdpa' runs the device's own)") from None


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, grouped-query where cfg.n_kv_head < n_head (torchtitan's Llama 3)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        C, W = cfg.n_embd, cfg.kv_width  # W: the keys' (and values') width
        if cfg.fused_qkv:
            self.qkv = nn.Linear(C, C + 2 * W, bias=cfg.bias)
        else:
            self.q, self.k, self.v = (nn.Linear(C, width, bias=cfg.bias) for width in (C, W, W))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, C)
        B, T, _ = x.shape
        D = self.cfg.n_embd // self.cfg.n_head  # head width
        if self.cfg.fused_qkv:
            C, W = self.cfg.n_embd, self.cfg.kv_width  # q: (B, T, C); k, v: (B, T, W), W = C unless grouped-query
            q, k, v = self.qkv(x).chunk(3, dim=-1) if W == C else self.qkv(x).split((C, W, W), dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)  # 3 × (B, T, C), or (B, T, C/K) on K tensor-parallel ranks
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D); k, v: (B, H_kv, T, D)
        H, H_kv = q.size(1), k.size(1)  # heads here (n_head, or n_head/K under tensor parallelism); key/value heads
        if self.cfg.pos == "rope":
            cos, sin = _rope_table(T, D, q.device, q.dtype)  # one table for q and k
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if H_kv != H:  # each key/value head copied for its H / H_kv query heads (torchtitan's repeat_kv)
            k, v = (t[:, :, None].expand(B, H_kv, H // H_kv, T, D).reshape(B, H, T, D) for t in (k, v))
        p = self.cfg.dropout if self.training else 0.0
        if self.cfg.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        elif self.cfg.attn in ("flash", "efficient"):
            y = _cuda_attention(self.cfg.attn, q, k, v, p)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, H, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = self.drop(att) @ v  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, C)
        return self.drop(self.proj(y))


class FeedForward(nn.Module):
    """Position-wise MLP: GELU (GPT-2) or SwiGLU (llama)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.up = nn.Linear(cfg.n_embd, cfg.hidden, bias=cfg.bias)
        self.gate = nn.Linear(cfg.n_embd, cfg.hidden, bias=cfg.bias) if self.swiglu else None
        self.down = nn.Linear(cfg.hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, C)
        h = F.silu(self.gate(x)) * self.up(x) if self.swiglu else F.gelu(self.up(x))  # (B, T, hidden)
        return self.drop(self.down(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1, self.attn = _norm(cfg), CausalSelfAttention(cfg)
        self.norm2, self.mlp = _norm(cfg), FeedForward(cfg)

    def forward(self, x):  # (B, T, C)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """GPT-style decoder: embeddings, `blocks` (an nn.Sequential), final norm, output head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def embed(self, idx):  # (B, T) int64 -> (B, T, C)
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        return self.drop(x)

    def logits(self, x):  # (B, T, C) -> (B, T, V)
        return self.head(self.norm(x))

    def forward(self, idx, targets=None):  # idx, targets: (B, T)
        """Return (logits, loss); loss is the mean cross-entropy over targets != IGNORE_INDEX, or None."""
        logits = self.logits(self.blocks(self.embed(idx)))  # (B, T, V)
        if self.cfg.logits_fp32:
            logits = logits.float()
        return logits, None if targets is None else token_loss(logits, targets)


def blocks_name(model: nn.Module) -> str:
    """Return the name of the model's nn.Sequential of repeated blocks (`blocks` for a GPT, `layers` for an MLP)."""
    for name in ("blocks", "layers"):
        if isinstance(getattr(model, name, None), nn.Sequential):
            return name
    raise TypeError(f"{type(model).__name__} has no nn.Sequential `blocks` (GPT) or `layers` (MLP)")


def blocks_of(model: nn.Module) -> nn.Sequential:
    """Return the model's nn.Sequential of repeated blocks (a GPT's `blocks`, an MLP's `layers`)."""
    return getattr(model, blocks_name(model))


def count_tokens(targets: torch.Tensor) -> int:
    """Return the number of real targets (those != IGNORE_INDEX)."""
    return int((targets != IGNORE_INDEX).sum())


def token_weights(targets) -> list[float]:
    """Return each micro-batch's share of the step's real targets: the weights of their mean losses in the step's loss.

    `targets` holds one tensor per micro-batch. Fake tensors hold no values: they are weighed by their sizes.
    """
    targets = list(targets)
    if any(isinstance(t, FakeTensor) for t in targets):
        total = sum(t.numel() for t in targets)
        return [t.numel() / total for t in targets]
    counts = torch.stack([(t != IGNORE_INDEX).sum() for t in targets]).tolist()  # one read from the device
    if sum(counts) == 0:
        raise ValueError(f"the micro-batches hold no real targets (every target is IGNORE_INDEX, {IGNORE_INDEX})")
    return [c / sum(counts) for c in counts]


def token_loss(logits, targets):  # logits (B, T, V), targets (B, T) -> ()
    """Return the mean cross-entropy over the targets that are not IGNORE_INDEX (padding)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


@dataclass
class MLPConfig:
    """Shape of a plain MLP classifier."""

    in_features: int = 32  # input width
    hidden: int = 256  # hidden width
    depth: int = 4  # hidden layers
    classes: int = 10  # output classes
    batchnorm: bool = False  # BatchNorm1d after each hidden Linear
    dropout: float = 0.0  # dropout after each hidden activation

    def __post_init__(self):
        for name in ("in_features", "hidden", "depth", "classes"):
            check_int(f"MLPConfig.{name}", getattr(self, name), 1)


class MLP(nn.Module):
    """MLP classifier: `layers` (an nn.Sequential of hidden blocks), then `head`."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        blocks, width = [], cfg.in_features
        for _ in range(cfg.depth):
            parts = [nn.Linear(width, cfg.hidden)]
            if cfg.batchnorm:
                parts.append(nn.BatchNorm1d(cfg.hidden))
            parts += [nn.ReLU(), nn.Dropout(cfg.dropout)]
            blocks.append(nn.Sequential(*parts))
            width = cfg.hidden
        self.layers = nn.Sequential(*blocks)
        self.head = nn.Linear(width, cfg.classes)

    def forward(self, x, targets=None):  # x: (B, in_features), targets: (B,)
        """Return (logits, loss); loss is the mean cross-entropy, or None without targets."""
        logits = self.head(self.layers(x))  # (B, classes)
        return logits, None if targets is None else F.cross_entropy(logits, targets)


def build_model(cfg: GPTConfig | MLPConfig) -> nn.Module:
    """Build the model a config describes."""
    if isinstance(cfg, GPTConfig):
        return GPT(cfg)
    if isinstance(cfg, MLPConfig):
        return MLP(cfg)
    raise TypeError(f"expected GPTConfig or MLPConfig, got {type(cfg).__name__}")


def count_params(model: nn.Module) -> int:
    """Return the number of unique parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
