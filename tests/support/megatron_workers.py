"""Worker bodies of tests/test_megatron.py: real megatron-core GPTModels, tensor parallel over 2
gloo ranks on the CPU, with orda_tp's distillation head installed.

- :func:`cross_entropy_worker`: with ``kl_weight=0`` the installed model's ``[b, s]`` losses and
  every parameter's gradient equal those of the same model before installation (Megatron's own
  ``vocab_parallel_cross_entropy``), tied and untied, with and without sequence parallelism; the
  parameters, state dicts, hooks and logits are unchanged by the installation.
- :func:`distillation_worker`: fp64 models, a frozen teacher GPTModel and cached teacher logits,
  a padded vocabulary; losses, components and the output layer's weight and input gradients
  against textbook formulas on the gathered full tensors (fp64, ≤ 1e-12 relative).
- :func:`error_worker`: every error the adapter raises, on every rank.

Megatron-core assumes CUDA in a few places that its CPU path reaches; :func:`megatron_on_cpu`
works around them for the tests (see there). Workers return a list of mismatch descriptions
(empty when everything agrees), or plain data the test asserts on.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import initialize_rng_tracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from torch import Tensor, nn

from orda_tp.integrations.megatron import install_distillation_head

from .distributed import note

TP = 2
BATCH, SEQ = 3, 8  # b ≠ s: a [b, s] / [s, b] mix-up changes shapes, and the comparisons see it
FP32_TOLERANCE = 1e-5
FP64_TOLERANCE = 1e-12


# ---------------------------------------------------------------------------- Megatron on the CPU


@contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Megatron's model-parallel state for TP = 2 on this gloo world, runnable on the CPU.

    Two CUDA assumptions of megatron-core 0.16.1 are worked around: the attention's RNG tracker
    forks CUDA generator states (the inference tracker forks nothing; dropout is 0 here), and
    the sequence-parallel collectives and attention buffers allocate on
    ``torch.cuda.current_device()`` (answered with the CPU device in this process).
    """
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment, return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = current_device
        parallel_state.destroy_model_parallel()


class CpuLayerNorm(nn.LayerNorm):
    """torch's LayerNorm with Megatron's norm constructor. Megatron's own torch fallback refuses
    sequence parallelism (its parameters then need the ``sequence_parallel`` gradient all-reduce
    that Megatron's finalize step does); these tests compare gradients per rank, so it is marked
    and left at that."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for parameter in self.parameters():
            parameter.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ModelSpec:
    """A tiny GPTModel. ``vocab`` is the padded vocabulary (divisible by TP)."""

    hidden: int = 16
    heads: int = 2
    layers: int = 1
    vocab: int = 64
    tied: bool = True
    sequence_parallel: bool = False
    dtype: torch.dtype = torch.float32
    seed: int = 0
    pre_process: bool = True
    post_process: bool = True


def build_gpt(spec: ModelSpec) -> GPTModel:
    """``GPTModel`` on ``get_gpt_layer_local_spec()`` (with :class:`CpuLayerNorm`), CPU init."""
    torch.manual_seed(spec.seed)
    config = TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        tensor_model_parallel_size=TP,
        sequence_parallel=spec.sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=spec.dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    layer = get_gpt_layer_local_spec()
    norms = {"input_layernorm": CpuLayerNorm, "pre_mlp_layernorm": CpuLayerNorm}
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, **norms))
    block = TransformerBlockSubmodules(layer_specs=[layer] * spec.layers, layer_norm=CpuLayerNorm)
    model = GPTModel(
        config,
        block,
        vocab_size=spec.vocab,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=spec.tied,
        pre_process=spec.pre_process,
        post_process=spec.post_process,
    )
    return model.to(spec.dtype)  # the position embeddings ignore params_dtype


@dataclass(frozen=True)
class Batch:
    """Megatron's batch: ``tokens``, ``labels``, ``loss_mask`` [b, s] (identical on every rank)."""

    tokens: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    loss_mask: Tensor

    def inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.tokens, self.position_ids, self.attention_mask


