"""A chunk's per-row statistics, and the per-row constants of its logit gradients, by name.

The row steps (:mod:`.row_formulas`) each produce one (rows, K) tensor; the row walk
(:mod:`.row_walk`) unpacks it once into the fields below (views of it), so nothing downstream
looks a statistic up by name. Flags are stored as 1.0/0.0. The variant's finalize constants
stay a mapping keyed by the names its gradient expressions read (the variant's own namespace).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from torch import Tensor

__all__ = ["GRAD_ROW_CONSTANTS", "GradRows", "KLRowStats", "RowStats"]


@dataclass(frozen=True)
class KLRowStats:
    """The KL term's per-row statistics, ``u = s/T_s``, ``v = t/T_t``.

    ``lse_u = LSE(u)``, ``lse_v = LSE(v)`` (0 on absent rows); ``logp_y = s_y/T_s − LSE(u)``,
    ``logq_y = t_y/T_t − LSE(v)``; ``divergence = max(D, 0)`` (without ``T_s²``; 0 on absent
    rows, NaN on unowned ones); ``keep``: whether the row's KL gradient is formed (teacher
    present and ``D ≠ +inf``); ``consts``: the variant's finalize constants.
    """

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
    unweighted value (:mod:`orda_tp.divergences.terms`), by its name (0 for a term the call does not have);
    ``teacher_ce``, ``kl``: the teacher's per-row loss components (``kl`` includes ``T_s²``); each
    component NaN on rows whose label no column owns; ``kl_stats``: the KL term's statistics (None
    without a KL term).
    """

    log_partitions: Tensor
    owned: Tensor
    absent: Tensor | None
    student_terms: Mapping[str, Tensor]
    teacher_ce: Tensor
    kl: Tensor
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

    The fields from ``scale`` to ``keep`` are the engine's row constants, in the order of the
    columns the gradient kernel reads (:data:`GRAD_ROW_CONSTANTS`), each but ``scale`` None where
    the call has no such term:
    ``scale``, the upstream gradient (÷ N for "mean"; 0 on ignored rows, NaN on unowned ones);
    ``lse_s``, ``LSE(s)`` of the student's terms, and ``c_p``, ``c_y``, ``c_u``, the coefficients of
    their gradient (:mod:`orda_tp.divergences.terms`; weighted, summed over the terms);
    ``lse_t``, ``c_ce_t``: ``LSE(t)`` and the coefficient ``w_t·scale`` of the teacher's CE when it
    trains the teacher (both 0 on absent rows); ``lse_u``, ``lse_v``, ``keep``: the KL term's
    (:class:`KLRowStats`). ``consts``: the variant's finalize constants, read after them.
    ``packed`` holds them all as the columns ``names`` of one (rows, len(names)) tensor, the layout
    the gradient kernel reads.
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
