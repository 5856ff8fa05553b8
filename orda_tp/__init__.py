"""orda_tp: exact, memory-lean distillation losses for large-vocabulary language models.

``distillation_loss`` computes the student and teacher cross-entropies and any of 15 KL-type
divergences from hidden states and LM-head weights without building the (tokens × vocab) logits;
``DistillationHead`` is an ``nn.Linear`` LM head that computes it in its forward; ``KDLoss`` and
``flash_ce_kd_loss`` take logits the caller holds. A superset of orda-kernel's API:
``import orda_tp as orda_kernel`` works.
"""

from .arguments.config import PROFILES
from .arguments.orda_kernel import ChunkSize, KernelConfig, begin_autotune_run, reset_autotune_cache
from .arguments.validation import IgnoredArgumentWarning
from .cross_vocab import (
    AlignedLikelihoodConfig,
    AlignedSpanLossOutput,
    AlignedSpanPairs,
    CrossVocabTeacher,
    PrecomputedSpanTeacher,
    aligned_span_distillation_loss,
    build_exact_token_map,
    build_precomputed_span_teacher,
    generalized_jensen_shannon,
    mix_teacher_logits,
    project_teacher_logits,
)
from .divergences import KL_VARIANTS, EntropyGate
from .flash_kd import flash_ce_kd_loss
from .kd_loss import KDLoss
from .lm_head import DistillationHead, HeadOutput
from .loss import DistillationLoss, DistillationLossOutput, distillation_loss, is_available
from .teachers import PrecomputedTeacher, SeparateTeacher, TeacherHead, TeacherMixture, TiedTeacher
from .topk_cache.extraction import TeacherTopK, teacher_topk, teacher_topk_of_logits
from .vocab_parallel import VocabParallel

__version__ = "0.1.0"

__all__ = [
    "AlignedLikelihoodConfig",
    "AlignedSpanLossOutput",
    "AlignedSpanPairs",
    "CrossVocabTeacher",
    "KL_VARIANTS",
    "KDLoss",
    "PrecomputedSpanTeacher",
    "aligned_span_distillation_loss",
    "build_exact_token_map",
    "build_precomputed_span_teacher",
    "generalized_jensen_shannon",
    "mix_teacher_logits",
    "project_teacher_logits",
    "PROFILES",
    "ChunkSize",
    "DistillationHead",
    "DistillationLoss",
    "DistillationLossOutput",
    "EntropyGate",
    "HeadOutput",
    "IgnoredArgumentWarning",
    "KernelConfig",
    "PrecomputedTeacher",
    "SeparateTeacher",
    "TeacherHead",
    "TeacherMixture",
    "TeacherTopK",
    "TiedTeacher",
    "VocabParallel",
    "begin_autotune_run",
    "distillation_loss",
    "flash_ce_kd_loss",
    "is_available",
    "reset_autotune_cache",
    "teacher_topk",
    "teacher_topk_of_logits",
]