def make_batch(vocab_size: int, seed: int = 1) -> Batch:
    """Random tokens and labels below ``vocab_size``; a few positions with ``loss_mask == 0``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[0, :3] = 0
    loss_mask[2, -1] = 0
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().logical_not()[None, None]
    return Batch(tokens, torch.arange(SEQ).expand(BATCH, SEQ), causal, labels, loss_mask)


def tp_group() -> dist.ProcessGroup:
    return parallel_state.get_tensor_model_parallel_group()


def gather(tensor: Tensor, dim: int) -> Tensor:
    """The tensor-parallel ranks' tensors concatenated along ``dim`` (shards → full)."""
    parts = [torch.empty_like(tensor) for _ in range(TP)]
    dist.all_gather(parts, tensor.contiguous(), group=tp_group())
    return torch.cat(parts, dim=dim)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    difference = (actual.double() - expected.double()).norm()
    return (difference / expected.double().norm().clamp_min(1e-300)).item()


def expect_close(problems: list[str], what: str, actual: Tensor, expected: Tensor, tolerance: float) -> None:
    if actual.shape != expected.shape:
        problems.append(f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}")
        return
    error = relative_error(actual, expected)
    if not error <= tolerance:
        problems.append(f"{what}: relative error {error:.3e} > {tolerance:.0e}")


def same_on_every_rank(problems: list[str], what: str, tensor: Tensor) -> None:
    """Every tensor-parallel rank holds this tensor bitwise."""
    if not torch.equal(gather(tensor.unsqueeze(0), 0), tensor.unsqueeze(0).expand(TP, *tensor.shape)):
        problems.append(f"{what} differs between ranks")


@dataclass
class HeadCapture:
    """What an output layer received in its last call: ``hidden`` [s(/tp), b, h] and ``weight``
    [V/tp, h]. With gradients, the weight reaches the layer through an alias, so that
    ``weight.grad`` is the head's gradient alone (a tied parameter's ``.grad`` adds the embedding's)."""

    hidden: Tensor | None = None
    weight: Tensor | None = None


def capture_head(layer: nn.Module) -> HeadCapture:
    """Record the inputs of every call of ``layer`` (a forward pre-hook, registered for good)."""
    capture = HeadCapture()

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        hidden, weight = args[0], kwargs.get("weight")
        if weight is None:
            weight = module.weight
        if torch.is_grad_enabled():
            weight = weight.view_as(weight)
            weight.retain_grad()
            hidden.retain_grad()
        capture.hidden, capture.weight = hidden, weight
        return args, {**kwargs, "weight": weight}

    layer.register_forward_pre_hook(hook, with_kwargs=True)
    return capture


# ------------------------------------------------------------------ (a) CE only against Megatron


def cross_entropy_worker(rank: int, world_size: int) -> list[str]:
    """kl_weight=0: losses and gradients equal Megatron's own cross entropy (fp32)."""
    problems: list[str] = []
    with megatron_on_cpu():
        for sequence_parallel in (False, True):
            for tied in (True, False):
                case = f"sequence_parallel={sequence_parallel} tied={tied}"
                note(f"cross entropy: {case}")
                spec = ModelSpec(tied=tied, sequence_parallel=sequence_parallel)
                problems += [f"{case}: {p}" for p in _compare_with_megatron(build_gpt(spec), make_batch(spec.vocab))]
    return problems


