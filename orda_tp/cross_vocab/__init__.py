"""Cross-vocabulary distillation, for a teacher whose tokenizer differs from the student's: token-map
projection (:mod:`.token_maps`), multi-teacher mixing (:mod:`.mixing`) and span-aligned likelihoods
(:mod:`.spans`); docs/cross_vocab.md says when to use which."""

from .mixing import generalized_jensen_shannon, mix_teacher_logits
from .spans import (
    AlignedLikelihoodConfig,
    AlignedSpanLossOutput,
    AlignedSpanPairs,
    CrossVocabTeacher,
    PrecomputedSpanTeacher,
    aligned_span_distillation_loss,
    build_precomputed_span_teacher,
)
from .token_maps import build_exact_token_map, project_teacher_logits

__all__ = [
    "AlignedLikelihoodConfig",
    "AlignedSpanLossOutput",
    "AlignedSpanPairs",
    "CrossVocabTeacher",
    "PrecomputedSpanTeacher",
    "aligned_span_distillation_loss",
    "build_exact_token_map",
    "build_precomputed_span_teacher",
    "generalized_jensen_shannon",
    "mix_teacher_logits",
    "project_teacher_logits",
]
