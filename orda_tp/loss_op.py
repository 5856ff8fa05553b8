"""The fused loss as one operator under ``torch.compile`` (docs/architecture.md, "One graph under
torch.compile"): a one-device :func:`orda_tp.distillation_loss` or :class:`orda_tp.DistillationLoss`
call that dynamo traces becomes ``orda_tp::distillation_loss``, a ``torch.library.custom_op`` with a
fake implementation (its outputs' shapes and dtypes) and its autograd. What the call holds beside its
tensors (its options, its teacher's kind and settings, the door's eager path) is a :class:`Recipe`,
registered at trace time under the index the operator takes.

The operator runs the door's eager path on its tensors: the checks, the plan and the fused engine,
host reads included (it runs outside the graph). For "mean" and "sum" it also returns the engine's
gradients for a unit upstream gradient, in the dtypes of its buffers, and its backward scales them in
those dtypes and casts them to the inputs', as the eager backward does; for "none" its backward is a
second operator, which recomputes the forward's statistics and forms the gradients for the upstream
gradient.
"""

# Without ``from __future__ import annotations``: torch.library reads the operator's schema from its
# annotations, which must be types, not strings.
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.distributed.tensor import DTensor

from .arguments.options import LossOptions
from .arguments.plan import LossPlan
from .divergences.terms import COMPONENTS
from .engine.fused import unit_gradients
from .engine.gradient_gemms import GradNeeds, allocate_buffers, scale_by_upstream
from .engine.logits import HeadTensors, statistics_dtype
from .parallel.fsdp import head_parameters
from .teachers import SeparateTeacher, TeacherHead, TeacherSource, TiedTeacher

__all__ = ["COVERED_TEACHERS", "Recipe", "traced_loss"]

#: The teachers the operator takes: heads (a TeacherHead's module read as its weight and bias). A cache runs
#: eagerly, behind a graph break: its in-place change check reads version counters the operator never sees.
COVERED_TEACHERS = (TiedTeacher, SeparateTeacher)
#: The teacher's tensors the operator takes: a separate head's hidden states, weight and bias at most.
TEACHER_SLOTS = 3
#: ``loss`` and the components: the first outputs of the operator.
LOSS_OUTPUTS = 1 + len(COMPONENTS)

#: The door's eager path: ``run(options, student_hidden, weight, labels, teacher, num_valid_tokens,
#: token_weights, bias)`` → ``(loss, *COMPONENTS)``.
Runner = Callable[..., Sequence[Tensor]]


class Recipe(NamedTuple):
    """What a compiled call holds beside its tensors: the door's eager path ``run`` and its
    ``options``, the ``teacher``'s class, its ``settings`` (its fields that hold no tensor) and the
    ``names`` of the fields whose tensors fill the operator's teacher slots, and ``num_valid_tokens``
    when it is a number (a tensor is an input of the operator)."""

    run: Runner
    options: LossOptions
    teacher: type[TeacherSource]
    settings: tuple[tuple[str, object], ...]
    names: tuple[str, ...]
    num_valid_tokens: object

    def teacher_of(self, slots: Sequence[Tensor | None]) -> TeacherSource:
        """The teacher descriptor over the tensors of ``slots`` (in :attr:`names`' order)."""
        return self.teacher(**dict(self.settings), **dict(zip(self.names, slots)))


#: The eager path reads its inputs with any strides, so the compiler need not keep those it traced.
_ANY_STRIDES = (torch.Tag.flexible_layout,)
_RECIPES: list[Recipe] = []
_INDEX: dict[Recipe, int] = {}