def _megatron_step(model: nn.Module, batch: Batch, **extra: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """Megatron's ``[b, s]`` losses and every parameter's gradient of ``loss_func``'s sum."""
    model.zero_grad(set_to_none=True)
    losses = model(*batch.inputs(), labels=batch.labels, loss_mask=batch.loss_mask, **extra)
    (losses * batch.loss_mask).sum().backward()
    return losses.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _compare_with_megatron(model: GPTModel, batch: Batch) -> list[str]:
    """Install on ``model`` and compare with its own uninstalled results."""
    problems: list[str] = []
    expected_losses, expected_grads = _megatron_step(model, batch)
    with torch.no_grad():
        logits = model(*batch.inputs())
    parameters = list(model.named_parameters())
    state = {key: value.clone() if isinstance(value, Tensor) else value for key, value in model.state_dict().items()}
    sharded_keys = sorted(model.sharded_state_dict().keys())
    calls: list[str] = []
    model.register_forward_hook(lambda *_: calls.append("model"))
    model.output_layer.register_forward_hook(lambda *_: calls.append("output_layer"))

    install_distillation_head(model, vocab_size=model.vocab_size)

    losses, grads = _megatron_step(model, batch)
    if calls != ["output_layer", "model"]:
        problems.append(f"forward hooks (registered before installing) ran {calls}, expected output_layer, model")
    valid = batch.loss_mask.bool()
    expect_close(problems, "losses where loss_mask == 1", losses[valid], expected_losses[valid], FP32_TOLERANCE)
    if losses.shape != expected_losses.shape or not torch.all(losses[~valid] == 0):
        problems.append(f"losses: shape {list(losses.shape)}, or nonzero where loss_mask == 0")
    if not losses.is_contiguous():
        problems.append("losses are not contiguous (Megatron's loss_func views them)")
    if sorted(grads) != sorted(expected_grads):
        problems.append(f"parameters with a gradient: {sorted(grads)}, expected {sorted(expected_grads)}")
    for name in sorted(set(grads) & set(expected_grads)):
        expect_close(problems, f"{name}.grad", grads[name], expected_grads[name], FP32_TOLERANCE)
    with torch.no_grad():
        if not torch.equal(model(*batch.inputs()), logits):
            problems.append("logits without labels changed")
    if [(n, id(p)) for n, p in model.named_parameters()] != [(n, id(p)) for n, p in parameters]:
        problems.append("named_parameters changed")
    after = model.state_dict()
    if sorted(after) != sorted(state) or any(
        not torch.equal(after[key], value) for key, value in state.items() if isinstance(value, Tensor)
    ):
        problems.append("state_dict changed")
    if sorted(model.sharded_state_dict().keys()) != sharded_keys:
        problems.append("sharded_state_dict keys changed")
    return problems


# --------------------------------------------------------- (b, c) KD against the fp64 reference


@dataclass(frozen=True)
class KdCase:
    """One installation: the loss keywords, the teacher source ("model", "cache" or None)."""

    name: str
    options: dict[str, Any]
    teacher: str | None


REAL_VOCAB = 60  # of 64 padded columns: rank 1 holds the 4 padding columns
KD_CASES = (
    KdCase("teacher model, forward KL", {"kl_weight": 0.7, "kl_temperature": 2.0}, "model"),
    KdCase(
        "teacher model, reverse KL and teacher CE",
        {
            "student_ce_weight": 0.8,
            "teacher_ce_weight": 0.3,
            "kl_weight": 0.5,
            "kl_temperature": 1.5,
            "kl_divergence": "reverse",
        },
        "model",
    ),  # fmt: skip
    KdCase("cached logits (padding columns poisoned), forward KL", {"kl_weight": 0.7, "kl_temperature": 2.0}, "cache"),
    KdCase("student CE only", {}, None),
)


def distillation_worker(rank: int, world_size: int) -> list[str]:
    """Every KD case, with and without sequence parallelism, against the fp64 reference."""
    problems: list[str] = []
    with megatron_on_cpu():
        for sequence_parallel in (False, True):
            student = build_gpt(ModelSpec(sequence_parallel=sequence_parallel, dtype=torch.float64, tied=True))
            teacher = build_gpt(
                ModelSpec(hidden=24, sequence_parallel=sequence_parallel, dtype=torch.float64, tied=False, seed=7)
            )
            batch = make_batch(REAL_VOCAB)
            student_head, teacher_head = capture_head(student.output_layer), capture_head(teacher.output_layer)
            with torch.no_grad():
                cache = teacher(*batch.inputs())  # GPTModel's own output: [b, s, V_padded/tp]
            teacher_logits = full_logits(teacher_head, sequence_parallel)
            # The cache is the teacher's logits, batch first, this rank's vocabulary columns.
            expect_close(problems, "cache layout", gather(cache, 2).transpose(0, 1), teacher_logits, FP64_TOLERANCE)
            for case in KD_CASES:
                label = f"sequence_parallel={sequence_parallel}, {case.name}"
                note(f"distillation: {label}")
                found = _distillation_case(rank, case, student, teacher, batch, cache, student_head, teacher_logits)
                if case.teacher == "model":  # the teacher ran inside the student's forward, on its inputs
                    inside = full_logits(teacher_head, sequence_parallel)
                    expect_close(found, "teacher logits", inside, teacher_logits, FP64_TOLERANCE)
                problems += [f"{label}: {p}" for p in found]
            if any(p.grad is not None for p in teacher.parameters()):
                problems.append(f"sequence_parallel={sequence_parallel}: a teacher parameter received a gradient")
    return problems


def full_logits(head: HeadCapture, sequence_parallel: bool) -> Tensor:
    """``[s, b, V_padded]`` logits from a capture's gathered hidden states and weight."""
    assert head.hidden is not None and head.weight is not None
    hidden = head.hidden.detach()
    return (gather(hidden, 0) if sequence_parallel else hidden) @ gather(head.weight.detach(), 0).T


def _poisoned(cache: Tensor, rank: int) -> Tensor:
    """The cache with large values in its padding columns: they must get no probability."""
    poisoned = cache.clone()
    start = rank * cache.shape[-1]
    poisoned[..., max(REAL_VOCAB - start, 0) :] = 30.0
    return poisoned


def _distillation_case(
    rank: int,
    case: KdCase,
    student: GPTModel,
    teacher: GPTModel,
    batch: Batch,
    cache: Tensor,
    student_head: HeadCapture,
    teacher_logits: Tensor,
) -> list[str]:
    """Install ``case`` on the student, run forward and backward (a random upstream gradient
    per position), compare with the reference on the gathered head."""
    problems: list[str] = []
    install_distillation_head(
        student, vocab_size=REAL_VOCAB, teacher=teacher if case.teacher == "model" else None, **case.options
    )
    extra = {"teacher_logits": _poisoned(cache, rank)} if case.teacher == "cache" else {}
    student.zero_grad(set_to_none=True)
    out = student(*batch.inputs(), labels=batch.labels, loss_mask=batch.loss_mask, return_components=True, **extra)
    upstream = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out.loss * upstream).sum().backward()

    assert student_head.hidden is not None and student_head.weight is not None
    sequence_parallel = student.config.sequence_parallel
    hidden = student_head.hidden.detach()
    hidden = (gather(hidden, 0) if sequence_parallel else hidden).requires_grad_()
    weight = gather(student_head.weight.detach(), 0).requires_grad_()
    expected = reference_losses(hidden @ weight.T, teacher_logits if case.teacher else None, batch, case.options)
    (expected.loss * upstream).sum().backward()

    for field in ("loss", "student_ce", "teacher_ce", "kl"):
        value = getattr(out, field).detach()
        expect_close(problems, field, value, getattr(expected, field).detach(), FP64_TOLERANCE)
        same_on_every_rank(problems, field, value)
    assert hidden.grad is not None and weight.grad is not None
    rows = hidden.shape[0] // TP
    expected_hidden_grad = hidden.grad[rank * rows : (rank + 1) * rows] if sequence_parallel else hidden.grad
    expect_close(
        problems, "output layer input gradient", student_head.hidden.grad, expected_hidden_grad, FP64_TOLERANCE
    )
    shard = student_head.weight.shape[0]
    expected_weight_grad = weight.grad[rank * shard : (rank + 1) * shard]
    expect_close(
        problems, "output layer weight gradient", student_head.weight.grad, expected_weight_grad, FP64_TOLERANCE
    )
    return problems


