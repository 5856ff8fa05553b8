"""Fault injection for the checks of a tensor-parallel call (tests/test_fault_injection.py).

A :class:`Fault` makes one check fail: it edits a good call (:class:`Call`, this rank's shard of
one small problem) on the ranks it is injected on. :func:`fault_worker` runs every fault twice on
a gloo group, injected on every rank and on one rank only, and records what each rank raised
(type, message, and where the check that failed raised it, following ``__cause__`` to the
failing rank's own error). :func:`one_device_outcome` runs the same fault on the whole problem on
one device, the error a user without tensor parallelism gets. The test asserts that every rank
raised the same error, that it names the argument, and that every ``raise`` of the checks' modules
was reached by some fault (or is exempt, with the reason).

Four front doors: ``distillation_loss`` ("fused", with each teacher kind), ``KDLoss`` ("kd"),
``flash_ce_kd_loss`` ("flash") and ``DistillationHead`` under ``VocabParallel`` ("head").
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import orda_tp
from orda_tp import KernelConfig, PrecomputedTeacher, SeparateTeacher, TeacherMixture, TiedTeacher

from .distributed import note

ROWS, HIDDEN, TEACHER_HIDDEN, VOCAB, TOPK = 12, 6, 5, 23, 4  # 23 columns: uneven over 2 and 3 ranks
PACKAGE = Path(orda_tp.__file__).parent
CASE_TIMEOUT = timedelta(seconds=15)  # a rank left waiting in a case's collective fails after it


def chunk_columns(rank: int, world: int) -> tuple[int, int]:
    size = -(-VOCAB // world)
    start = min(rank * size, VOCAB)
    return start, min(start + size, VOCAB)


@dataclass(frozen=True)
class Tensors:
    """The whole problem, the same on every rank (fixed seed)."""

    hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher_hidden: Tensor  # tied
    separate_hidden: Tensor
    teacher_weight: Tensor
    logits: Tensor
    topk_ids: Tensor
    topk_logprobs: Tensor
    token_weights: Tensor


def make_tensors() -> Tensors:
    g = torch.Generator().manual_seed(7)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    labels[::5] = -100
    teacher_weight = randn(VOCAB, TEACHER_HIDDEN)
    separate_hidden = randn(ROWS, TEACHER_HIDDEN)
    logits = separate_hidden @ teacher_weight.T
    top = torch.log_softmax(logits, -1).topk(TOPK)
    return Tensors(
        hidden=randn(ROWS, HIDDEN),
        weight=randn(VOCAB, HIDDEN) / HIDDEN**0.5,
        labels=labels,
        teacher_hidden=randn(ROWS, HIDDEN),
        separate_hidden=separate_hidden,
        teacher_weight=teacher_weight,
        logits=logits,
        topk_ids=top.indices,
        topk_logprobs=top.values,
        token_weights=torch.rand(ROWS, generator=g, dtype=torch.float64),
    )


@dataclass(frozen=True)
class Call:
    """One call of a front door on this rank's tensors. ``teacher``: the kind ("tied",
    "separate", "logits", "hidden_cache", "topk", or for "kd" "tensor"); ``after_build(teacher)``
    may change a built descriptor (an in-place edit, ``prepare_logits``); ``teacher_object``
    replaces the descriptor altogether."""

    door: str
    teacher: str
    hidden: Any
    weight: Any
    labels: Any
    teacher_hidden: Any = None
    teacher_weight: Any = None
    logits: Any = None
    topk_ids: Any = None
    topk_logprobs: Any = None
    tail: str = "uniform"
    keywords: dict[str, Any] = field(default_factory=dict)
    forward_keywords: dict[str, Any] = field(default_factory=dict)
    after_build: Callable[[Any], Any] | None = None
    teacher_object: Any = None
    # A "mixture" teacher's: its teachers (None: a TiedTeacher and a logits cache), weights and combine mode.
    members: Any = None
    mixture_weights: Any = (0.5, 0.5)
    combine: str = "log_probabilities"
    mesh: Any = None  # the 1-D mesh of DTensor faults (None: plain shards and tp_group)
    rank: int = 0
    world: int = 1

    def with_keywords(self, **keywords: Any) -> Call:
        return replace(self, keywords={**self.keywords, **keywords})

    def with_forward(self, **keywords: Any) -> Call:
        return replace(self, forward_keywords={**self.forward_keywords, **keywords})


def base_call(door: str, teacher: str, rank: int, world: int) -> Call:
    """The good call of ``door`` with ``teacher`` on rank ``rank`` of ``world`` (1: one device,
    the whole head)."""
    return replace(_base_call(door, teacher, rank, world), rank=rank, world=world)


_MESH: list[Any] = []  # the world's 1-D device mesh, made by every rank at the start


def _mesh() -> Any:
    return _MESH[0]


def _base_call(door: str, teacher: str, rank: int, world: int) -> Call:
    t = make_tensors()
    start, stop = chunk_columns(rank, world)
    weight, teacher_weight, logits = t.weight[start:stop], t.teacher_weight[start:stop], t.logits[:, start:stop]
    if door == "fused":
        hidden, teacher_hidden = t.hidden, t.teacher_hidden
        if teacher in ("separate", "hidden_cache"):
            teacher_hidden = t.separate_hidden
        return Call(
            door,
            teacher,
            hidden.clone().requires_grad_(),
            weight.clone().requires_grad_(),
            t.labels.clone(),
            teacher_hidden=teacher_hidden.clone(),
            teacher_weight=teacher_weight.clone(),
            logits=logits.clone(),
            topk_ids=t.topk_ids.clone(),
            topk_logprobs=t.topk_logprobs.clone(),
            keywords={"kl_weight": 1.0, "backend": "torch", "teacher_ce_weight": 0.0},
        )
    student_logits = (t.hidden @ t.weight.T)[:, start:stop].clone()
    if door == "kd":
        return Call(
            door,
            teacher,
            None,
            None,
            t.labels.clone(),
            logits=student_logits.requires_grad_(),
            teacher_hidden=logits.clone(),  # the teacher's logits shard
            topk_ids=t.topk_ids.clone(),
            topk_logprobs=t.topk_logprobs.clone(),
            keywords={"backend": "torch"},
        )
    if door == "flash":
        labels = t.labels.clone()
        labels[labels == -100] = -1  # flash_kd's ignore_index
        return Call(
            door,
            "separate",
            None,
            teacher_weight.clone(),
            labels,
            logits=student_logits,
            teacher_hidden=t.separate_hidden.clone(),
            keywords={"backend": "torch"},
        )
    assert door == "head"
    return Call(
        door,
        teacher,
        t.hidden.clone().view(3, ROWS // 3, HIDDEN).requires_grad_(),
        t.weight.clone(),  # the full head: VocabParallel shards it
        t.labels.clone().view(3, ROWS // 3),
        teacher_hidden=t.teacher_hidden.clone(),
        keywords={"kl_weight": 1.0, "backend": "torch", "teacher_ce_weight": 0.0},
    )


def _descriptor(call: Call) -> Any:
    if call.teacher_object is not None:
        return call.teacher_object
    kind = call.teacher
    if kind == "tied":
        teacher: Any = TiedTeacher(call.teacher_hidden)
    elif kind == "separate":
        teacher = SeparateTeacher(call.teacher_hidden, call.teacher_weight)
    elif kind == "logits":
        teacher = PrecomputedTeacher(logits=call.logits)
    elif kind == "mixture":
        members = call.members
        if members is None:
            members = [TiedTeacher(call.teacher_hidden), PrecomputedTeacher(logits=call.logits)]
        teacher = TeacherMixture(members, call.mixture_weights, call.combine)
    elif kind == "hidden_cache":
        teacher = PrecomputedTeacher(teacher_hidden=call.teacher_hidden, teacher_weight=call.teacher_weight)
    else:
        assert kind == "topk"
        teacher = PrecomputedTeacher(topk_ids=call.topk_ids, topk_logprobs=call.topk_logprobs, tail=call.tail)
    return teacher if call.after_build is None else call.after_build(teacher)


def run_call(call: Call, group: dist.ProcessGroup | None) -> Any:
    """The call, on ``group`` (None: one device); returns what it returned."""
    tp = {} if group is None or call.mesh is not None else {"tp_group": group}
    if call.door == "fused":
        loss = orda_tp.distillation_loss(
            call.hidden, call.weight, call.labels, _descriptor(call), **call.keywords, **tp, **call.forward_keywords
        )
        loss.loss.backward()
        return loss.loss.detach()
    if call.door == "kd":
        kd = orda_tp.KDLoss(**call.keywords, **tp)
        teacher = call.teacher_hidden if call.teacher == "tensor" else _descriptor(call)
        return kd(call.logits, teacher, call.labels, **call.forward_keywords)
    if call.door == "flash":
        return orda_tp.flash_ce_kd_loss(
            call.logits, call.teacher_hidden, call.weight, call.labels, **call.keywords, **tp
        )
    assert call.door == "head"
    head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, **call.keywords)
    with torch.no_grad():
        head.weight.copy_(call.weight)
    if group is not None:
        parallelize_module(head, _mesh(), orda_tp.VocabParallel())
    teacher = _descriptor(call) if call.teacher != "none" else None
    kwargs = dict(call.forward_keywords)
    if teacher is not None:
        kwargs.setdefault("teacher", teacher)
    out = head(call.hidden, **({"labels": call.labels} if "labels" not in kwargs else {}), **kwargs)
    return out.loss.detach()


# ---------------------------------------------------------------------------------- the faults


Edit = Callable[[Call], Call]


@dataclass(frozen=True)
class Fault:
    """``edit`` applied on the ranks the fault is injected on makes a check fail, and the error
    must name ``argument``. ``base``: an edit of every rank's call first (e.g. explicit vocabulary
    ranges). ``one_device``: whether the fault has a form on one device (the whole problem, no
    group); ``one_rank``: whether it can be injected on one rank only (False where the faulty rank
    names no group, so it cannot know that the others wait for it); ``fails_on_all``: whether it
    is a fault when every rank makes it (False for a setting that is only wrong when the ranks
    differ); ``on_group``: whether it has a form on a group (False for a keyword that needs
    ``tp_group`` given without it)."""

    name: str
    door: str
    teacher: str
    edit: Edit
    argument: str
    one_device: bool = True
    one_rank: bool = True
    fails_on_all: bool = True
    base: Edit | None = None
    on_group: bool = True


def _kw(**keywords: Any) -> Edit:
    return lambda call: call.with_keywords(**keywords)


def _fw(**keywords: Any) -> Edit:
    return lambda call: call.with_forward(**keywords)


def _set(**values: Any) -> Edit:
    return lambda call: replace(call, **values)


def _labels(fn: Callable[[Tensor], Any]) -> Edit:
    return lambda call: replace(call, labels=fn(call.labels.clone()))


def _label_at(value: int) -> Callable[[Tensor], Tensor]:
    def edit(labels: Tensor) -> Tensor:
        labels.view(-1)[1] = value
        return labels

    return edit


def _token_weights(value: Any) -> Edit:
    return _fw(token_weights=value)


def _nan_at(name: str, row: int = 2, column: int = 1) -> Edit:
    def edit(call: Call) -> Call:
        tensor = getattr(call, name).detach().clone()
        tensor[row, column] = math.nan
        return replace(call, **{name: tensor})

    return edit


def _modified_in_place(teacher: PrecomputedTeacher) -> PrecomputedTeacher:
    for _, tensor in teacher.named_tensors():
        tensor.add_(0.0)  # bumps the version counter
    return teacher


def _topk_edit(fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> Edit:
    def edit(call: Call) -> Call:
        ids, logprobs = fn(call.topk_ids.clone(), call.topk_logprobs.clone())
        return replace(call, topk_ids=ids, topk_logprobs=logprobs)

    return edit


def _ids_out_of_range(ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
    ids[1, 0] = VOCAB + 5
    return ids, logprobs


def _ids_repeated(ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
    ids[1, 1] = ids[1, 0]
    return ids, logprobs


def _positive_logprob(ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
    logprobs[1, 0] = 0.5
    return ids, logprobs


def _too_much_mass(ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
    logprobs[1, :] = math.log(0.4)
    return ids, logprobs


def _ranges(call: Call) -> Call:
    return call.with_keywords(vocab_range=chunk_columns(call.rank, call.world))


def _shifted_range(shift: int) -> Edit:
    def edit(call: Call) -> Call:
        start, stop = call.keywords["vocab_range"]
        return call.with_keywords(vocab_range=(start + shift, stop + shift))

    return edit


def _transposed_weight(call: Call) -> Call:
    return replace(call, weight=call.weight.detach().T.contiguous().requires_grad_())


def _bias(make: Callable[[int], Tensor]) -> Edit:
    """A ``bias=`` made from the number of this rank's head rows."""
    return lambda call: call.with_forward(bias=make(call.weight.shape[0]))


