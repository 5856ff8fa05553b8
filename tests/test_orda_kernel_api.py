"""orda-kernel 0.1.0's remaining API surface (guide §11): each form it accepts is accepted here.

- ``KernelConfig``'s orda-kernel fields: the loss-keyword overrides win over the call's keywords
  (as there); ``num_chunks`` / ``max_chunks`` set the row layout; ``max_fused_size``,
  ``autotune``, ``refresh_autotune`` are checked and ignored with one ``IgnoredArgumentWarning``;
  ``None`` for ``chunk_size``, ``grad_weight_accumulation``, ``assume_valid_labels``.
- ``ChunkSize.nrows(n)``, ``.dynamic()``, ``.fast()`` beside ``ChunkSize(nrows=..., ...)``.
- ``PrecomputedTeacher(trust_cache_immutability=...)`` (an inference-mode cache) and
  ``PrecomputedTeacher.prepare_logits(dtype)``, also on a tensor-parallel group.
- ``CrossVocabTeacher``, ``reset_autotune_cache``, ``begin_autotune_run``.

Reference numbers marked "orda-kernel" were computed by running orda-kernel 0.1.0 itself (its
``backend="torch"``, CPU, torch 2.13.0, in a separate virtual environment) on the inputs built by
:func:`inputs` / :func:`span_inputs` below, with the call shown next to each number.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import orda_tp
from orda_tp import (
    AlignedLikelihoodConfig,
    AlignedSpanPairs,
    ChunkSize,
    CrossVocabTeacher,
    DistillationLoss,
    EntropyGate,
    IgnoredArgumentWarning,
    KernelConfig,
    PrecomputedTeacher,
    SeparateTeacher,
    TiedTeacher,
    aligned_span_distillation_loss,
    build_precomputed_span_teacher,
    distillation_loss,
)
from orda_tp.arguments.orda_kernel import LOSS_OVERRIDES, apply_loss_overrides, own_config
from orda_tp.engine.workspace import row_layout

from .support.distributed import run_distributed

DEFAULTS = {name: p.default for name, p in inspect.signature(distillation_loss).parameters.items()}


def inputs(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(hidden (6, 4), weight (9, 4), labels (row 2 ignored), teacher hidden, teacher head)``,
    seeded; the orda-kernel reference script builds the same tensors."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((6, 4), (9, 4))]
    tensors += [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((6, 4), (9, 4))]
    labels = torch.randint(0, 9, (6,), generator=generator)
    labels[2] = -100
    hidden, weight, teacher_hidden, teacher_weight = (t.to(dtype) for t in tensors)
    return hidden, weight, labels, teacher_hidden, teacher_weight


def values(out: tuple[Tensor, ...]) -> list[float]:
    """orda-kernel's four fields ``(loss, student_ce, teacher_ce, kl)`` as numbers; the fields after
    them (``z_loss``, which orda-kernel does not have) must read 0 in these calls."""
    assert all(float(extra) == 0.0 for extra in out[4:]), out[4:]
    return [float(x.detach()) for x in out[:4]]


def ignored(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, IgnoredArgumentWarning)]


def test_the_names_are_exported() -> None:
    for name in ("CrossVocabTeacher", "reset_autotune_cache", "begin_autotune_run"):
        assert name in orda_tp.__all__ and hasattr(orda_tp, name)
    assert orda_tp.cross_vocab.CrossVocabTeacher is CrossVocabTeacher


# ------------------------------------------------------------------------------------- ChunkSize


def test_chunk_size_constructors_and_fields_share_their_names() -> None:
    assert ChunkSize.nrows(5) == ChunkSize(nrows=5, dynamic=False)  # orda-kernel: exactly n rows
    assert ChunkSize.dynamic() == ChunkSize()
    assert ChunkSize.fast() == ChunkSize(fast=True)
    size = ChunkSize(nrows=5)
    assert (size.nrows, size.dynamic, size.fast) == (5, True, False)  # an instance reads its fields
    assert replace(size, fast=True) == ChunkSize(nrows=5, dynamic=True, fast=True)
    assert repr(ChunkSize.nrows(5)) == "ChunkSize(nrows=5, dynamic=False, fast=False)"
    # orda-kernel's properties.
    assert ChunkSize.dynamic().is_dynamic and not ChunkSize.nrows(5).is_dynamic and not ChunkSize.fast().is_dynamic
    assert ChunkSize.fast().is_fast and not ChunkSize().is_fast
    assert ChunkSize.nrows(5).value == 5
    with pytest.raises(TypeError, match="has no nrows value"):
        ChunkSize.dynamic().value  # noqa: B018
    with pytest.raises(ValueError, match="ChunkSize.nrows must be a positive int or None, got 0"):
        ChunkSize.nrows(0)


def rows_per_chunk(config: KernelConfig, rows: int = 1000) -> int:
    """Rows per chunk for ``rows`` rows of 10**5 columns, fp32 student and teacher, bf16 staging."""
    return row_layout(config, rows, 10**5, 8, 2).chunk_rows


def test_chunk_size_nrows_is_exact_even_under_a_workspace_cap() -> None:
    # 1 MiB holds less than one row of 10**5 columns × 14 bytes: a capped, dynamic nrows gives 1.
    assert rows_per_chunk(KernelConfig(chunk_size=ChunkSize(nrows=300), workspace_mib=1)) == 1
    assert rows_per_chunk(KernelConfig(chunk_size=ChunkSize.nrows(300), workspace_mib=1)) == 300
    assert KernelConfig(chunk_size=ChunkSize.fast()) == KernelConfig(chunk_size=ChunkSize(fast=True))


# ---------------------------------------------------------------------------------- KernelConfig


def test_orda_kernel_nones_mean_the_defaults() -> None:
    config = KernelConfig(chunk_size=None, grad_weight_accumulation=None, assume_valid_labels=None)
    assert config == KernelConfig()
    assert config.chunk_size == ChunkSize() and config.grad_weight_accumulation == "auto"
    assert config.assume_valid_labels is False


def test_orda_kernel_fields_are_keyword_only() -> None:
    KernelConfig(ChunkSize(), 64, None, "auto", False, None, False)  # our seven fields, positionally
    with pytest.raises(TypeError):
        KernelConfig(ChunkSize(), 64, None, "auto", False, None, False, 4)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"num_chunks": 0}, ValueError, "KernelConfig.num_chunks must be a positive int or None, got 0"),
        ({"num_chunks": True}, ValueError, "KernelConfig.num_chunks must be a positive int or None, got True"),
        ({"max_chunks": 2.0}, ValueError, "KernelConfig.max_chunks must be a positive int or None, got 2.0"),
        ({"max_fused_size": 1000}, ValueError, "KernelConfig.max_fused_size must be a power of two <= 32768"),
        ({"max_fused_size": 65536}, ValueError, "KernelConfig.max_fused_size must be a power of two <= 32768"),
        ({"autotune": "max"}, ValueError, "KernelConfig.autotune must be a bool, 'Max' or None, got 'max'"),
        ({"refresh_autotune": "yes"}, TypeError, "KernelConfig.refresh_autotune must be a bool, got 'yes'"),
        (
            {"entropy_gate": {"tau": 0.5}},
            TypeError,
            "KernelConfig.entropy_gate must be an EntropyGate or None, got dict",
        ),
        (
            {"chunk_size": ChunkSize.nrows(8), "num_chunks": 2},
            ValueError,
            "KernelConfig.num_chunks=2 and chunk_size=ChunkSize(nrows=8, dynamic=False, fast=False) both set the rows",
        ),
    ],
)
def test_bad_orda_kernel_fields_raise_when_built(fields: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        KernelConfig(**fields)
    assert info.type is error


def test_num_chunks_and_max_chunks_set_the_rows_per_chunk() -> None:
    assert rows_per_chunk(KernelConfig(num_chunks=3), rows=100) == 34  # ceil(100 / 3)
    assert KernelConfig(num_chunks=np.int64(500)).num_chunks == 500  # an integer type orda-kernel accepts
    assert rows_per_chunk(KernelConfig(num_chunks=500), rows=100) == 1
    assert rows_per_chunk(KernelConfig(num_chunks=2, chunk_size=ChunkSize.fast()), rows=100) == 50
    default = rows_per_chunk(KernelConfig())
    assert default == 256  # the measured layout 256/1024 fits 448 MiB at 10**5 columns: 4 chunks for 1000 rows
    assert rows_per_chunk(KernelConfig(max_chunks=2)) == 500
    assert rows_per_chunk(KernelConfig(max_chunks=4)) == default  # already 4 chunks
    assert rows_per_chunk(KernelConfig(max_chunks=2, chunk_size=ChunkSize.nrows(100))) == 100
    # Asked-for rows are lowered to an explicit workspace cap when dynamic, like a given nrows.
    assert rows_per_chunk(KernelConfig(workspace_mib=1, num_chunks=2)) == 1
    assert rows_per_chunk(KernelConfig(workspace_mib=1, num_chunks=2, chunk_size=ChunkSize(dynamic=False))) == 500


def test_chunking_and_autotuning_fields_do_not_change_the_result() -> None:
    hidden, weight, labels, teacher_hidden, teacher_weight = inputs()
    teacher = SeparateTeacher(teacher_hidden, teacher_weight)
    chunking = {"num_chunks": 4, "max_chunks": 2, "chunk_size": ChunkSize.dynamic()}
    config = KernelConfig(**chunking, max_fused_size=1024, autotune=False)
    with pytest.warns(IgnoredArgumentWarning):
        out = distillation_loss(hidden, weight, labels, teacher, kl_weight=1.0, config=config)
    # orda-kernel: distillation_loss(..., kl_weight=1.0, config=KernelConfig(num_chunks=4, max_chunks=2,
    # max_fused_size=1024, autotune=False, chunk_size=ChunkSize.dynamic()), backend="torch")
    assert values(out) == pytest.approx([4.340209473897776, 3.1181190972919692, 0.0, 1.2220903766058067], rel=1e-12)
    reference = distillation_loss(hidden, weight, labels, teacher, kl_weight=1.0, backend="reference")
    assert values(out) == pytest.approx(values(reference), rel=1e-12)


def test_ignored_fields_warn_once_per_use_naming_the_callers_line() -> None:
    hidden, weight, labels, teacher_hidden, _ = inputs()
    config = KernelConfig(max_fused_size=16384, autotune="Max", refresh_autotune=True)
    expected = distillation_loss(hidden, weight, labels, TiedTeacher(teacher_hidden), kl_weight=1.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = distillation_loss(hidden, weight, labels, TiedTeacher(teacher_hidden), kl_weight=1.0, config=config)
        module = DistillationLoss(kl_weight=1.0, config=config)
        built = len(record)
        module(hidden, weight, labels, TiedTeacher(teacher_hidden))
    messages = ignored(record)
    assert len(messages) == 6 and built == 6  # 3 at the call, 3 at construction, none at the forward
    assert messages[0].startswith("KernelConfig(max_fused_size=16384) is ignored: orda_tp's Triton kernels tile")
    assert messages[1].startswith("KernelConfig(autotune='Max') is ignored: orda_tp autotunes nothing at run time")
    assert messages[2].endswith("; leave refresh_autotune=None to silence this warning")
    assert {w.filename for w in record} == {__file__}
    assert all(torch.equal(a, e) for a, e in zip(out, expected))


# ------------------------------------------------------------------------ loss-keyword overrides


def test_loss_overrides_are_the_loss_keywords() -> None:
    keywords = set(inspect.signature(distillation_loss).parameters)
    assert set(LOSS_OVERRIDES) <= keywords
    assert LOSS_OVERRIDES == (
        "kl_weight",
        "kl_temperature",
        "kl_teacher_temperature",
        "kl_divergence",
        "kl_alpha",
        "kl_beta",
        "entropy_gate",
    )


def call_keywords(**given: object) -> dict[str, object]:
    """The keywords of a ``distillation_loss`` call that gives ``given``."""
    keywords = {name: value for name, value in DEFAULTS.items() if value is not inspect.Parameter.empty}
    return {**keywords, **given}


def test_the_config_wins_and_a_replaced_keyword_warns() -> None:
    config = KernelConfig(kl_weight=2.0, kl_temperature=2.0, kl_divergence="skew_forward", kl_beta=0.3, vocab_block=64)
    keywords = call_keywords(kl_weight=0.5, kl_temperature=2.0, config=config)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        merged = apply_loss_overrides(keywords, DEFAULTS)
    # Only kl_weight was given with another value: kl_temperature agrees, the others were defaults.
    assert ignored(record) == [
        "kl_weight=0.5 is ignored: config=KernelConfig(kl_weight=2.0) overrides it (as in orda-kernel); leave "
        "kl_weight at its default (0.0) to silence this warning"
    ]
    assert record[0].filename == __file__
    assert {name: merged[name] for name in ("kl_weight", "kl_temperature", "kl_divergence", "kl_beta")} == {
        "kl_weight": 2.0,
        "kl_temperature": 2.0,
        "kl_divergence": "skew_forward",
        "kl_beta": 0.3,
    }
    assert merged["config"] == KernelConfig(vocab_block=64)  # the rest of the config is kept
    assert merged["kl_alpha"] is None and keywords["kl_weight"] == 0.5  # the input is not changed
    untouched = call_keywords(kl_weight=0.5, config=KernelConfig(vocab_block=64))
    assert apply_loss_overrides(untouched, DEFAULTS) == untouched


def test_an_unapplied_override_is_never_dropped_silently() -> None:
    with pytest.raises(ValueError, match=r"KernelConfig\(kl_weight=2.0, kl_beta=0.3\) overrides loss keywords"):
        own_config(KernelConfig(kl_weight=2.0, kl_beta=0.3))


def merged_call(hidden: Tensor, weight: Tensor, labels: Tensor, teacher: Any, **given: object) -> Any:
    """``distillation_loss`` with orda-kernel's precedence applied as the entry points apply it."""
    keywords = apply_loss_overrides(call_keywords(**given), DEFAULTS)
    keywords = {name: keywords[name] for name in given.keys() | set(LOSS_OVERRIDES) | {"config"}}
    return distillation_loss(hidden, weight, labels, teacher, **keywords)