@torch.compiler.assume_constant_result
def recipe_index(
    run: Runner,
    options: LossOptions | None,
    teacher: type,
    settings: tuple[tuple[str, object], ...],
    names: tuple[str, ...],
    num_valid_tokens: object,
    /,
    **keywords: Any,
) -> int:
    """The index of the call's :class:`Recipe` (registered at its first trace), or −1 where the
    operator does not cover the call. ``options``, or None with the function door's ``keywords``.
    Dynamo runs it eagerly, once per trace, and keeps its result as a constant of the graph."""
    if options is None:
        try:
            options = LossOptions(**keywords)
        except (ValueError, TypeError):  # raised again by the door run eagerly, as it is raised without compile
            return -1
    # A tensor-parallel call exchanges records and errors between ranks; the reference builds the logits.
    sharded = options.tp_group is not None or options.vocab_range is not None or bool(options.sequence_parallel)
    if sharded or options.backend == "reference" or teacher not in COVERED_TEACHERS:
        return -1
    recipe = Recipe(run, options, teacher, settings, names, num_valid_tokens)
    if recipe not in _INDEX:
        _INDEX[recipe] = len(_RECIPES)
        _RECIPES.append(recipe)
    return _INDEX[recipe]


class _Routing(NamedTuple):
    """How a call's gradients meet the operator's ``differentiable`` inputs (``student_hidden``,
    ``weight``, ``bias``, the teacher's slots)."""

    plan: LossPlan
    #: Which of ``differentiable`` receive a gradient: those that require one and to which the plan routes one.
    needs: list[bool]
    #: The engine's inputs, as the door hands them to it on one device.
    head: HeadTensors
    #: Each engine gradient's place in ``differentiable``, in ``GradientBuffers``' order (None: no input there).
    places: tuple[int | None, ...]


def _routing(recipe: Recipe, requires: Sequence[bool], differentiable: Sequence[Tensor | None]) -> _Routing:
    """The call's plan, engine inputs and gradient places, and which of its ``differentiable``
    inputs receive a gradient: those that ``requires`` one and to which the plan routes one
    (``LossPlan.gradient_routes``, as the engine reads it)."""
    student_hidden, weight, bias, *slots = differentiable
    assert student_hidden is not None and weight is not None
    teacher = recipe.teacher_of(slots)
    # The real vocabulary as engine.call.agree reads it on one device: the head's rows unless vocab_size says less.
    vocab = weight.shape[0] if recipe.options.vocab_size is None else recipe.options.vocab_size
    plan = LossPlan.build(recipe.options, teacher, vocab)
    hidden, teacher_weight, logits, _, teacher_bias = teacher.logits_inputs(0, vocab)
    head = HeadTensors(student_hidden, weight, hidden, teacher_weight, logits, bias, teacher_bias)
    # Each role's place in ``differentiable``: the student's by position, the teacher's by the slot that holds
    # it (by identity among the slots alone: a student tensor may also be the teacher's, in another slot).
    teacher_places = [
        next((3 + i for i, slot in enumerate(slots) if t is not None and slot is t), None)
        for t in (hidden, teacher_weight, teacher_bias)
    ]
    places = (0, 1, teacher_places[0], teacher_places[1], 2, teacher_places[2])
    needs = [False] * len(differentiable)
    for place, route in zip(places, plan.gradient_routes):
        if place is not None and differentiable[place] is not None and requires[place] and route:
            needs[place] = True
    return _Routing(plan, needs, head, places)


def _by_place(buffers: Sequence[Tensor | None], places: Sequence[int | None], like: Tensor) -> list[Tensor]:
    """The engine's gradients (``buffers``, in ``GradientBuffers``' order) at their inputs'
    ``places`` among the operator's differentiable inputs, an empty tensor at the others'."""
    # An operator's outputs alias nothing: no shared empty.
    gradients = [like.new_empty(0) for _ in range(3 + TEACHER_SLOTS)]
    for place, buffer in zip(places, buffers):
        if place is not None and buffer is not None:
            gradients[place] = buffer
    return gradients