def _meta(name: str) -> Edit:
    return lambda call: replace(call, **{name: getattr(call, name).detach().to("meta")})


def _prepared_shard(teacher: PrecomputedTeacher) -> PrecomputedTeacher:
    return teacher.prepare_logits(torch.float32)


def _dtensor(hidden_placement: Any = None, **keywords: Any) -> Edit:
    """The head as a Shard(0) DTensor on a 1-D mesh (hidden Replicate unless given), no tp_group."""

    def edit(call: Call) -> Call:
        mesh = _mesh()
        weight = DTensor.from_local(call.weight.detach(), mesh, [Shard(0)], run_check=False).requires_grad_()
        placement = [Replicate()] if hidden_placement is None else hidden_placement
        hidden = DTensor.from_local(call.hidden.detach(), mesh, placement, run_check=False).requires_grad_()
        return replace(call, hidden=hidden, weight=weight, mesh=mesh).with_keywords(**keywords)

    return edit


def _then(*edits: Edit) -> Edit:
    def edit(call: Call) -> Call:
        for step in edits:
            call = step(call)
        return call

    return edit


def _teacher_dtensor(placement: Any) -> Edit:
    def edit(call: Call) -> Call:
        hidden = DTensor.from_local(call.teacher_hidden, call.mesh, placement, run_check=False)
        return replace(call, teacher_hidden=hidden)

    return edit