# orda-kernel: the calls of the three cases below, with backend="torch".
OVERRIDE_CASES = {
    "skew_forward": (
        {
            "kl_weight": 0.5,
            "config": KernelConfig(kl_weight=2.0, kl_temperature=2.0, kl_divergence="skew_forward", kl_beta=0.3),
        },
        [3.3951077090329966, 3.1181190972919692, 0.0, 0.13849430587051376],
    ),
    "entropy_gate": (
        {
            "kl_weight": 1.5,
            "kl_temperature": 2.0,
            "config": KernelConfig(
                kl_teacher_temperature=3.0,
                kl_divergence="entropy_adaptive",
                entropy_gate=EntropyGate(alpha_min=0.2, tau=0.3, scale=0.2),
            ),
        },
        [5.019081322867917, 3.1181190972919692, 0.0, 1.2673081503839652],
    ),
}


@pytest.mark.parametrize("case", list(OVERRIDE_CASES))
def test_overrides_give_orda_kernels_numbers(case: str) -> None:
    hidden, weight, labels, teacher_hidden, teacher_weight = inputs()
    given, expected = OVERRIDE_CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredArgumentWarning)
        out = merged_call(hidden, weight, labels, SeparateTeacher(teacher_hidden, teacher_weight), **given)
    assert values(out) == pytest.approx(expected, rel=1e-12)