@dataclass(frozen=True)
class ReferenceLosses:
    """Textbook per-position terms, [b, s], 0 where loss_mask == 0."""

    loss: Tensor
    student_ce: Tensor
    teacher_ce: Tensor
    kl: Tensor


def reference_losses(
    student_logits: Tensor, teacher_logits: Tensor | None, batch: Batch, options: dict[str, Any]
) -> ReferenceLosses:
    """``w_s·CE(s) + w_t·CE(t) + w_kl·T²·KL`` on ``[s, b, V_padded]`` logits, over the real
    vocabulary only: ``CE(x) = logsumexp(x) − x_y``; forward ``KL(q‖p)``, reverse ``KL(p‖q)``
    with ``p = softmax(s/T)``, ``q = softmax(t/T)``."""
    labels = batch.labels.T  # [s, b] like the logits
    valid = batch.loss_mask.T.bool()
    s = student_logits[..., :REAL_VOCAB]

    def cross_entropy(logits: Tensor) -> Tensor:
        return torch.logsumexp(logits, -1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    zero = torch.zeros_like(s[..., 0])
    student_ce = cross_entropy(s)
    teacher_ce, kl = zero, zero
    if teacher_logits is not None:
        t = teacher_logits[..., :REAL_VOCAB]
        temperature = options.get("kl_temperature", 1.0)
        log_p, log_q = torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1)
        if options.get("kl_divergence", "forward") == "forward":
            kl = temperature**2 * (log_q.exp() * (log_q - log_p)).sum(-1)
        else:
            kl = temperature**2 * (log_p.exp() * (log_p - log_q)).sum(-1)
        teacher_ce = cross_entropy(t)
    loss = (
        options.get("student_ce_weight", 1.0) * student_ce
        + options.get("teacher_ce_weight", 0.0) * teacher_ce
        + options.get("kl_weight", 0.0) * kl
    )
    weights = options.get("teacher_ce_weight", 0.0), options.get("kl_weight", 0.0)
    terms = (loss, student_ce, teacher_ce if weights[0] > 0 else zero, kl if weights[1] > 0 else zero)
    return ReferenceLosses(*(torch.where(valid, term, 0.0).T for term in terms))


