"""Optimizers whose state lives in the value row: ``row = [embedding (dim) | state (state_dim)]``.

"Exact" as FBGEMM's TBE: gradients are summed per unique id before one update per row.
- ``SGD``: w -= lr * g
- ``Adagrad``: G += g^2 (per element); w -= lr * g / (sqrt(G) + eps)   (torch.optim.Adagrad on sparse grads)
- ``RowWiseAdagrad``: G += mean(g^2) (one per row); w -= lr * g / (sqrt(G) + eps)
- ``Adam``: m, v per element, bias correction by the step count (torch.optim.SparseAdam)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SGD:
    lr: float = 0.01

    def state_dim(self, dim: int) -> int:
        return 0

    def update(self, rows: torch.Tensor, grad: torch.Tensor, dim: int, step: int) -> torch.Tensor:
        return rows - self.lr * grad


@dataclass
class Adagrad:
    lr: float = 0.01
    eps: float = 1e-10

    def state_dim(self, dim: int) -> int:
        return dim

    def update(self, rows: torch.Tensor, grad: torch.Tensor, dim: int, step: int) -> torch.Tensor:
        w, acc = rows[:, :dim], rows[:, dim:] + grad * grad
        return torch.cat([w - self.lr * grad / (acc.sqrt() + self.eps), acc], 1)


@dataclass
class RowWiseAdagrad:
    lr: float = 0.01
    eps: float = 1e-10

    def state_dim(self, dim: int) -> int:
        return 1

    def update(self, rows: torch.Tensor, grad: torch.Tensor, dim: int, step: int) -> torch.Tensor:
        w, acc = rows[:, :dim], rows[:, dim:] + (grad * grad).mean(1, keepdim=True)
        return torch.cat([w - self.lr * grad / (acc.sqrt() + self.eps), acc], 1)


@dataclass
class Adam:
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def state_dim(self, dim: int) -> int:
        return 2 * dim

    def update(self, rows: torch.Tensor, grad: torch.Tensor, dim: int, step: int) -> torch.Tensor:
        w, m, v = rows[:, :dim], rows[:, dim:2 * dim], rows[:, 2 * dim:]
        m = self.beta1 * m + (1 - self.beta1) * grad
        v = self.beta2 * v + (1 - self.beta2) * grad * grad
        step_size = self.lr * (1 - self.beta2**step) ** 0.5 / (1 - self.beta1**step)
        return torch.cat([w - step_size * m / (v.sqrt() + self.eps), m, v], 1)


OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "rowwise_adagrad": RowWiseAdagrad, "adam": Adam}