def test_a_skew_override_equals_the_direct_call() -> None:
    hidden, weight, labels, teacher_hidden, teacher_weight = inputs()
    teacher = SeparateTeacher(teacher_hidden, teacher_weight)
    given = OVERRIDE_CASES["skew_forward"][0]
    with pytest.warns(IgnoredArgumentWarning, match="kl_weight=0.5 is ignored"):
        out = merged_call(hidden, weight, labels, teacher, **given)
    direct = distillation_loss(
        hidden, weight, labels, teacher, kl_weight=2.0, kl_temperature=2.0, kl_divergence="skew_forward", kl_beta=0.3
    )
    assert all(torch.equal(a, e) for a, e in zip(out, direct))


def test_the_public_entry_points_apply_the_overrides() -> None:
    hidden, weight, labels, teacher_hidden, teacher_weight = inputs()
    given, expected = OVERRIDE_CASES["skew_forward"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = distillation_loss(hidden, weight, labels, SeparateTeacher(teacher_hidden, teacher_weight), **given)
    assert len(ignored(record)) == 1 and ignored(record)[0].startswith("kl_weight=0.5 is ignored")
    assert values(out) == pytest.approx(expected, rel=1e-12)
    module = DistillationLoss(
        kl_weight=1.0,
        kl_divergence="forward",
        config=KernelConfig(kl_divergence="alpha_divergence", kl_alpha=0.3),
    )
    # orda-kernel: DistillationLoss(kl_weight=1.0, kl_divergence="forward", config=KernelConfig(
    # kl_divergence="alpha_divergence", kl_alpha=0.3), backend="torch")(hidden, weight, labels, TiedTeacher(th))
    assert values(module(hidden, weight, labels, TiedTeacher(teacher_hidden))) == pytest.approx(
        [6.418567147547992, 3.1181190972919692, 2.3303223591740037, 0.9701256910820183], rel=1e-12
    )


# ----------------------------------------------------------------------------- PrecomputedTeacher


def teacher_logits() -> Tensor:
    _, _, _, teacher_hidden, teacher_weight = inputs()
    return teacher_hidden @ teacher_weight.T * 8


def test_orda_kernels_positional_order() -> None:
    logits = teacher_logits()
    teacher = PrecomputedTeacher(logits, None, None, True, 2.0)
    assert teacher.trust_cache_immutability is True and teacher.logits_temperature == 2.0
    with pytest.raises(TypeError, match="PrecomputedTeacher.trust_cache_immutability must be a bool, got 1"):
        PrecomputedTeacher(logits=logits, trust_cache_immutability=1)  # type: ignore[arg-type]


def test_an_inference_mode_cache_needs_trust_and_is_then_used_as_is() -> None:
    hidden, weight, labels, _, _ = inputs()
    logits = teacher_logits()
    with torch.inference_mode():
        frozen = logits.clone()
    with pytest.raises(ValueError, match=r"PrecomputedTeacher.logits has no version counter \(a tensor made under"):
        PrecomputedTeacher(logits=frozen)
    results = []
    for cache, trust in ((frozen, True), (logits, False)):
        student, head = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        teacher = PrecomputedTeacher(logits=cache, trust_cache_immutability=trust)
        out = distillation_loss(student, head, labels, teacher, kl_weight=1.0, kl_divergence="jeffreys")
        out.loss.backward()
        results.append([*out[:4], student.grad, head.grad])
    assert all(torch.equal(a, e) for a, e in zip(*results))
    # orda-kernel: distillation_loss(..., PrecomputedTeacher(logits=frozen, trust_cache_immutability=True),
    # kl_weight=1.0, kl_divergence="jeffreys", backend="torch"), then loss.backward()
    assert values(results[0][:4]) == pytest.approx([16.3699138809831, 3.1181190972919692, 0.0, 13.25179478369113])
    assert [float(g.norm()) for g in results[0][4:]] == pytest.approx([2.5128396719165518, 4.59793319002439])


def test_trust_does_not_stop_watching_a_tensor_that_has_a_version_counter() -> None:
    """orda-kernel's meaning: trust only admits tensors without a version counter."""
    hidden, weight, labels, _, _ = inputs()
    teacher = PrecomputedTeacher(logits=teacher_logits(), trust_cache_immutability=True)
    teacher.logits.add_(1.0)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="PrecomputedTeacher.logits was modified in place"):
        distillation_loss(hidden, weight, labels, teacher, kl_weight=1.0)


