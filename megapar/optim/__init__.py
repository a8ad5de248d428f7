"""Optimizers (AdamW, LAMB, LARS, SGD, Muon; ZeRO 1-3), LR schedule, global gradient clipping,
mixed precision."""

from megapar.optim.build import build_optimizer
from megapar.optim.clip import clip_grad_norm, grad_norm
from megapar.optim.optimizer import AdamWOptimizer
from megapar.optim.precision import DynamicLossScaler, Precision
from megapar.optim.scheduler import LRScheduler
from megapar.optim.zero import ZeroOptimizer

__all__ = [
    "AdamWOptimizer",
    "ZeroOptimizer",
    "build_optimizer",
    "LRScheduler",
    "clip_grad_norm",
    "grad_norm",
    "Precision",
    "DynamicLossScaler",
]
