"""Shared test problems: random heads, teachers of every mode, and comparison helpers."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

import orda_tp
from orda_tp import EntropyGate, KernelConfig, PrecomputedTeacher, SeparateTeacher, TiedTeacher

from .topk_cases import topk_of

VARIANT_KWARGS: dict[str, dict[str, object]] = {
    "forward": {},
    "reverse": {},
    "jeffreys": {},
    "mutual": {},
    "cojeffreys": {},
    "alpha_divergence": {"kl_alpha": 0.3},
    "skew_forward": {"kl_beta": 0.3},
    "skew_reverse": {"kl_beta": 0.7},
    "skew_js": {"kl_beta": 0.4},
    "entropy_adaptive": {"entropy_gate": EntropyGate(alpha_min=0.1, alpha_max=0.9, tau=0.5, scale=0.3)},
    "renyi": {"kl_alpha": 1.5},
    "renyi_reverse": {"kl_alpha": 0.6},
    "dkd": {"kl_alpha": 2.0, "kl_beta": 0.5},
    "abkd": {"kl_alpha": 0.7, "kl_beta": 1.3},
    "triangular": {},
}
COTRAINED = ("mutual", "cojeffreys")
TEACHER_MODES = ("tied", "separate", "precomputed")
TOPK = 64  # the ids of a "topk" teacher's cache (Problem.teacher)
# Small chunks so that every call has several row chunks and uneven column blocks (203 = 3·64 + 11).
SMALL_CHUNKS = KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=7), vocab_block=64)


def stable_seed(*parts: object) -> int:
    """A seed from ``parts`` that is the same in every process, so that a failure reproduces
    (``hash`` of a string changes with PYTHONHASHSEED)."""
    return zlib.crc32(repr(parts).encode()) % 100_000


@dataclass
class Problem:
    student_hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher_hidden: Tensor
    teacher_weight: Tensor
    teacher_logits: Tensor
    real_columns: int | None = None  # the teacher's real vocabulary where the head is padded

    def teacher(self, mode: str) -> TiedTeacher | SeparateTeacher | PrecomputedTeacher:
        """The teacher of ``mode``: one of TEACHER_MODES, or "topk", the top-``TOPK`` cache of
        ``teacher_logits`` over its real columns (tail "uniform"; fp32 log-probabilities, the
        same values for a problem and its fp64 upcast)."""
        if mode == "tied":
            return TiedTeacher(self.teacher_hidden)
        if mode == "separate":
            return SeparateTeacher(self.teacher_hidden, self.teacher_weight)
        if mode == "topk":
            k = min(TOPK, self.real_columns or self.teacher_logits.shape[1])
            ids, logprobs = topk_of(self.teacher_logits, k, self.real_columns, torch.float32)
            return PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, retemper=True)
        return PrecomputedTeacher(logits=self.teacher_logits)

    def trainable(self, mode: str) -> list[Tensor]:
        """The tensors a call with this teacher mode may differentiate."""
        tensors = [self.student_hidden, self.weight]
        if mode == "tied":
            tensors.append(self.teacher_hidden)
        elif mode == "separate":
            tensors += [self.teacher_hidden, self.teacher_weight]
        return tensors

    def to(self, dtype: torch.dtype) -> Problem:
        """A copy in ``dtype`` with the same grad requirements (fresh leaves)."""

        def convert(t: Tensor) -> Tensor:
            return t.detach().to(dtype).requires_grad_(t.requires_grad)

        return Problem(
            convert(self.student_hidden),
            convert(self.weight),
            self.labels,
            convert(self.teacher_hidden),
            convert(self.teacher_weight),
            self.teacher_logits.detach().to(dtype),
            self.real_columns,
        )


def make_problem(
    rows: int = 24,
    hidden: int = 16,
    vocab: int = 203,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    ignored_every: int = 5,
    ignore_index: int = -100,
) -> Problem:
    """Random heads with logits of standard deviation ≈ 2; every ``ignored_every``-th row ignored."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    labels = torch.randint(0, vocab, (rows,), generator=generator)
    if ignored_every:
        labels[::ignored_every] = ignore_index
    scale = 2.0 / hidden**0.5
    teacher_hidden = randn(rows, hidden)
    teacher_weight = randn(vocab, hidden + 3, scale=2.0 / (hidden + 3) ** 0.5)
    separate_hidden = randn(rows, hidden + 3)
    return Problem(
        student_hidden=randn(rows, hidden).requires_grad_(),
        weight=randn(vocab, hidden, scale=scale).requires_grad_(),
        labels=labels,
        teacher_hidden=teacher_hidden.requires_grad_(),
        teacher_weight=teacher_weight.requires_grad_(),
        teacher_logits=(separate_hidden @ teacher_weight.T).detach(),
    )


