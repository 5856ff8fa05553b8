"""A top-k cache is the teacher at the temperature it was made at: a loss at that temperature reads
it as it is; at another temperature it is re-tempered only where that is exact (every id listed)
or asked for (``retemper=True``); its declared soft-cap is the teacher's. On one device, through
the cache files, with ``KDLoss``, and under ``tp_group``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import orda_tp

from .support.cases import relative_error

ROWS, HIDDEN, VOCAB = 24, 12, 61


def problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(ROWS, HIDDEN, generator=generator, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    teacher_hidden = 3 * torch.randn(ROWS, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    labels[::5] = -100
    return student, head, teacher_hidden, labels


def kl(
    student: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, teacher: object, temperature: float
) -> torch.Tensor:
    out = orda_tp.distillation_loss(
        student,
        head,
        labels,
        teacher,
        kl_weight=1.0,
        kl_temperature=temperature,
        student_ce_weight=0.0,
        teacher_ce_weight=0.0,
    )
    return out.kl


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_a_cache_of_every_id_is_the_teacher_at_its_temperature(temperature: float) -> None:
    """Extracted at T and read at T: the dense teacher's KL (41dfd16 divided by T a second time)."""
    student, head, teacher_hidden, labels = problem()
    dense = kl(student, head, labels, orda_tp.TiedTeacher(teacher_hidden), temperature)
    cache = orda_tp.teacher_topk(teacher_hidden, head, VOCAB, temperature=temperature).teacher()
    assert relative_error(kl(student, head, labels, cache, temperature), dense) <= 1e-12
    # Every id listed: read at another temperature, the re-tempering is exact and allowed.
    other = orda_tp.teacher_topk(teacher_hidden, head, VOCAB, temperature=1.0).teacher()
    assert relative_error(kl(student, head, labels, other, temperature), dense) <= 1e-12


def test_a_cut_cache_is_read_as_it_is_at_its_temperature() -> None:
    student, head, teacher_hidden, labels = problem(1)
    top = orda_tp.teacher_topk(teacher_hidden, head, 8, temperature=2.0)
    # The dense teacher the cache stands for at T = 2: its values, the tail spread evenly, used as they are.
    dense_values = torch.full((ROWS, VOCAB), 0.0, dtype=torch.float64)
    missing = 1 - top.logprobs.exp().sum(1, keepdim=True)
    dense_values[:] = torch.log(missing / (VOCAB - 8))
    dense_values.scatter_(1, top.ids, top.logprobs)
    as_is = orda_tp.PrecomputedTeacher(logits=dense_values, logits_temperature=2.0)
    assert relative_error(kl(student, head, labels, top.teacher(), 2.0), kl(student, head, labels, as_is, 2.0)) <= 1e-12


def test_a_cut_cache_read_at_another_temperature_raises_unless_asked() -> None:
    student, head, teacher_hidden, labels = problem(2)
    top = orda_tp.teacher_topk(teacher_hidden, head, 8, temperature=1.0)
    with pytest.raises(ValueError) as raised:
        kl(student, head, labels, top.teacher(), 2.0)
    message = str(raised.value)
    assert "made at temperature 1.0, and the loss reads the teacher at temperature 2.0" in message
    assert "k = 8 of 61 ids" in message and "retemper=True" in message
    # The masses it names: the listed ids' at 1, and re-tempered to 2 over the uniform tail's dense teacher.
    dense = torch.full((ROWS, VOCAB), 0.0, dtype=torch.float64)
    dense[:] = ((1 - top.logprobs.exp().sum(1, keepdim=True)) / (VOCAB - 8)).log()
    dense.scatter_(1, top.ids, top.logprobs)
    at_two = torch.softmax(dense / 2.0, dim=1).gather(1, top.ids).sum(1).mean()
    kept = top.logprobs.exp().sum(1).mean()
    assert f"would hold {float(at_two):.3g} of the mass (the rows' mean; {float(kept):.3g} at 1.0)" in message
    assert float(at_two) < float(kept)  # flatter at 2: the listed ids hold less of the mass
    retempered = kl(student, head, labels, top.teacher(retemper=True), 2.0)
    # Asked for: the values divided by 2 (the 41dfd16 behaviour, now explicit).
    hand = orda_tp.PrecomputedTeacher(topk_ids=top.ids, topk_logprobs=top.logprobs, retemper=True)
    assert torch.equal(retempered, kl(student, head, labels, hand, 2.0))
    # A hand-built cache declares nothing: made at 1, the same rule.
    with pytest.raises(ValueError, match="made at temperature 1.0"):
        kl(student, head, labels, orda_tp.PrecomputedTeacher(topk_ids=top.ids, topk_logprobs=top.logprobs), 2.0)