def test_prepare_logits_checks_its_argument_and_the_cache() -> None:
    logits = teacher_logits()
    teacher = PrecomputedTeacher(logits=logits)
    with pytest.raises(TypeError, match="prepare_logits dtype must be a torch.dtype, got 'float32'"):
        teacher.prepare_logits("float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prepare_logits dtype must be one of"):
        teacher.prepare_logits(torch.int32)
    _, _, _, teacher_hidden, teacher_weight = inputs()
    with pytest.raises(ValueError, match="prepare_logits needs a logits cache"):
        PrecomputedTeacher(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight).prepare_logits(torch.float32)
    assert teacher.prepare_logits(torch.float64) is teacher  # already that dtype, contiguous
    strided = PrecomputedTeacher(logits=logits.T.contiguous().T).prepare_logits(torch.float64)
    assert strided.logits.is_contiguous() and torch.equal(strided.logits, logits)  # type: ignore[union-attr]
    assert not strided.rows_shifted_locally  # same dtype: copied, not shifted
    logits.mul_(2.0)
    with pytest.raises(ValueError, match="PrecomputedTeacher.logits was modified in place"):
        teacher.prepare_logits(torch.float32)


def test_prepare_logits_converts_as_orda_kernel_does() -> None:
    hidden, weight, labels, _, _ = inputs()
    logits = teacher_logits()
    with torch.inference_mode():
        frozen = logits.clone()
    source = PrecomputedTeacher(logits=frozen, trust_cache_immutability=True, logits_temperature=2.0)
    prepared = source.prepare_logits(torch.float32)
    assert prepared.logits.dtype == torch.float32 and not prepared.logits.is_inference()  # type: ignore[union-attr]
    assert prepared.trust_cache_immutability and prepared.logits_temperature == 2.0 and prepared.rows_shifted_locally
    # orda-kernel: PrecomputedTeacher(logits=logits).prepare_logits(torch.float32).logits[0]
    row = [0.0, -13.179492950439453, -3.088266372680664, -19.253915786743164, -21.68695640563965]
    row += [-11.617552757263184, -18.12763023376465, -13.643378257751465, -16.045177459716797]
    assert prepared.logits[0].tolist() == row  # type: ignore[union-attr]
    # orda-kernel: distillation_loss(hidden.float(), weight.float(), labels, that cache, kl_weight=1.0,
    # kl_temperature=2.0, backend="torch")
    untempered = replace(prepared, logits_temperature=None)
    out = distillation_loss(hidden.float(), weight.float(), labels, untempered, kl_weight=1.0, kl_temperature=2.0)
    assert values(out) == pytest.approx([9.195998191833496, 3.11811900138855, 0.0, 6.077879428863525], rel=1e-6)
    # fp16: rows shifted to 0, finite values below its range clamped to its lowest.
    # orda-kernel: PrecomputedTeacher(logits=logits.float() * 1e4).prepare_logits(torch.float16).logits[0]
    wide = PrecomputedTeacher(logits=logits.float() * 1e4).prepare_logits(torch.float16)
    assert wide.logits[0].float().tolist() == [0.0, -65504.0, -30880.0] + [-65504.0] * 6  # type: ignore[union-attr]