def _on_leaves(
    recipe: Recipe,
    needs: Sequence[bool],
    differentiable: Sequence[Tensor | None],
    labels: Tensor,
    token_weights: Tensor | None,
    num_valid_tokens: Tensor | None,
) -> tuple[list[Tensor | None], Sequence[Tensor]]:
    """The door's eager path on detached leaves of the call's ``differentiable`` tensors, those
    that ``needs`` a gradient requiring one: the leaves and ``(loss, *COMPONENTS)``, whose loss
    holds the engine's autograd node where a leaf requires a gradient."""
    # The operator runs below autograd; the engine's autograd Function still records its node there.
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(differentiable, needs)]
        teacher = recipe.teacher_of(leaves[3:])
        denominator = recipe.num_valid_tokens if num_valid_tokens is None else num_valid_tokens
        outputs = recipe.run(
            recipe.options, leaves[0], leaves[1], labels, teacher, denominator, token_weights, leaves[2]
        )
    return leaves, outputs


def _fake_gradients(needs: Sequence[bool], differentiable: Sequence[Tensor | None]) -> list[Tensor]:
    """The gradients' shapes and dtypes: an input's where ``needs`` says it receives one, else empty."""
    like = next(t for t in differentiable if t is not None)
    return [
        t.new_empty(t.shape) if need and t is not None else like.new_empty(0) for t, need in zip(differentiable, needs)
    ]


@torch.library.custom_op("orda_tp::distillation_loss", mutates_args=(), tags=_ANY_STRIDES)
def _loss_op(
    index: int,
    requires: list[bool],
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    token_weights: Tensor | None,
    num_valid_tokens: Tensor | None,
    teacher_0: Tensor | None,
    teacher_1: Tensor | None,
    teacher_2: Tensor | None,
) -> list[Tensor]:
    """``(loss, *COMPONENTS, *gradients)`` of the call registered under ``index``: the gradients of
    ``(student_hidden, weight, bias, teacher_0, teacher_1, teacher_2)`` for a unit upstream gradient
    where ``requires`` asks one and the plan routes one ("mean" and "sum"), else empty tensors. Each
    gradient is the engine's buffer, unscaled and in the dtype the eager backward scales it in
    (:func:`orda_tp.engine.fused.unit_gradients`), not yet cast to its input's dtype."""
    recipe = _RECIPES[index]
    differentiable = [student_hidden, weight, bias, teacher_0, teacher_1, teacher_2]
    routing = _routing(recipe, requires, differentiable)
    # "none" defers its gradients to the backward operator: the forward forms none.
    needs = [need and routing.plan.reduction != "none" for need in routing.needs]
    _, outputs = _on_leaves(recipe, needs, differentiable, labels, token_weights, num_valid_tokens)
    buffers = unit_gradients(outputs[0]) if any(needs) else ()
    return [*(output.detach() for output in outputs), *_by_place(buffers, routing.places, student_hidden)]


@_loss_op.register_fake
def _loss_fake(
    index: int,
    requires: list[bool],
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    token_weights: Tensor | None,
    num_valid_tokens: Tensor | None,
    teacher_0: Tensor | None,
    teacher_1: Tensor | None,
    teacher_2: Tensor | None,
) -> list[Tensor]:
    differentiable = [student_hidden, weight, bias, teacher_0, teacher_1, teacher_2]
    routing = _routing(_RECIPES[index], requires, differentiable)
    plan, head = routing.plan, routing.head
    dtype = statistics_dtype(*differentiable)
    if plan.reduction == "mean" and num_valid_tokens is not None:
        dtype = torch.promote_types(dtype, num_valid_tokens.dtype)  # the 0-d sum ÷ the given 0-d N, as torch promotes
    shape = (labels.shape[0],) if plan.reduction == "none" else ()
    outputs = [student_hidden.new_empty(shape, dtype=dtype) for _ in range(LOSS_OUTPUTS)]
    buffers: Sequence[Tensor | None] = ()
    if plan.reduction != "none" and any(routing.needs):
        # The buffers the engine allocates (its own rule, on fake tensors), whose shapes and dtypes the
        # gradients have; one device: unsharded; the zeroed rows (last argument) do not matter here.
        needs = GradNeeds(*(place is not None and routing.needs[place] for place in routing.places))
        accumulation = plan.config.grad_weight_accumulation
        buffers = allocate_buffers(head, needs, False, statistics_dtype(*head), accumulation, head.weight.shape[0])
    return [*outputs, *_by_place(buffers, routing.places, student_hidden)]