# ------------------------------------------------------------------------------------ (d) errors


def error_worker(rank: int, world_size: int) -> dict[str, str]:
    """Each scenario's error as ``"Type: message"`` (``"no error"`` when none was raised)."""
    outcomes: dict[str, str] = {}
    with megatron_on_cpu():
        for name, scenario in _error_scenarios().items():
            note(f"error scenario {name}")
            try:
                scenario()
                outcomes[name] = "no error"
            except Exception as error:  # noqa: BLE001 - the test compares every rank's errors
                outcomes[name] = f"{type(error).__name__}: {error}"
    return outcomes


def _installed(teacher: GPTModel | None = None, **options: Any) -> GPTModel:
    model = build_gpt(ModelSpec())
    return install_distillation_head(model, vocab_size=64, teacher=teacher, **options)  # type: ignore[return-value]


def _with_config(model: GPTModel, **changes: Any) -> GPTModel:
    """``model`` reading a copy of its config with ``changes`` (settings Megatron's CPU path
    cannot build with)."""
    config = copy.copy(model.config)
    for key, value in changes.items():
        setattr(config, key, value)
    model.config = config
    return model


class ChangedPostprocessGPTModel(GPTModel):
    """A GPTModel whose postprocessing wraps the loss (as a future megatron-core might)."""

    def _postprocess(self, *args: Any, **kwargs: Any) -> Any:
        return {"loss": super()._postprocess(*args, **kwargs)}