def test_the_teacher_ce_and_the_soft_cap_of_a_cache_made_otherwise() -> None:
    student, head, teacher_hidden, labels = problem(3)
    warm = orda_tp.teacher_topk(teacher_hidden, head, 8, temperature=2.0, logit_softcap=5.0)
    with pytest.raises(
        ValueError, match="teacher CE at temperature 1, but the top-k cache was made at topk_temperature=2.0"
    ):
        orda_tp.distillation_loss(
            student, head, labels, warm.teacher(), kl_weight=1.0, kl_temperature=2.0, teacher_ce_weight=1.0
        )
    same = orda_tp.distillation_loss(
        student, head, labels, warm.teacher(), kl_weight=1.0, kl_temperature=2.0, teacher_logit_softcap=5.0
    )
    plain = orda_tp.distillation_loss(student, head, labels, warm.teacher(), kl_weight=1.0, kl_temperature=2.0)
    assert torch.equal(same.loss, plain.loss)  # the cache is capped already: the cap is not applied again
    with pytest.raises(ValueError, match="teacher_logit_softcap=4.0 disagrees with the top-k cache's topk_softcap=5.0"):
        orda_tp.distillation_loss(
            student, head, labels, warm.teacher(), kl_weight=1.0, kl_temperature=2.0, teacher_logit_softcap=4.0
        )


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"topk_temperature": 0.0}, "topk_temperature must be a finite float > 0"),
        ({"topk_softcap": float("inf")}, "topk_softcap must be a finite float > 0"),
        ({"retemper": 1}, "retemper must be a bool"),
        ({"topk_temperature": "2"}, "topk_temperature must be a float or None"),
    ],
)
def test_bad_declarations(fields: dict[str, object], error: str) -> None:
    ids = torch.tensor([[0, 1]])
    with pytest.raises((ValueError, TypeError), match=error):
        orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=torch.log(torch.tensor([[0.5, 0.25]])), **fields)  # type: ignore[arg-type]


def test_declarations_of_a_top_k_cache_need_one() -> None:
    with pytest.raises(ValueError, match="topk_temperature describes a top-k cache"):
        orda_tp.PrecomputedTeacher(logits=torch.zeros(2, 3), topk_temperature=2.0)
    with pytest.raises(ValueError, match="a top-k cache declares the temperature it was made at with topk_temperature"):
        orda_tp.PrecomputedTeacher(
            topk_ids=torch.tensor([[0]]), topk_logprobs=torch.zeros(1, 1), logits_temperature=2.0
        )


def test_kd_loss_reads_a_cache_at_its_temperature() -> None:
    generator = torch.Generator().manual_seed(4)
    student = torch.randn(ROWS, VOCAB, generator=generator, dtype=torch.float64)
    teacher = 3 * torch.randn(ROWS, VOCAB, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    full = orda_tp.teacher_topk_of_logits(teacher, VOCAB, temperature=2.0).teacher()
    dense = orda_tp.KDLoss(temperature=2.0)(student, teacher, labels)
    assert relative_error(orda_tp.KDLoss(temperature=2.0)(student, full, labels), dense) <= 1e-12
    cut = orda_tp.teacher_topk_of_logits(teacher, 8, temperature=2.0).teacher()
    with pytest.raises(ValueError, match="made at temperature 2.0, and the loss reads the teacher at temperature 1.0"):
        orda_tp.KDLoss(temperature=1.0)(student, cut, labels)


def test_the_cache_files_declare_the_temperature(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from orda_tp.topk_cache import CacheSettings, TopKCacheReader, TopKCacheWriter

    student, head, teacher_hidden, labels = problem(5)
    top = orda_tp.teacher_topk(teacher_hidden.float(), head.float(), 8, temperature=2.0)
    settings = CacheSettings(vocab_size=VOCAB, k=8, temperature=2.0, logprob_dtype=torch.float32)
    with TopKCacheWriter(tmp_path, settings) as writer:
        writer.append(top)
    cached = TopKCacheReader(tmp_path).teacher(0, ROWS)
    assert cached.topk_temperature == 2.0
    online = kl(student.float(), head.float(), labels, top.teacher(), 2.0)
    assert torch.equal(kl(student.float(), head.float(), labels, cached, 2.0), online)
    with pytest.raises(ValueError, match="made at temperature 2.0"):
        kl(student.float(), head.float(), labels, cached, 1.0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_rule_under_tensor_parallelism(world_size: int) -> None:
    from .support import topk_temperature_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, topk_temperature_workers.temperature_worker, timeout=240)
    for report in reports:
        assert relative_error(torch.tensor(report["loss"]), torch.tensor(report["alone"])) <= 1e-12
        assert "made at temperature 2.0, and the loss reads the teacher at temperature 1.0" in report["error"]
    assert len({report["error"] for report in reports}) == 1
