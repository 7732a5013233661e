"""A study's settings (notebook 08): what every trial of a study shares, the one thing its modules all import."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.gpus import GPUS
from labkit.models import GPTConfig
from labkit.search.space import workbook_space
from labkit.validate import check_choice, check_divides, check_int


@dataclass(frozen=True)
class StudyConfig:
    """What every trial of a study shares: the model, the data, the budget and how long each trial trains."""

    budget_bytes: int  # the simulated device's memory: a setting whose step needs more does not fit
    n_layer: int = 4  # transformer blocks (the running example's shape by default)
    n_embd: int = 128  # model width
    n_head: int = 4  # attention heads
    vocab_size: int = 256  # tokens of the synthetic language
    batch: int = 16  # samples per optimizer step, however it is split into micro-batches
    seq_len: int = 64  # tokens per sample
    train_steps: int = 8  # optimizer steps per trial: every trial trains on the same batch * seq_len * train_steps tokens
    eval_every: int = 2  # validation loss every this many steps (what a pruner sees)
    eval_batch: int = 32  # held-out samples of the validation loss (the same for every trial)
    metered_steps: int = 2  # steps run under the meter and the budget (a steady step is the second); the rest are timed
    timed_steps: int = 3  # steps timed for the speed objective (after one warm-up step)
    seed: int = 0  # weights and data: every trial starts from the same model and sees the same batches
    device: str = "cpu"  # "cpu" or "cuda" (never "auto": a stored study must mean the same thing on every worker)
    precisions: tuple = ("fp32", "bf16")  # the precisions searched (fp16 only on CUDA: on a CPU, bf16 stands for the
    #                                       GPU's 16-bit format, which labkit.gpus.step_time prices at that GPU's rate)
    gpu: str = "t4"  # the GPU the speed study answers for on a CPU: a key of labkit.gpus.GPUS (its step time projected
    #                  from the counted work); on CUDA the speed is measured on the device itself

    def __post_init__(self):
        for name in ("budget_bytes", "n_layer", "n_embd", "n_head", "vocab_size", "batch", "seq_len", "train_steps",
                     "eval_every", "eval_batch", "timed_steps"):
            check_int(name, getattr(self, name), 1)
        check_int("metered_steps", self.metered_steps, 1, self.train_steps)
        check_int("seed", self.seed, 0)
        check_divides("n_embd", self.n_embd, "n_head", self.n_head)
        check_choice("device", self.device, ("cpu", "cuda"))
        check_choice("gpu", self.gpu, tuple(GPUS))
        object.__setattr__(self, "precisions", tuple(self.precisions))  # (a stored study gives a list)
        if not self.precisions or any(p not in ("fp32", "bf16", "fp16") for p in self.precisions):
            raise ValueError(f"precisions must be a non-empty subset of ('fp32', 'bf16', 'fp16'), got {self.precisions}")
        if "fp16" in self.precisions and self.device != "cuda":
            raise ValueError("fp16 is searched only on CUDA: fp16 compute on a CPU runs on slow generic kernels")

    @property
    def gpt(self) -> GPTConfig:
        """Return the model's config."""
        return dataclasses.replace(GPTConfig(), n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                                   vocab_size=self.vocab_size, block_size=self.seq_len)

    @property
    def tokens_per_step(self) -> int:
        """Return the tokens of one optimizer step."""
        return self.batch * self.seq_len

    def space(self, precisions: tuple | None = None, only: tuple | None = None):
        """Return the workbook's search space for this model and batch (`only`: just these parameters)."""
        full = workbook_space(self.n_layer, self.batch, precisions=precisions or self.precisions)
        return full if only is None else [p for p in full if p.name in only]

    def to_dict(self) -> dict:
        """Return the config as plain data (what a study stores for its workers)."""
        d = dataclasses.asdict(self)
        d["precisions"] = list(self.precisions)
        return d
