"""Reference models for tiermem's tests, benches and examples: a GPT-2-style decoder and ResNet-50.

Written out here (plain torch.nn, no torchvision or transformers needed) so that a training run is
the same on any machine. Both are deterministic on CUDA with deterministic cuBLAS settings: the
attention is computed explicitly (softmax(QK^T)V with a causal mask) rather than by a fused
kernel whose backward may use atomics.
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["GPT", "GPTConfig", "resnet50", "gpt_param_count"]


def _nn() -> Any:
    import torch.nn as nn
    return nn


class GPTConfig:
    def __init__(self, vocab: int = 8192, seq: int = 512, d: int = 1024, layers: int = 16, heads: int = 16):
        self.vocab, self.seq, self.d, self.layers, self.heads = vocab, seq, d, layers, heads


def gpt_param_count(c: GPTConfig) -> int:
    """Parameters of :class:`GPT` for config ``c`` (untied embedding and head)."""
    d = c.d
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return c.vocab * d + c.seq * d + c.layers * block + 2 * d + d * c.vocab


def _block_cls() -> Any:
    import torch
    import torch.nn.functional as F
    nn = _nn()

    class Block(nn.Module):
        def __init__(self, c: GPTConfig):
            super().__init__()
            self.heads = c.heads
            self.ln1 = nn.LayerNorm(c.d)
            self.qkv = nn.Linear(c.d, 3 * c.d)
            self.proj = nn.Linear(c.d, c.d)
            self.ln2 = nn.LayerNorm(c.d)
            self.fc = nn.Linear(c.d, 4 * c.d)
            self.out = nn.Linear(4 * c.d, c.d)

        def forward(self, x: Any) -> Any:
            B, T, C = x.shape
            h = self.heads
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // h))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    return Block


class GPT:
    """Factory: ``GPT(config)`` returns an nn.Module mapping token ids (B, T) to logits (B, T, vocab)."""

    def __new__(cls, c: GPTConfig) -> Any:   # type: ignore[misc]
        import torch
        nn = _nn()
        Block = _block_cls()

        class _GPT(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.wte = nn.Embedding(c.vocab, c.d)
                self.wpe = nn.Embedding(c.seq, c.d)
                self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
                self.ln_f = nn.LayerNorm(c.d)
                self.head = nn.Linear(c.d, c.vocab, bias=False)

            def forward(self, idx: Any) -> Any:
                T = idx.shape[1]
                x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
                for b in self.blocks:
                    x = b(x)
                return self.head(self.ln_f(x))

        return _GPT()


def resnet50(num_classes: int = 1000) -> Any:
    """ResNet-50 (He et al. 2016; torchvision's layout: stride on the 3x3 conv, in-place ReLU)."""
    nn = _nn()

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int):
            super().__init__()
            cout = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

        def forward(self, x: Any) -> Any:
            idt = x if self.down is None else self.down(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            return self.relu(self.bn3(self.conv3(y)) + idt)

    layers: list[Any] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)