@torch.library.custom_op("orda_tp::distillation_loss_backward", mutates_args=(), tags=_ANY_STRIDES)
def _loss_backward_op(
    index: int,
    needs: list[bool],
    grad_loss: Tensor,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    token_weights: Tensor | None,
    num_valid_tokens: Tensor | None,
    teacher_0: Tensor | None,
    teacher_1: Tensor | None,
    teacher_2: Tensor | None,
) -> list[Tensor]:
    """The gradients of a "none" call for its (rows,) upstream ``grad_loss``, in the forward
    operator's order, empty where ``needs`` says none: the call run again, its statistics
    recomputed, and its deferred backward."""
    differentiable = [student_hidden, weight, bias, teacher_0, teacher_1, teacher_2]
    leaves, outputs = _on_leaves(_RECIPES[index], needs, differentiable, labels, token_weights, num_valid_tokens)
    wanted = [leaf for leaf, need in zip(leaves, needs) if need and leaf is not None]
    found = iter(torch.autograd.grad(outputs[0], wanted, grad_loss, materialize_grads=True) if wanted else ())
    # Contiguous, as the fake implementation declares them.
    return [
        next(found).contiguous() if need and t is not None else student_hidden.new_empty(0)
        for t, need in zip(differentiable, needs)
    ]


@_loss_backward_op.register_fake
def _loss_backward_fake(
    index: int,
    needs: list[bool],
    grad_loss: Tensor,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    token_weights: Tensor | None,
    num_valid_tokens: Tensor | None,
    teacher_0: Tensor | None,
    teacher_1: Tensor | None,
    teacher_2: Tensor | None,
) -> list[Tensor]:
    return _fake_gradients(needs, [student_hidden, weight, bias, teacher_0, teacher_1, teacher_2])


@torch.library.custom_op("orda_tp::scale_by_upstream", mutates_args=())
def _scale_op(gradients: list[Tensor], grad_loss: Tensor) -> list[Tensor]:
    """Contiguous copies of ``gradients`` scaled by the 0-d upstream ``grad_loss`` in their own
    dtypes, by the eager backward's own arithmetic (``scale_by_upstream``, a Triton kernel on CUDA)."""
    # Copies: the saved gradients stay those of a unit upstream gradient, for a repeated backward.
    scaled = [gradient.clone(memory_format=torch.contiguous_format) for gradient in gradients]
    scale_by_upstream(scaled, grad_loss)
    return scaled


@_scale_op.register_fake
def _scale_fake(gradients: list[Tensor], grad_loss: Tensor) -> list[Tensor]:
    return [gradient.new_empty(gradient.shape) for gradient in gradients]


class _LossContext(FunctionCtx):
    """What the operator's autograd keeps (annotations only)."""

    index: int
    needs: list[bool]
    eager: bool
    dtypes: list[torch.dtype | None]
    # Annotated here: torch declares saved_tensors on its C base class alone.
    saved_tensors: tuple[Tensor | None, ...]