def _kd_dtensor_logits(student: Any, teacher: Any = None) -> Edit:
    """KDLoss on DTensor logits (``student`` placement), the teacher's as ``teacher`` placement
    (None: a plain tensor); no tp_group."""

    def edit(call: Call) -> Call:
        mesh = _mesh()
        logits = DTensor.from_local(call.logits.detach(), mesh, student, run_check=False)
        teacher_logits = call.teacher_hidden
        if teacher is not None:
            teacher_logits = DTensor.from_local(teacher_logits, mesh, teacher, run_check=False)
        return replace(call, logits=logits, teacher_hidden=teacher_logits, mesh=mesh)

    return edit


def _flash_weight_dtensor(call: Call) -> Call:
    mesh = _mesh()
    logits = DTensor.from_local(call.logits, mesh, [Shard(1)], run_check=False)
    weight = DTensor.from_local(call.weight, mesh, [Replicate()], run_check=False)
    return replace(call, logits=logits, weight=weight, mesh=mesh)


FUSED_FAULTS = [
    # types, shapes and devices (checks.check_inputs and its helpers)
    Fault("hidden not a tensor", "fused", "tied", _set(hidden=[[0.0]]), "student_hidden"),
    Fault("integer weight", "fused", "tied", lambda c: replace(c, weight=c.weight.detach().long()), "weight"),
    Fault("3-D hidden", "fused", "tied", lambda c: replace(c, hidden=c.hidden.detach()[None]), "student_hidden"),
    Fault("labels not a tensor", "fused", "tied", lambda c: replace(c, labels=c.labels.tolist()), "labels"),
    Fault("float labels", "fused", "tied", _labels(lambda labels: labels.float()), "labels"),
    Fault("int32 labels", "fused", "tied", _labels(lambda labels: labels.int()), "labels"),
    Fault("labels of another length", "fused", "tied", _labels(lambda labels: labels[:-1]), "labels"),
    Fault(
        "weight of another hidden size",
        "fused",
        "tied",
        lambda c: replace(c, weight=c.weight.detach()[:, :-1]),
        "weight",
    ),
    Fault("transposed weight", "fused", "tied", _transposed_weight, "transposed"),
    Fault("teacher hidden on another device", "fused", "tied", _meta("teacher_hidden"), "teacher.hidden"),
    Fault(
        "teacher hidden of another width",
        "fused",
        "tied",
        lambda c: replace(c, teacher_hidden=c.teacher_hidden[:, :-1]),
        "teacher.hidden",
    ),
    Fault("vocab_size beyond the head", "fused", "tied", _kw(vocab_size=VOCAB + 1), "vocab_size"),
    Fault("vocab_range without tp_group", "fused", "tied", _kw(vocab_range=(0, VOCAB)), "tp_group", on_group=False),
    Fault(
        "sequence_parallel without tp_group", "fused", "tied", _kw(sequence_parallel=True), "tp_group", on_group=False
    ),
    # keywords (options.LossOptions, checked on every rank)
    Fault("negative temperature", "fused", "tied", _kw(kl_temperature=-1.0), "kl_temperature"),
    Fault("unknown reduction", "fused", "tied", _kw(reduction="avg"), "reduction"),
    Fault("ignore_index not an int", "fused", "tied", _kw(ignore_index="x"), "ignore_index"),
    Fault("ignore_index beyond int64", "fused", "tied", _kw(ignore_index=2**70), "ignore_index"),
    Fault("unknown divergence", "fused", "tied", _kw(kl_divergence="kl"), "kl_divergence"),
    Fault(
        "scale of two elements",
        "fused",
        "tied",
        _kw(gradient_materialization_scale=torch.ones(2)),
        "gradient_materialization_scale",
    ),
    Fault("grad_scaler not a scaler", "fused", "tied", _kw(grad_scaler="scaler"), "grad_scaler"),
    Fault("unknown profile", "fused", "tied", _kw(profile="turbo"), "profile"),
    Fault("config not a KernelConfig", "fused", "tied", _kw(config={"vocab_block": 8}), "config"),
    Fault("label_smoothing of 1", "fused", "tied", _kw(label_smoothing=1.0), "label_smoothing"),
    Fault("logit_scale of 0", "fused", "tied", _kw(logit_scale=0.0), "logit_scale"),
    Fault("infinite teacher_logit_scale", "fused", "tied", _kw(teacher_logit_scale=math.inf), "teacher_logit_scale"),
    Fault(
        "mutual with another teacher temperature",
        "fused",
        "tied",
        _kw(kl_divergence="mutual", kl_teacher_temperature=2.0),
        "kl_teacher_temperature",
    ),
    Fault("vocab_range reversed", "fused", "tied", _kw(vocab_range=(5, 2)), "vocab_range"),
    Fault("vocab_size of 0", "fused", "tied", _kw(vocab_size=0), "vocab_size"),
    Fault("sequence_parallel not a bool", "fused", "tied", _kw(sequence_parallel="yes"), "sequence_parallel"),
    Fault("alpha out of range", "fused", "tied", _kw(kl_divergence="alpha_divergence", kl_alpha=1.5), "kl_alpha"),
    Fault("beta not a number", "fused", "tied", _kw(kl_divergence="skew_forward", kl_beta="half"), "kl_beta"),
    Fault("TRL's beta above 1", "fused", "tied", _kw(kl_divergence="generalized_jsd", kl_beta=1.5), "kl_beta"),
    Fault(
        "TRL's beta below 1 − β's resolution",
        "fused",
        "tied",
        _kw(kl_divergence="generalized_jsd", kl_beta=1e-17),
        "kl_beta",
    ),
    Fault("student_entropy not a bool", "fused", "tied", _kw(student_entropy="yes"), "student_entropy"),
    Fault(
        "student_entropy on some rank",
        "fused",
        "tied",
        _kw(student_entropy=True),
        "student_entropy",
        one_device=False,
        fails_on_all=False,
    ),
    Fault("renyi order of 1", "fused", "tied", _kw(kl_divergence="renyi", kl_alpha=1.0), "kl_alpha"),
    Fault(
        "entropy gate not an EntropyGate",
        "fused",
        "tied",
        _kw(kl_divergence="entropy_adaptive", entropy_gate=0.5),
        "entropy_gate",
    ),
    Fault(
        "other keywords on some rank",
        "fused",
        "tied",
        _kw(kl_temperature=2.0),
        "kl_temperature",
        one_device=False,
        fails_on_all=False,
    ),
    Fault("backend reference under tp_group", "fused", "tied", _kw(backend="reference"), "backend", one_device=False),
    Fault("backend triton on the CPU", "fused", "tied", _kw(backend="triton"), "triton"),
    # per-call arguments
    Fault(
        "num_valid_tokens with reduction sum",
        "fused",
        "tied",
        _then(_kw(reduction="sum"), _fw(num_valid_tokens=4)),
        "num_valid_tokens",
    ),
    Fault("num_valid_tokens of two elements", "fused", "tied", _fw(num_valid_tokens=torch.ones(2)), "num_valid_tokens"),
    Fault(
        "num_valid_tokens on another device",
        "fused",
        "tied",
        _fw(num_valid_tokens=torch.ones((), device="meta")),
        "num_valid_tokens",
    ),
    Fault("num_valid_tokens a string", "fused", "tied", _fw(num_valid_tokens="8"), "num_valid_tokens"),
    Fault("num_valid_tokens negative", "fused", "tied", _fw(num_valid_tokens=-1.0), "num_valid_tokens"),
    Fault(
        "integer token_weights", "fused", "tied", _token_weights(torch.ones(ROWS, dtype=torch.long)), "token_weights"
    ),
    Fault(
        "token_weights of another length",
        "fused",
        "tied",
        _token_weights(torch.ones(ROWS - 1, dtype=torch.float64)),
        "token_weights",
    ),
    Fault(
        "token_weights on another device",
        "fused",
        "tied",
        _token_weights(torch.ones(ROWS, device="meta")),
        "token_weights",
    ),
    Fault(
        "token_weights that require grad",
        "fused",
        "tied",
        _token_weights(torch.ones(ROWS, requires_grad=True)),
        "token_weights",
    ),
    Fault(
        "NaN in token_weights",
        "fused",
        "tied",
        _token_weights(torch.tensor([1.0, math.nan] * (ROWS // 2))),
        "token_weights",
    ),
    Fault("teacher not a descriptor", "fused", "tied", _set(teacher_object=torch.zeros(1)), "teacher"),
    Fault("bias of another length", "fused", "tied", _bias(lambda rows: torch.zeros(rows + 1)), "bias"),
    Fault("2-D bias", "fused", "tied", _bias(lambda rows: torch.zeros(rows, 1)), "bias"),
    Fault("integer bias", "fused", "tied", _bias(lambda rows: torch.zeros(rows, dtype=torch.long)), "bias"),
    Fault("bias on another device", "fused", "tied", _bias(lambda rows: torch.zeros(rows, device="meta")), "bias"),
    Fault(
        "the whole bias beside a head shard", "fused", "tied", _fw(bias=torch.zeros(VOCAB)), "bias", one_device=False
    ),
    Fault(
        "separate teacher bias one entry short",
        "fused",
        "separate",
        lambda c: replace(
            c, teacher_object=SeparateTeacher(c.teacher_hidden, c.teacher_weight, c.teacher_weight[1:, 0])
        ),
        "teacher.bias",
    ),
    # values
    Fault("label beyond the vocabulary", "fused", "tied", _labels(_label_at(VOCAB + 3)), "labels"),
    Fault("negative label", "fused", "tied", _labels(_label_at(-7)), "labels"),
    Fault(
        "NaN in a hidden state (check_finite_inputs)",
        "fused",
        "tied",
        _nan_at("hidden"),
        "student_hidden",
        base=_kw(config=KernelConfig(check_finite_inputs=True)),
    ),
    Fault(
        "NaN in the bias (check_finite_inputs)",
        "fused",
        "tied",
        _bias(lambda rows: torch.zeros(rows).index_fill_(0, torch.tensor([2]), math.nan)),
        "bias",
        base=_kw(config=KernelConfig(check_finite_inputs=True)),
    ),
    # teachers
    Fault(
        "TiedTeacher.mode against the weights",
        "fused",
        "tied",
        _set(after_build=lambda t: TiedTeacher(t.hidden, mode="frozen")),
        "mode",
        base=_kw(teacher_ce_weight=1.0),
    ),
    Fault(
        "separate teacher head shard one row short",
        "fused",
        "separate",
        lambda c: replace(c, teacher_weight=c.teacher_weight[:-1]),
        "teacher",
        one_device=True,
    ),
    Fault(
        "cached logits of another width",
        "fused",
        "logits",
        lambda c: replace(c, logits=c.logits[:, :-1].clone()),
        "teacher",
    ),
    Fault("NaN in cached logits", "fused", "logits", _nan_at("logits"), "teacher.logits"),
    Fault("cache modified in place", "fused", "logits", _set(after_build=_modified_in_place), "PrecomputedTeacher"),
    Fault(
        "a shard's rows shifted by prepare_logits",
        "fused",
        "logits",
        _set(after_build=_prepared_shard),
        "prepare_logits",
        one_device=False,
    ),
    Fault(
        "NaN in a cached teacher's hidden states", "fused", "hidden_cache", _nan_at("teacher_hidden"), "teacher_hidden"
    ),
    Fault("mutual with a cache", "fused", "logits", _kw(kl_divergence="mutual"), "mutual"),
    Fault(
        "tempered cache with teacher CE",
        "fused",
        "logits",
        _then(_set(after_build=lambda t: replace(t, logits_temperature=2.0)), _kw(teacher_ce_weight=1.0)),
        "teacher_ce_weight",
    ),
    Fault(
        "tempered cache with another temperature",
        "fused",
        "logits",
        _then(_set(after_build=lambda t: replace(t, logits_temperature=2.0)), _kw(kl_teacher_temperature=3.0)),
        "kl_teacher_temperature",
    ),
    Fault(
        "teacher soft-cap on cached logits", "fused", "logits", _kw(teacher_logit_softcap=5.0), "teacher_logit_softcap"
    ),
    Fault(
        "teacher logit scale on cached logits", "fused", "logits", _kw(teacher_logit_scale=2.0), "teacher_logit_scale"
    ),
    Fault("tied teacher with a scale of its own", "fused", "tied", _kw(teacher_logit_scale=2.0), "teacher_logit_scale"),
    Fault(
        "renormalized top-k with reverse KL",
        "fused",
        "topk",
        _then(_set(tail="renormalize"), _kw(kl_divergence="reverse")),
        "renormalize",
    ),
    Fault(
        "renormalized top-k with teacher CE",
        "fused",
        "topk",
        _then(_set(tail="renormalize"), _kw(teacher_ce_weight=1.0)),
        "teacher_ce_weight",
    ),
    Fault("top-k cache made at 1 read at 2", "fused", "topk", _kw(kl_temperature=2.0), "temperature"),
    Fault(
        "top-k cache made at 2 with teacher CE",
        "fused",
        "topk",
        _then(
            _set(after_build=lambda t: replace(t, topk_temperature=2.0)), _kw(kl_temperature=2.0, teacher_ce_weight=1.0)
        ),
        "teacher_ce_weight",
    ),
    Fault(
        "teacher soft-cap other than a top-k cache's",
        "fused",
        "topk",
        _then(_set(after_build=lambda t: replace(t, topk_softcap=5.0)), _kw(teacher_logit_softcap=4.0)),
        "teacher_logit_softcap",
    ),
    Fault("top-k id beyond the vocabulary", "fused", "topk", _topk_edit(_ids_out_of_range), "topk_ids"),
    Fault("top-k id twice in a row", "fused", "topk", _topk_edit(_ids_repeated), "topk_ids"),
    Fault("positive top-k log-probability", "fused", "topk", _topk_edit(_positive_logprob), "topk_logprobs"),
    Fault("top-k mass over 1", "fused", "topk", _topk_edit(_too_much_mass), "topk_logprobs"),
    Fault(
        "entropy_adaptive on one column",
        "fused",
        "tied",
        _then(_kw(kl_divergence="entropy_adaptive", vocab_size=1), _labels(lambda labels: labels.fill_(-100))),
        "entropy_adaptive",
        one_rank=True,
    ),
    # the tensor-parallel layout (checked from every rank's claim)
    Fault(
        "vocab_size differs",
        "fused",
        "tied",
        _kw(vocab_size=VOCAB - 1),
        "vocab_size",
        one_device=False,
        fails_on_all=False,
    ),
    Fault("vocab_size beyond every shard", "fused", "tied", _kw(vocab_size=VOCAB + 4), "vocab_size", one_device=False),
    Fault(
        "vocab_range on one rank only",
        "fused",
        "tied",
        lambda c: c.with_keywords(vocab_range=chunk_columns(c.rank, c.world)),
        "vocab_range",
        one_device=False,
        fails_on_all=False,
    ),
    Fault(
        "vocab_range wider than the shard",
        "fused",
        "tied",
        lambda c: c.with_keywords(vocab_range=(c.keywords["vocab_range"][0], c.keywords["vocab_range"][1] + 1)),
        "vocab_range",
        one_device=False,
        base=_ranges,
    ),
    Fault(
        "vocab_range leaving a gap", "fused", "tied", _shifted_range(1), "vocab_range", one_device=False, base=_ranges
    ),
    Fault(
        "vocab_range overlapping", "fused", "tied", _shifted_range(-1), "vocab_range", one_device=False, base=_ranges
    ),
    # DTensor inputs
    Fault(
        "DTensor hidden beside a plain head",
        "fused",
        "tied",
        lambda c: replace(c, hidden=DTensor.from_local(c.hidden.detach(), _mesh(), [Replicate()], run_check=False)),
        "weight is not",
        one_device=False,
    ),
    Fault(
        "DTensor head sharded on dim 1",
        "fused",
        "tied",
        _then(
            _dtensor(),
            lambda c: replace(c, weight=DTensor.from_local(c.weight.to_local(), c.mesh, [Shard(1)], run_check=False)),
        ),
        "weight",
        one_device=False,
    ),
    Fault(
        "vocab_range against a DTensor head",
        "fused",
        "tied",
        _dtensor(vocab_range=(0, 1)),
        "vocab_range",
        one_device=False,
    ),
    Fault(
        "sequence_parallel=False with Shard(0) hidden",
        "fused",
        "tied",
        _dtensor([Shard(0)], sequence_parallel=False),
        "sequence_parallel",
        one_device=False,
    ),
    Fault(
        "hidden DTensor of another placement", "fused", "tied", _dtensor([Shard(1)]), "student_hidden", one_device=False
    ),
    Fault(
        "teacher hidden Shard(0) beside Replicate",
        "fused",
        "tied",
        _then(_dtensor(), _teacher_dtensor([Shard(0)])),
        "teacher",
        one_device=False,
    ),
    Fault(
        "DTensor bias beside a plain head",
        "fused",
        "tied",
        lambda c: c.with_forward(
            bias=DTensor.from_local(c.weight[:, 0].detach(), _mesh(), [Shard(0)], run_check=False)
        ),
        "bias",
        one_device=False,
    ),
    Fault(
        "Replicate bias beside a Shard(0) head",
        "fused",
        "tied",
        _then(
            _dtensor(),
            lambda c: c.with_forward(
                bias=DTensor.from_local(c.weight.to_local()[:, 0].detach(), c.mesh, [Replicate()], run_check=False)
            ),
        ),
        "bias",
        one_device=False,
    ),
]

KD_FAULTS = [
    Fault(
        "kd 0-d logits",
        "kd",
        "tensor",
        lambda c: replace(c, logits=c.logits.detach()[0, 0], teacher_hidden=c.teacher_hidden[0, 0]),
        "student_logits",
    ),
    Fault(
        "kd teacher logits of another shape",
        "kd",
        "tensor",
        lambda c: replace(c, teacher_hidden=c.teacher_hidden[:-1]),
        "teacher_logits",
    ),
    Fault("kd float labels", "kd", "tensor", _labels(lambda labels: labels.float()), "labels"),
    Fault(
        "kd label beyond the vocabulary",
        "kd",
        "tensor",
        _labels(_label_at(VOCAB + 3)),
        "labels",
        base=_kw(kl_divergence="dkd"),
    ),
    Fault(
        "kd num_batch_labels of two elements",
        "kd",
        "tensor",
        lambda c: c.with_forward(num_batch_labels=torch.ones(2)),
        "num_batch_labels",
    ),
    Fault(
        "kd num_batch_labels on another device",
        "kd",
        "tensor",
        lambda c: c.with_forward(num_batch_labels=torch.ones((), device="meta")),
        "num_batch_labels",
    ),
    Fault(
        "kd num_batch_labels a string",
        "kd",
        "tensor",
        lambda c: c.with_forward(num_batch_labels="8"),
        "num_batch_labels",
    ),
    Fault("kd num_batch_labels of 0", "kd", "tensor", lambda c: c.with_forward(num_batch_labels=0), "num_batch_labels"),
    Fault(
        "kd NaN in token_weights",
        "kd",
        "tensor",
        _token_weights(torch.tensor([1.0, math.nan] * (ROWS // 2))),
        "token_weights",
    ),
    Fault(
        "kd a logits cache",
        "kd",
        "tensor",
        lambda c: replace(c, teacher="logits", teacher_object=PrecomputedTeacher(logits=c.teacher_hidden)),
        "KDLoss",
    ),
    Fault("kd top-k rows short", "kd", "topk", _topk_edit(lambda ids, lp: (ids[:-1], lp[:-1])), "topk_ids"),
    Fault(
        "kd renormalized top-k with reverse KL",
        "kd",
        "topk",
        _then(_set(tail="renormalize"), _kw(kl_divergence="reverse")),
        "renormalize",
    ),
    Fault("kd top-k id beyond the vocabulary", "kd", "topk", _topk_edit(_ids_out_of_range), "topk_ids"),
    Fault(
        "kd other keywords on some rank",
        "kd",
        "tensor",
        _kw(temperature=2.0),
        "temperature",
        one_device=False,
        fails_on_all=False,
    ),
    Fault(
        "kd tp_group beside replicated DTensor logits",
        "kd",
        "tensor",
        _then(_kd_dtensor_logits([Replicate()]), _set(mesh=None)),
        "tp_group",
        one_device=False,
    ),
    Fault(
        "kd DTensor logits of an unhandled placement",
        "kd",
        "tensor",
        _kd_dtensor_logits([Partial()], None),
        "student_logits",
        one_device=False,
    ),
    Fault(
        "kd teacher DTensor beside plain logits",
        "kd",
        "tensor",
        lambda c: replace(c, teacher_hidden=DTensor.from_local(c.teacher_hidden, _mesh(), [Shard(1)], run_check=False)),
        "teacher_logits",
        one_device=False,
    ),
    Fault(
        "kd teacher DTensor of another placement",
        "kd",
        "tensor",
        _kd_dtensor_logits([Shard(1)], [Shard(0)]),
        "teacher_logits",
        one_device=False,
    ),
]

FLASH_FAULTS = [
    Fault("flash negative temperature", "flash", "separate", _kw(temperature=-1.0), "temperature"),
    Fault("flash upcast not a bool", "flash", "separate", _kw(upcast="yes"), "upcast"),
    Fault("flash chunk_size of 0", "flash", "separate", _kw(chunk_size=0), "chunk_size"),
    Fault("flash tp_group not a group", "flash", "separate", _kw(tp_group="group"), "tp_group", one_rank=False),
    Fault("flash unknown backend", "flash", "separate", _kw(backend="reference"), "backend"),
    Fault(
        "flash teacher hidden rows short",
        "flash",
        "separate",
        lambda c: replace(c, teacher_hidden=c.teacher_hidden[:-1]),
        "teacher_hidden",
    ),
    Fault(
        "flash head of another width",
        "flash",
        "separate",
        lambda c: replace(c, weight=c.weight[:, :-1]),
        "teacher_lm_head_weight",
    ),
    Fault("flash label beyond the vocabulary", "flash", "separate", _labels(_label_at(VOCAB + 3)), "labels"),
    Fault(
        "flash head DTensor not Shard(0)",
        "flash",
        "separate",
        _flash_weight_dtensor,
        "teacher_lm_head_weight",
        one_device=False,
    ),
]

HEAD_FAULTS = [
    Fault(
        "head hidden of another width",
        "head",
        "tied",
        lambda c: replace(c, hidden=c.hidden.detach()[..., :-1]),
        "in_features",
    ),
    Fault("head labels of another shape", "head", "tied", _labels(lambda labels: labels[:, :-1]), "labels"),
    Fault("head float labels", "head", "tied", _labels(lambda labels: labels.float()), "labels"),
    Fault("head no teacher for a KL", "head", "tied", _set(teacher="none"), "teacher"),
    Fault("head teacher without labels", "head", "tied", _fw(labels=None), "labels"),
    Fault("head negative num_valid_tokens", "head", "tied", _fw(num_valid_tokens=-2.0), "num_valid_tokens"),
    Fault("head label beyond the vocabulary", "head", "tied", _labels(_label_at(VOCAB + 3)), "labels"),
    # Raised while the head is built, before any group is known: injected on every rank only.
    Fault("head misspelled keyword", "head", "tied", _kw(kl_temprature=2.0), "kl_temprature", one_rank=False),
]


def _members(make: Callable[[Call], list[Any]]) -> Edit:
    return lambda call: replace(call, members=make(call))


def _weights(value: Any, combine: str = "log_probabilities") -> Edit:
    return lambda call: replace(call, mixture_weights=value, combine=combine)


def _cache_modified_after_build(call: Call) -> list[Any]:
    cache = PrecomputedTeacher(logits=call.logits)
    call.logits.add_(1.0)
    return [TiedTeacher(call.teacher_hidden), cache]


def _row_weights(fill: float, **at: float) -> Any:
    weights = torch.full((ROWS, 2), fill, dtype=torch.float64)
    for value in at.values():
        weights[3, 1] = value
    return weights


# A TeacherMixture's checks, on one device and on every rank of a group.
MIXTURE_FAULTS = [
    Fault(
        "mixture of no teacher", "fused", "mixture", _members(lambda c: []), "TeacherMixture.teachers", on_group=False
    ),
    Fault(
        "mixture holding a tensor",
        "fused",
        "mixture",
        _members(lambda c: [c.teacher_hidden]),
        "TeacherMixture.teachers[0]",
    ),
    Fault(
        "mixture of a mixture",
        "fused",
        "mixture",
        _members(lambda c: [TeacherMixture([TiedTeacher(c.teacher_hidden)], [1.0])]),
        "TeacherMixture.teachers[0]",
    ),
    Fault(
        "mixture combine unknown", "fused", "mixture", _set(combine="mean"), "TeacherMixture.combine", on_group=False
    ),
    Fault("mixture weights count", "fused", "mixture", _weights((1.0,)), "TeacherMixture.weights"),
    Fault(
        "mixture weight a string", "fused", "mixture", _weights(("a", 1.0)), "TeacherMixture.weights[0]", on_group=False
    ),
    Fault(
        "mixture integer weights",
        "fused",
        "mixture",
        _weights(torch.ones(ROWS, 2, dtype=torch.long)),
        "TeacherMixture.weights",
    ),
    Fault(
        "mixture weights of another shape",
        "fused",
        "mixture",
        _weights(torch.ones(ROWS - 1, 2, dtype=torch.float64)),
        "TeacherMixture.weights",
    ),
    Fault(
        "mixture weights requiring grad",
        "fused",
        "mixture",
        _weights(torch.ones(ROWS, 2, dtype=torch.float64, requires_grad=True)),
        "TeacherMixture.weights",
    ),
    Fault(
        "mixture negative weight",
        "fused",
        "mixture",
        _weights((-0.5, 1.5)),
        "TeacherMixture.weights[0]",
    ),
    Fault(
        "mixture NaN row weight",
        "fused",
        "mixture",
        _weights(_row_weights(0.5, nan=math.nan)),
        "TeacherMixture.weights[3, 1]",
    ),
    Fault(
        "mixture weights all zero", "fused", "mixture", _weights((0.0, 0.0)), "TeacherMixture.weights", on_group=False
    ),
    Fault(
        "mixture probabilities numbers not summing to 1",
        "fused",
        "mixture",
        _weights((0.5, 0.6), "probabilities"),
        "TeacherMixture.weights sums to",
    ),
    Fault(
        "mixture probabilities not summing to 1",
        "fused",
        "mixture",
        _weights(_row_weights(0.5, off=0.6), "probabilities"),
        "TeacherMixture.weights[3]",
    ),
    Fault(
        "mixture trained tied teacher",
        "fused",
        "mixture",
        _members(lambda c: [TiedTeacher(c.teacher_hidden, mode="trained"), PrecomputedTeacher(logits=c.logits)]),
        "TeacherMixture.teachers[0]",
        one_rank=False,  # on one rank alone: the settings handshake names the differing mode
    ),
    Fault("mixture teacher CE", "fused", "mixture", _kw(teacher_ce_weight=1.0), "teacher_ce_weight"),
    Fault(
        "mixture co-training variant", "fused", "mixture", _kw(kl_divergence="mutual"), "kl_divergence", on_group=False
    ),
    Fault(
        "mixture vocabularies differ",
        "fused",
        "mixture",
        _members(lambda c: [TiedTeacher(c.teacher_hidden), PrecomputedTeacher(logits=c.logits[:, :-1])]),
        "teacher.teachers[1].logits",
        on_group=False,  # a shard's columns: "mixture vocabularies differ on a shard"
    ),
    Fault(
        "mixture tied scale", "fused", "mixture", _kw(teacher_logit_scale=2.0), "teacher_logit_scale", on_group=False
    ),
    Fault(
        "mixture capped logits cache",
        "fused",
        "mixture",
        _kw(teacher_logit_softcap=3.0),
        "TeacherMixture.teachers[1]",
        one_rank=False,  # on one rank alone: the settings handshake names the differing keyword
    ),
    Fault(
        "mixture cache modified in place",
        "fused",
        "mixture",
        _members(_cache_modified_after_build),
        "modified in place",
    ),
    Fault(
        "mixture vocabularies differ on a shard",
        "fused",
        "mixture",
        _members(
            lambda c: [
                SeparateTeacher(c.teacher_hidden[:, :TEACHER_HIDDEN], c.teacher_weight),
                PrecomputedTeacher(logits=c.logits[:, :-1].contiguous()),
            ]
        ),
        "TeacherMixture.teachers[1]",
        one_device=False,
    ),
]

ALL_FAULTS = FUSED_FAULTS + KD_FAULTS + FLASH_FAULTS + HEAD_FAULTS + MIXTURE_FAULTS
FAULTS = {fault.name: fault for fault in ALL_FAULTS}
assert len(FAULTS) == len(ALL_FAULTS), "fault names are unique"


# ------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Outcome:
    """What a call raised: the error's type and message, and the raise sites of it and of its
    causes as ``(path under orda_tp/, line)``; empty type when nothing was raised."""

    type: str
    message: str
    sites: tuple[tuple[str, int], ...] = ()


def _sites(error: BaseException) -> tuple[tuple[str, int], ...]:
    sites = []
    seen: BaseException | None = error
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__)
        for frame in reversed(frames):
            path = Path(frame.filename)
            if PACKAGE in path.parents:
                sites.append((str(path.relative_to(PACKAGE)), frame.lineno or 0))
                break
        seen = seen.__cause__
    return tuple(sites)


def outcome_of(fault: Fault, rank: int, world: int, group: dist.ProcessGroup | None, injected: bool) -> Outcome:
    call = base_call(fault.door, fault.teacher, rank, world)
    try:
        if fault.base is not None:
            call = fault.base(call)
        if injected:
            call = fault.edit(call)
        run_call(call, group)
    except (ValueError, TypeError) as error:
        return Outcome(type(error).__name__, str(error), _sites(error))
    except Exception as error:  # noqa: BLE001 - a raw error (a gloo error, a shape error) is what the test reports
        return Outcome(f"unexpected {type(error).__name__}", str(error), _sites(error))
    return Outcome("", "")


def one_device_outcome(name: str) -> Outcome:
    """The fault on the whole problem on one device."""
    return outcome_of(FAULTS[name], 0, 1, None, True)


def fault_worker(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Outcome]]:
    """Per fault: this rank's outcome injected on every rank ("all") and on the last rank only
    ("one"), each on a process group of its own (so that a rank left waiting fails that case
    alone, after ``CASE_TIMEOUT``); then a good call on the world group, which must equal one
    device's (no collective was left half-done)."""
    results: dict[str, dict[str, Outcome]] = {}
    for name in names:
        fault = FAULTS[name]
        if not fault.on_group:
            continue
        results[name] = {}
        for where in ("all", "one") if fault.one_rank else ("all",):
            note(f"{name} ({where})")
            group = dist.new_group(timeout=CASE_TIMEOUT)
            _MESH[:] = [DeviceMesh.from_group(group, "cpu")]
            injected = where == "all" or rank == world - 1
            results[name][where] = outcome_of(fault, rank, world, group, injected)
    note("good call after the faults")
    good = run_call(base_call("fused", "tied", rank, world), dist.group.WORLD)
    expected = run_call(base_call("fused", "tied", 0, 1), None)
    results["good call"] = {"all": Outcome("", f"{float((good - expected).abs()):.3e}")}
    return results