def _forward(model: GPTModel, batch: Batch | None = None, **kwargs: Any) -> Any:
    batch = batch or make_batch(64)
    kwargs.setdefault("labels", batch.labels)
    kwargs.setdefault("loss_mask", batch.loss_mask)
    return model(*batch.inputs(), **kwargs)


def _error_scenarios() -> dict[str, Callable[[], Any]]:
    batch = make_batch(64)
    cache = torch.randn(BATCH, SEQ, 32)
    on_rank_1 = dist.get_rank() == 1  # a fault on one rank only: the other ranks' call is good

    def changed_megatron() -> Any:
        model = build_gpt(ModelSpec())
        model.__class__ = ChangedPostprocessGPTModel
        install_distillation_head(model, vocab_size=64)
        return _forward(model)

    return {
        "not a GPTModel": lambda: install_distillation_head(nn.Linear(2, 2), vocab_size=2),
        "no output layer": lambda: install_distillation_head(build_gpt(ModelSpec(post_process=False)), vocab_size=64),
        "multi-token prediction": lambda: install_distillation_head(
            _with_config(build_gpt(ModelSpec()), mtp_num_layers=1), vocab_size=64
        ),
        "deferred embedding wgrad": lambda: install_distillation_head(
            _with_config(build_gpt(ModelSpec()), defer_embedding_wgrad_compute=True), vocab_size=64
        ),
        "vocab_size above the padded vocabulary": lambda: _installed_with_vocab(65),
        "reserved keyword": lambda: _installed(reduction="mean"),
        "unknown keyword": lambda: _installed(kl_wieght=1.0),
        "teacher with another padded vocabulary": lambda: _installed(build_gpt(ModelSpec(vocab=128)), kl_weight=1.0),
        "teacher with sequence parallelism": lambda: _installed(
            build_gpt(ModelSpec(sequence_parallel=True)), kl_weight=1.0
        ),
        "teacher without embeddings": lambda: _installed(build_gpt(ModelSpec(pre_process=False)), kl_weight=1.0),
        "teacher co-trained": lambda: _installed(build_gpt(ModelSpec(seed=3)), kl_weight=1.0, kl_divergence="mutual"),
        "KL without a teacher": lambda: _forward(_installed(kl_weight=1.0)),
        "two teachers": lambda: _forward(_installed(build_gpt(ModelSpec(seed=3)), kl_weight=1.0), teacher_logits=cache),
        "teacher_logits not a tensor": lambda: _forward(_installed(kl_weight=1.0), teacher_logits=cache.tolist()),
        "teacher_logits without labels": lambda: _installed(kl_weight=1.0)(*batch.inputs(), teacher_logits=cache),
        "teacher_logits [s, b, V/tp]": lambda: _forward(
            _installed(kl_weight=1.0), teacher_logits=cache.transpose(0, 1).contiguous()
        ),
        "teacher_logits of the full vocabulary": lambda: _forward(
            _installed(kl_weight=1.0), teacher_logits=torch.randn(BATCH, SEQ, 64)
        ),
        "two teachers on rank 1 only": lambda: _forward(
            _installed(build_gpt(ModelSpec(seed=3)), kl_weight=1.0), **({"teacher_logits": cache} if on_rank_1 else {})
        ),
        "labels [s, b] on rank 1 only": lambda: _forward(
            _installed(), labels=batch.labels.T.contiguous() if on_rank_1 else batch.labels, loss_mask=None
        ),
        "labels [s, b]": lambda: _forward(_installed(), labels=batch.labels.T.contiguous(), loss_mask=None),
        "loss_mask of another shape": lambda: _forward(_installed(), loss_mask=batch.loss_mask[:, :-1]),
        "megatron-core changed _postprocess": changed_megatron,
    }


def _installed_with_vocab(vocab_size: int) -> GPTModel:
    return install_distillation_head(build_gpt(ModelSpec()), vocab_size=vocab_size)  # type: ignore[return-value]
