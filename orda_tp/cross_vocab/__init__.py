"""Cross-vocabulary distillation: for a teacher whose tokenizer differs from the student's.

- :mod:`.token_maps`: project teacher logits onto the student vocabulary through exact token matches.
- :mod:`.mixing`: mix several teachers on one vocabulary; measure their (dis)agreement.
- :mod:`.spans`: compare span log-likelihoods over aligned text spans.

See docs/cross_vocab.md for when to use which.
"""

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
