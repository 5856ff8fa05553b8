"""A chunk's per-row statistics and the row constants of its logit gradients, as named fields:
views of a row step's (rows, K) result, unpacked once by the row walk; flags are 1.0/0.0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from torch import Tensor

__all__ = ["GRAD_ROW_CONSTANTS", "GradRows", "KLRowStats", "RowStats"]


@dataclass(frozen=True)
class KLRowStats:
    """The KL term's per-row statistics, ``u = s/T_s``, ``v = t/T_t``: ``lse_u = LSE(u)``,
    ``lse_v = LSE(v)`` (0 on absent rows); ``logp_y``, ``logq_y``: ``log p``, ``log q`` at the
    label; ``divergence = max(D, 0)`` (without ``T_s²``; 0 on absent rows, NaN on unowned ones);
    ``keep``: whether the row's KL gradient is formed; ``consts``: the variant's finalize
    constants, by the names its gradient expressions read."""

    lse_u: Tensor
    lse_v: Tensor
    logp_y: Tensor
    logq_y: Tensor
    divergence: Tensor
    keep: Tensor
    consts: Mapping[str, Tensor]


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of a chunk: everything the gradient needs besides logits.

    ``log_partitions``: (rows, F) ``LSE`` of each logit family in ``plan.families`` order;
    ``owned``: exactly one column owns the row's label; ``absent``: the teacher's logits are all
    ``−inf`` (None without teacher logits); ``student_terms``: each registered student term's
    unweighted value by its name (0 for a term the call does not have); ``teacher_ce``, ``kl``
    (with ``T_s²``): the teacher's loss components; ``student_entropy``: ``H(p)`` at ``T_s`` (0
    where not reported); each component NaN on rows whose label no column owns; ``kl_stats``: None
    without a KL term.
    """

    log_partitions: Tensor
    owned: Tensor
    absent: Tensor | None
    student_terms: Mapping[str, Tensor]
    teacher_ce: Tensor
    kl: Tensor
    student_entropy: Tensor
    kl_stats: KLRowStats | None

    @property
    def student_ce(self) -> Tensor:
        """The student's (label-smoothed) CE per row."""
        return self.student_terms["student_ce"]

    def gradient_inputs(self) -> dict[str, Tensor]:
        """The statistics the grad step reads, by name: ``lse<f>`` per family, ``owned``,
        ``absent`` and the KL's ``lse_u``, ``lse_v``, ``keep`` and the variant's constants."""
        inputs = {f"lse{f}": column for f, column in enumerate(self.log_partitions.unbind(1))}
        inputs["owned"] = self.owned
        if self.absent is not None:
            inputs["absent"] = self.absent
        if self.kl_stats is not None:
            kl = self.kl_stats
            inputs.update(lse_u=kl.lse_u, lse_v=kl.lse_v, keep=kl.keep, **kl.consts)
        return inputs


@dataclass(frozen=True)
class GradRows:
    """The per-row constants of a chunk's logit gradients (:func:`.row_formulas.grad_step`).

    The fields from ``scale`` to ``keep``, in the order of :data:`GRAD_ROW_CONSTANTS`, each but
    ``scale`` None where the call has no such term: ``scale``, the upstream gradient (÷ N for
    "mean"; 0 on ignored rows, NaN on unowned ones); ``lse_s = LSE(s)`` and ``c_p``, ``c_y``,
    ``c_u``, the student terms' gradient coefficients, weighted and summed over the terms;
    ``lse_t`` and ``c_ce_t = w_t·scale`` for a teacher trained by its CE (both 0 on absent rows);
    the KL's ``lse_u``, ``lse_v``, ``keep``. ``consts``: the variant's constants, after them.
    ``packed``: all of them as the columns ``names`` of one (rows, len(names)) tensor, as the
    gradient kernel reads it.
    """

    scale: Tensor
    lse_s: Tensor | None
    c_p: Tensor | None
    c_y: Tensor | None
    c_u: Tensor | None
    lse_t: Tensor | None
    c_ce_t: Tensor | None
    lse_u: Tensor | None
    lse_v: Tensor | None
    keep: Tensor | None
    consts: Mapping[str, Tensor]
    packed: Tensor
    names: tuple[str, ...]


#: The names of the engine's row constants of the gradient kernel, in the order of its columns.
GRAD_ROW_CONSTANTS = tuple(field.name for field in fields(GradRows) if field.name not in ("consts", "packed", "names"))
