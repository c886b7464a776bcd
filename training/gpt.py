"""A small GPT-style language model: pre-norm transformer blocks, causal attention, tied embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import nn


class GPTConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256


PRESETS: dict[str, dict[str, int]] = {
    # ~3.2M parameters: the demo's model.
    "small": {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256},
    # ~30k parameters: fast enough for end-to-end tests on two cores.
    "tiny": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
}


INIT_STD = 0.02  # GPT-2's: with PyTorch's unit-variance embedding, tied to the head, the first loss was ~174


def _init_weights(module: nn.Module) -> None:
    """GPT-2/nanoGPT's initialisation; LayerNorm keeps PyTorch's (weight 1, bias 0). It draws from
    the global generator in module order, so the weights still depend only on the seed."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.apply(_init_weights)
        # GPT-2's scaling: each block adds two residual branches, so shrinking their output
        # projections by sqrt(2·n_layer) keeps the residual stream's variance from growing with depth.
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.proj, block.mlp[2]):
                assert isinstance(proj, nn.Linear)
                nn.init.normal_(proj.weight, mean=0.0, std=INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-sample mean cross-entropy, shape (batch,): the trainer weights samples itself."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return loss.mean(dim=1)