def test_prepare_logits_keeps_neg_inf_nan_and_all_neg_inf_rows() -> None:
    logits = teacher_logits()[:3].clone()
    logits[0, 1] = float("-inf")
    logits[1] = float("-inf")
    logits[2, 4] = float("nan")
    prepared = PrecomputedTeacher(logits=logits).prepare_logits(torch.float32).logits
    assert prepared is not None
    assert prepared[0, 1] == float("-inf") and bool(torch.isneginf(prepared[1]).all())
    assert bool(torch.isnan(prepared[2, 4])) and float(prepared[2].nan_to_num(-1e9).max()) == 0.0


# ----------------------------------------------------------------------- tensor-parallel caches


def cache_worker(rank: int, world: int) -> tuple[str, list[float], list[float], list[float], list[float]]:
    """Rank ``r`` passes its columns of the cache. A shard that ``prepare_logits`` shifted by its
    own maximum must raise on every rank; a trusted inference-mode shard must then give the
    single-device result (had a rank been left in a collective, that call would hang), and so
    must a DTensor cache prepared as a whole (its rows shifted by their global maximum)."""
    hidden, weight, labels, _, _ = inputs()
    logits = teacher_logits()
    start, stop = [(0, 5), (5, 9)][rank]  # torch.chunk order, as a DTensor shards the 9 columns
    group = dist.group.WORLD
    shifted = PrecomputedTeacher(logits=logits[:, start:stop]).prepare_logits(torch.float32)
    try:
        distillation_loss(hidden, weight[start:stop], labels, shifted, kl_weight=1.0, tp_group=group)
        message = "no error"
    except ValueError as error:
        message = str(error)
    with torch.inference_mode():
        frozen = logits[:, start:stop].clone()
    trusted = PrecomputedTeacher(logits=frozen, trust_cache_immutability=True)
    out = distillation_loss(hidden, weight[start:stop], labels, trusted, kl_weight=1.0, tp_group=group)
    single = distillation_loss(hidden, weight, labels, PrecomputedTeacher(logits=logits), kl_weight=1.0)
    mesh = init_device_mesh("cpu", (world,))
    whole = PrecomputedTeacher(logits=distribute_tensor(logits, mesh, [Shard(1)])).prepare_logits(torch.float32)
    assert not whole.rows_shifted_locally
    sharded_head = distribute_tensor(weight, mesh, [Shard(0)])
    prepared = distillation_loss(hidden, sharded_head, labels, whole, kl_weight=1.0)
    single_prepared = PrecomputedTeacher(logits=logits).prepare_logits(torch.float32)
    expected = distillation_loss(hidden, weight, labels, single_prepared, kl_weight=1.0)
    return message, values(out), values(single), values(prepared), values(expected)


