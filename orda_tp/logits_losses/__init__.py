"""Losses on logits the caller already holds, exact on vocabulary-sharded logits.

- :class:`KDLoss`: NeMo's knowledge-distillation loss (``T²·KL(q‖p)`` averaged over valid tokens),
  with any of the 15 variants, in a bounded workspace, on one device or across a tensor-parallel
  group.
- :func:`flash_ce_kd_loss`: flash_kd's per-token CE and KD scoring from student logits and the
  teacher's hidden states and LM head (the teacher's logits formed block by block).

Both run the fused path's statistics and gradient code on logits blocks
(:mod:`orda_tp.engine.row_walk`).
"""

from .flash_kd import flash_ce_kd_loss
from .kd_loss import KDLoss

__all__ = ["KDLoss", "flash_ce_kd_loss"]