def separate_problem(problem: Problem) -> Problem:
    """The separate-teacher view: teacher hidden of width hidden + 3 to match its own head."""
    generator = torch.Generator().manual_seed(123)
    rows, width = problem.student_hidden.shape[0], problem.teacher_weight.shape[1]
    hidden = torch.randn(rows, width, generator=generator, dtype=torch.float64).to(problem.weight.dtype)
    return Problem(
        problem.student_hidden,
        problem.weight,
        problem.labels,
        hidden.requires_grad_(),
        problem.teacher_weight,
        problem.teacher_logits,
    )


class NanFilledEmpty:
    """The ``torch`` module, except that ``empty`` returns NaN-filled tensors: patched over a
    module's ``torch``, it shows that the module writes every element it allocates before any read."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def empty(*size: object, **kwargs: object) -> Tensor:
        return torch.empty(*size, **kwargs).fill_(torch.nan)  # type: ignore[call-overload]


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ (absolute when expected is 0), in fp64."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / scale if scale > 0 else difference


def loss_and_grads(
    problem: Problem, mode: str, upstream: Tensor | None = None, **kwargs: object
) -> tuple[orda_tp.DistillationLossOutput, list[Tensor | None]]:
    """Call the loss and differentiate ``loss`` (weighted by ``upstream`` for reduction="none")."""
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, problem.teacher(mode), **kwargs
    )
    inputs = problem.trainable(mode)
    if not out.loss.requires_grad:
        return out, [None] * len(inputs)
    grads = torch.autograd.grad(out.loss, inputs, grad_outputs=upstream, allow_unused=True)
    return out, list(grads)


def call_kwargs(variant: str, mode: str, reduction: str) -> dict[str, object]:
    """Loss keywords of the equivalence tests: every term on, T_s ≠ T_t where the variant allows it."""
    kwargs: dict[str, object] = dict(
        student_ce_weight=0.7,
        kl_weight=1.3,
        kl_temperature=2.0,
        kl_divergence=variant,
        reduction=reduction,
        **VARIANT_KWARGS[variant],
    )
    if variant not in COTRAINED:
        kwargs["kl_teacher_temperature"] = 1.5
    if mode == "separate":
        kwargs["teacher_ce_weight"] = 0.4
    elif mode == "precomputed":
        kwargs["teacher_ce_weight"] = 0.2
    return kwargs


Columns = tuple[int, int]  # a shard's head rows / logits columns [start, stop)
Rows = tuple[int, int] | None  # a rank's hidden rows under sequence parallelism (None: all)


def leaf(tensor: Tensor) -> Tensor:
    """A new leaf with ``tensor``'s values and ``requires_grad``."""
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)


def shard_problem(problem: Problem, columns: Columns, rows: Rows = None) -> Problem:
    """This rank's inputs: its head rows / logits columns, and all rows or only ``rows``."""
    start, stop = columns

    def hidden(tensor: Tensor) -> Tensor:
        return leaf(tensor if rows is None else tensor[rows[0] : rows[1]])

    return Problem(
        student_hidden=hidden(problem.student_hidden),
        weight=leaf(problem.weight[start:stop]),
        labels=problem.labels.clone(),
        teacher_hidden=hidden(problem.teacher_hidden),
        teacher_weight=leaf(problem.teacher_weight[start:stop]),
        teacher_logits=problem.teacher_logits[:, start:stop].clone(),
    )