def test_tensor_parallel_caches() -> None:
    results = run_distributed(2, cache_worker, timeout=120.0, collective_timeout=30.0)
    for rank, (message, out, single, prepared, expected) in enumerate(results):
        assert message.startswith("invalid inputs on tp_group rank(s) [0, 1]: rank 0: ValueError: "), (rank, message)
        assert "PrecomputedTeacher.prepare_logits shifted each row of this rank's" in message, (rank, message)
        assert out == pytest.approx(single, rel=1e-12), rank
        assert prepared == pytest.approx(expected, rel=1e-12), rank
    assert results[0] == results[1]


# ------------------------------------------------------------------------------ CrossVocabTeacher


def span_inputs() -> tuple[Tensor, Tensor, Tensor, CrossVocabTeacher, AlignedSpanPairs]:
    """A student over 11 tokens and a teacher over 6, seeded; the orda-kernel reference script
    builds the same tensors."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 4, generator=generator, dtype=torch.float64)
    weight = torch.randn(11, 4, generator=generator, dtype=torch.float64)
    teacher_hidden = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    teacher_weight = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 11, (7,), generator=generator)
    labels[3] = -100
    teacher_labels = torch.randint(0, 6, (5,), generator=generator)
    teacher_labels[1] = -100
    pairs = AlignedSpanPairs(torch.tensor([[0, 2], [2, 4], [4, 7]]), torch.tensor([[0, 2], [2, 3], [3, 5]]))
    return hidden, weight, labels, CrossVocabTeacher(teacher_hidden, teacher_weight, teacher_labels), pairs


def test_cross_vocab_teacher_checks_its_fields() -> None:
    _, _, _, teacher, _ = span_inputs()
    with pytest.raises(TypeError, match="CrossVocabTeacher.labels must be a torch.Tensor, got list"):
        CrossVocabTeacher(teacher.hidden, teacher.weight, [0, 1])  # type: ignore[arg-type]


# orda-kernel: aligned_span_distillation_loss(hidden, weight, labels, CrossVocabTeacher(...), pairs,
# AlignedLikelihoodConfig(span_kl_weight=0.7, objective=objective), backend="torch") -> (loss, student_ce,
# teacher_ce, kl), and the norm of hidden's gradient.
CROSS_VOCAB = {
    "binary_kl": ([5.883327588917949, 5.327460845970793, 0.7940953470673644], 1.5911155758117834),
    "binary_ce": ([6.035616002458542, 5.327460845970793, 1.0116502235539269], 1.5911155758117834),
}


@pytest.mark.parametrize("objective", list(CROSS_VOCAB))
def test_cross_vocab_teacher_is_scored_at_the_call(objective: str) -> None:
    hidden, weight, labels, teacher, pairs = span_inputs()
    live = CrossVocabTeacher(teacher.hidden.requires_grad_(), teacher.weight.requires_grad_(), teacher.labels)
    config = AlignedLikelihoodConfig(span_kl_weight=0.7, objective=objective)
    student = hidden.clone().requires_grad_()
    out = aligned_span_distillation_loss(student, weight, labels, live, pairs, config)
    out.loss.backward()
    expected, gradient_norm = CROSS_VOCAB[objective]
    assert values(out) == pytest.approx(expected, rel=1e-12)
    assert float(student.grad.norm()) == pytest.approx(gradient_norm, rel=1e-12)  # type: ignore[union-attr]
    assert live.hidden.grad is None and live.weight.grad is None  # the teacher is detached
    cached = build_precomputed_span_teacher(teacher.hidden, teacher.weight, teacher.labels, pairs.teacher_ranges)
    same = aligned_span_distillation_loss(hidden, weight, labels, cached, pairs, config)
    assert all(torch.equal(a, e) for a, e in zip(out, same))


# ------------------------------------------------------------------------------ autotune functions


@pytest.mark.parametrize("function", [orda_tp.reset_autotune_cache, orda_tp.begin_autotune_run])
def test_autotune_functions_are_documented_no_ops(function: Any) -> None:
    assert inspect.signature(function).parameters == {}  # orda-kernel's signature: no arguments
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert function() is None
    assert "no-op" in (function.__doc__ or "")
