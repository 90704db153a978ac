"""The models the built-in workloads train: a small ResNet, ResNet-50 and a nanoGPT-shaped transformer.

Plain PyTorch, no torchvision: each class is short enough to read, and every normalisation is a
``nn.BatchNorm2d`` or ``nn.LayerNorm``, so the pure recipes find them by class name and keep them fp32.

    >>> model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64))
    >>> tuple(model(torch.zeros(3, 64, dtype=torch.int64)).shape)
    (3, 64, 65)
    >>> sum(p.numel() for p in ResNet50().parameters())
    25557032
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SmallResNet", "ResNet50", "GPTConfig", "GPT"]


# ------------------------------------------------------------------------------------- ResNets
class _BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the input (projected by a 1x1 conv when the shape changes), ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        # No conv biases: the BatchNorm after each conv subtracts the mean, a bias would cancel out.
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, C_in, H, W)
        out = F.relu(self.bn1(self.conv1(x)))                      # (B, C_out, H/s, W/s)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet for tiny images: a conv stem, basic residual blocks, global average pool, linear head.

    ``widths`` lists each block's output channels; a block that widens also halves the resolution.
    With the defaults, on (B, 1, 8, 8) digits: a stem to 16 channels, a block at 8x8, a block to 32
    channels at 4x4 and one more at 4x4, then 10 logits. 38,266 parameters, 8 BatchNorms. Narrow on
    purpose: CPUs without native 16-bit arithmetic (AVX2 only) run 16-bit convolutions several times
    slower than fp32, and a compare trains it under every recipe.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10,
                 widths: tuple[int, ...] = (16, 32, 32)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        c_in, blocks = widths[0], []
        for width in widths:
            blocks.append(_BasicBlock(c_in, width, stride=2 if width != c_in else 1))
            c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, C_in, H, W)
        x = self.blocks(self.stem(x))                              # (B, C, H', W')
        return self.head(x.mean(dim=(2, 3)))                       # (B, num_classes)


class _Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in torchvision's "ResNet v1.5"), 1x1 expand by 4; BN after each."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.downsample = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, C_in, H, W)
        out = F.relu(self.bn1(self.conv1(x)))                      # (B, width, H, W)
        out = F.relu(self.bn2(self.conv2(out)))                    # (B, width, H/s, W/s)
        out = self.bn3(self.conv3(out))                            # (B, 4 width, H/s, W/s)
        return F.relu(out + self.downsample(x))


class ResNet50(nn.Module):
    """ResNet-50 as torchvision builds it (v1.5: stride in the 3x3), without torchvision.

    Bottleneck stages of [3, 4, 6, 3] blocks at widths 64, 128, 256, 512 (outputs 4x wider).
    25,557,032 parameters for 1000 classes, torchvision's count. On (B, 3, 224, 224) about
    4.1 GMACs a forward per image.
    """

    def __init__(self, num_classes: int = 1000, layers: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        stages, c_in = [], 64
        for i, (n_blocks, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            for j in range(n_blocks):
                stages.append(_Bottleneck(c_in, width, stride=2 if i > 0 and j == 0 else 1))
                c_in = width * _Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):   # torchvision's init (BatchNorm keeps weight 1, bias 0)
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, 3, H, W)
        x = self.stages(self.stem(x))                              # (B, 2048, H/32, W/32)
        return self.fc(x.mean(dim=(2, 3)))                         # (B, num_classes)


# ----------------------------------------------------------------------------------------- GPT
@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a nanoGPT-style decoder: vocabulary, context length, depth, heads, width."""

    vocab_size: int
    block_size: int      # the longest sequence T the position embedding covers
    n_layer: int
    n_head: int
    n_embd: int          # C; each head is C / n_head wide

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}); "
                             f"e.g. n_embd={self.n_head * math.ceil(self.n_embd / self.n_head)}")


class _CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)   # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                   # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # (B, nh, T, hs). The fused kernel computes softmax(q k^T / sqrt(hs)) v with the causal mask;
        # on GPUs in fp16/bf16 it is flash attention, whose softmax accumulates in fp32.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))        # (B, T, C)


class _MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, T, C)
        return self.c_proj(F.gelu(self.c_fc(x)))                   # via (B, T, 4C)


class _Block(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + mlp(ln(x)). The residual stream never passes through a norm."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = _CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (B, T, C)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer shaped like nanoGPT's (and GPT-2's): next-token logits for every position.

    Token plus learned position embeddings, ``n_layer`` pre-LN blocks, a final LayerNorm and an LM head
    that shares its weight with the token embedding. Weights start as nanoGPT's: N(0, 0.02), the
    projections back into the residual stream N(0, 0.02 / sqrt(2 n_layer)) so its variance stays the
    same whatever the depth, biases zero.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight   # tied: one (V, C) matrix, in and out
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif p.dim() == 2:                   # every other matrix, embeddings included
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith(".bias"):         # LayerNorm biases start at zero anyway
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:        # (B, T) int64 token ids
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}; "
                             "cut the input into windows of at most block_size tokens")
        pos = torch.arange(T, device=idx.device)                   # (T,)
        x = self.wte(idx) + self.wpe(pos)                          # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))                          # (B, T, V)