def _setup_context(ctx: _LossContext, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
    index, requires, student_hidden, weight, labels, bias, token_weights, num_valid_tokens, *slots = inputs
    differentiable = [student_hidden, weight, bias, *slots]
    routing = _routing(_RECIPES[index], requires, differentiable)
    ctx.index, ctx.needs, ctx.eager = index, routing.needs, routing.plan.reduction != "none"
    ctx.dtypes = [None if t is None else t.dtype for t in differentiable]
    # An eager call keeps its gradients (a repeated backward scales them again) in their buffers' dtypes (fp32: a
    # bias's, an fp16 head's), as the eager engine holds its buffers on its context until backward; "none" its inputs.
    saved = output[LOSS_OUTPUTS:] if ctx.eager else [*differentiable, labels, token_weights, num_valid_tokens]
    ctx.save_for_backward(*saved)
    ctx.mark_non_differentiable(*output[1:])  # the components are reports; only the loss has a gradient


def _backward(ctx: _LossContext, grads: list[Tensor]) -> tuple[Tensor | None, ...]:
    """The gradients of ``(student_hidden, weight, labels, bias, token_weights, num_valid_tokens,
    *slots)`` from the loss's upstream gradient (the components have none)."""
    grad_loss, saved = grads[0], ctx.saved_tensors
    if ctx.eager:
        wanted = [g for g, need in zip(saved, ctx.needs) if need and g is not None]
        scaled = iter(torch.ops.orda_tp.scale_by_upstream(wanted, grad_loss))
        # As the eager backward: scaled in the buffer's dtype, then cast once to the input's.
        gradients = [
            next(scaled).to(dtype) if need and g is not None and dtype is not None else None
            for g, need, dtype in zip(saved, ctx.needs, ctx.dtypes)
        ]
    else:
        student_hidden, weight, bias, slot_0, slot_1, slot_2, labels, token_weights, num_valid_tokens = saved
        assert student_hidden is not None and weight is not None and labels is not None
        recomputed = torch.ops.orda_tp.distillation_loss_backward(
            ctx.index, ctx.needs, grad_loss, student_hidden, weight, labels, bias, token_weights, num_valid_tokens,
            slot_0, slot_1, slot_2,
        )  # fmt: skip
        gradients = [g if need else None for g, need in zip(recomputed, ctx.needs)]
    grad_hidden, grad_weight, grad_bias, *grad_slots = gradients
    return (None, None, grad_hidden, grad_weight, None, grad_bias, None, None, *grad_slots)


_loss_op.register_autograd(_backward, setup_context=_setup_context)


def traced_loss(
    run: Runner,
    options: LossOptions | None,
    keywords: dict[str, Any],
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: object,
    num_valid_tokens: object,
    token_weights: Tensor | None,
    bias: Tensor | None,
) -> list[Tensor] | None:
    """Under dynamo: ``(loss, *COMPONENTS)`` of the call as the operator, or None where the
    operator does not cover it (the caller then runs it eagerly, behind a graph break). ``run``:
    the door's eager path; ``options``, or None with the function door's ``keywords``."""
    if isinstance(teacher, TeacherHead):  # its module's weight and bias; FSDP2 holds sharded ones as DTensors
        teacher = SeparateTeacher(teacher.hidden, *head_parameters(teacher.head))
    # A group is read before the recipe: dynamo would not hand a process group to recipe_index as a constant.
    group = keywords.get("tp_group") if options is None else options.tp_group
    if group is not None or not isinstance(teacher, COVERED_TEACHERS):
        return None
    if any(isinstance(value, Tensor) for value in keywords.values()):
        return None
    specs = [spec for spec in fields(teacher) if spec.init]
    names = tuple(spec.name for spec in specs if isinstance(getattr(teacher, spec.name), Tensor))
    settings = tuple((spec.name, getattr(teacher, spec.name)) for spec in specs if spec.name not in names)
    held: list[Tensor | None] = [getattr(teacher, name) for name in names]
    given = [student_hidden, weight, labels, bias, token_weights, num_valid_tokens, *held]
    if len(held) > TEACHER_SLOTS or any(isinstance(t, DTensor) for t in given):
        return None
    denominator = num_valid_tokens if isinstance(num_valid_tokens, Tensor) else None
    number = None if denominator is not None else num_valid_tokens
    index = recipe_index(run, options, type(teacher), settings, names, number, **keywords)
    if index < 0:
        return None
    slots = held + [None] * (TEACHER_SLOTS - len(held))
    grad_on = torch.is_grad_enabled()
    requires = [grad_on and t is not None and t.requires_grad for t in (student_hidden, weight, bias, *slots)]
    outputs = torch.ops.orda_tp.distillation_loss(
        index, requires, student_hidden, weight, labels, bias, token_weights, denominator, *slots
    )
    return outputs[:LOSS_OUTPUTS]
