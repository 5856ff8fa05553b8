"""Cross-vocabulary tools (docs/cross_vocab.md) against independent float64 formulas written here."""

from __future__ import annotations

import math
import random
from decimal import Decimal, localcontext

import pytest
import torch

import orda_tp.cross_vocab.spans as spans_module
import orda_tp.cross_vocab.token_maps as token_maps_module
from orda_tp.cross_vocab import (
    AlignedLikelihoodConfig,
    AlignedSpanLossOutput,
    AlignedSpanPairs,
    PrecomputedSpanTeacher,
    aligned_span_distillation_loss,
    build_exact_token_map,
    build_precomputed_span_teacher,
    generalized_jensen_shannon,
    mix_teacher_logits,
    project_teacher_logits,
)
from orda_tp.cross_vocab._logmath import log1mexp

INF = math.inf


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- token maps


def test_exact_map_from_sequences_maps_identical_strings_and_keeps_duplicates():
    token_map = build_exact_token_map(["a", "b", "c"], ["c", "x", "a", "a"])
    assert token_map.dtype == torch.long
    assert token_map.tolist() == [2, -1, 0, 0]


def test_exact_map_from_mappings_marks_id_gaps_unmatched():
    student = {"b": 0, "a": 1, "<pad>": 3}
    teacher = {"a": 0, "b": 2, "z": 3}
    assert build_exact_token_map(student, teacher).tolist() == [1, -1, 0, -1]


def test_exact_map_is_string_equality_without_normalization():
    assert build_exact_token_map(["Ġthe", "the"], ["▁the", "the", "THE"]).tolist() == [-1, 1, -1]


def test_exact_map_matches_brute_force_on_random_vocabularies():
    rng = random.Random(0)
    alphabet = "abcd"
    student = list({"".join(rng.choices(alphabet, k=rng.randint(1, 3))) for _ in range(60)})
    teacher = ["".join(rng.choices(alphabet, k=rng.randint(1, 3))) for _ in range(80)]
    expected = []
    for token in teacher:
        hits = [i for i, s in enumerate(student) if s == token]
        expected.append(hits[0] if hits else -1)
    assert build_exact_token_map(student, teacher).tolist() == expected
    assert build_exact_token_map(dict(zip(student, range(len(student)))), teacher).tolist() == expected


@pytest.mark.parametrize(
    ("student", "teacher", "error", "fragment"),
    [
        (["a", "a"], ["a"], ValueError, "student_vocab must hold each token string once"),
        ({"a": 0, "b": 0}, ["a"], ValueError, "id 0"),
        (["a"], {"a": -1}, ValueError, "teacher_vocab ids must be ints >= 0"),
        (["a"], {"a": True}, ValueError, "teacher_vocab ids"),
        (["a", 3], ["a"], TypeError, "student_vocab[1] must be a str"),
        ("ab", ["a"], TypeError, "student_vocab must be a sequence of str or a mapping"),
        (["a"], [], ValueError, "teacher_vocab must be non-empty"),
        ({}, ["a"], ValueError, "student_vocab must be non-empty"),
    ],
)
def test_exact_map_rejects_bad_vocabularies(student, teacher, error, fragment):
    with pytest.raises(error) as info:
        build_exact_token_map(student, teacher)
    assert fragment in str(info.value)


# --------------------------------------------------------------------------- projection


def _reference_projection(logits, token_map, student_vocab_size, unmatched, temperature):
    """Dense float64 probability math with explicit loops over teacher columns."""
    rows = logits.double().reshape(-1, logits.shape[-1]) / temperature
    matched = [j for j in range(rows.shape[1]) if token_map[j] >= 0]
    out = torch.full((rows.shape[0], student_vocab_size), -INF, dtype=torch.float64)
    for r in range(rows.shape[0]):
        support = matched if unmatched == "renormalize" else range(rows.shape[1])
        normalizer = sum(math.exp(rows[r, j].item()) for j in support)
        mass = [0.0] * student_vocab_size
        for j in matched:
            mass[int(token_map[j])] += math.exp(rows[r, j].item()) / normalizer
        for s, value in enumerate(mass):
            if value > 0:
                out[r, s] = math.log(value)
    return out.reshape(*logits.shape[:-1], student_vocab_size)


TOKEN_MAP = torch.tensor([3, -1, 0, 3, 5, -1, 1, 3, 0])  # duplicates onto 3 and 0; student 2, 4, 6 unmatched


@pytest.mark.parametrize("unmatched", ["renormalize", "mask"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_projection_matches_dense_reference(unmatched, temperature):
    logits = torch.randn(2, 3, 9, generator=_generator(1), dtype=torch.float64) * 3
    out = project_teacher_logits(logits, TOKEN_MAP, 7, unmatched=unmatched, temperature=temperature)
    expected = _reference_projection(logits, TOKEN_MAP, 7, unmatched, temperature)
    assert out.shape == (2, 3, 7) and out.dtype == torch.float64
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    assert torch.equal(out[..., [2, 4, 6]], torch.full((2, 3, 3), -INF, dtype=torch.float64))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-12, atol=1e-12)


def test_projection_mass_is_one_when_renormalized_and_matched_mass_when_masked():
    logits = torch.randn(5, 9, generator=_generator(2))
    renorm = project_teacher_logits(logits, TOKEN_MAP, 7)
    masked = project_teacher_logits(logits, TOKEN_MAP, 7, unmatched="mask")
    matched_mass = torch.softmax(logits.double(), -1)[:, TOKEN_MAP >= 0].sum(-1)
    torch.testing.assert_close(renorm.double().exp().sum(-1), torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(masked.double().exp().sum(-1), matched_mass)
    assert bool((matched_mass < 0.999).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_projection_outputs_float32_for_low_precision_inputs(dtype):
    logits = torch.randn(4, 9, generator=_generator(3)).to(dtype)
    out = project_teacher_logits(logits, TOKEN_MAP, 7, temperature=0.5)
    assert out.dtype == torch.float32
    expected = _reference_projection(logits.double(), TOKEN_MAP, 7, "renormalize", 0.5)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out.double()[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_projection_merges_duplicates_in_log_space_without_underflow():
    # Two duplicate columns far below the rest: exp() of their log-probs underflows even in float64.
    logits = torch.tensor([[0.0, -2000.0, -2000.0]], dtype=torch.float32)
    out = project_teacher_logits(logits, torch.tensor([0, 1, 1]), 2, unmatched="mask")
    assert out[0, 0].item() == 0.0
    assert out[0, 1].item() == pytest.approx(-2000.0 + math.log(2.0), abs=1e-3)


def test_projection_chunking_gives_the_same_result(monkeypatch):
    logits = torch.randn(37, 9, generator=_generator(4))
    whole = project_teacher_logits(logits, TOKEN_MAP, 7, unmatched="mask")
    monkeypatch.setattr(token_maps_module, "_WORKSPACE_ELEMENTS", 9 * 4)  # 4 rows per chunk
    chunked = project_teacher_logits(logits, TOKEN_MAP, 7, unmatched="mask")
    assert torch.equal(whole, chunked)


def test_projection_non_finite_rows():
    logits = torch.randn(4, 9, generator=_generator(5))
    logits[0, 1] = math.nan  # NaN in an unmatched column: still visible
    logits[1, 4] = INF
    logits[2] = -INF  # no mass at all
    logits[3, TOKEN_MAP >= 0] = -INF  # mass only on unmatched columns
    for unmatched in ("renormalize", "mask"):
        out = project_teacher_logits(logits, TOKEN_MAP, 7, unmatched=unmatched)
        assert bool(out[:2].isnan().all())
        assert bool((out[2:] == -INF).all())


def test_projection_accepts_a_token_map_of_another_integer_dtype():
    logits = torch.randn(3, 9, generator=_generator(6))
    assert torch.equal(project_teacher_logits(logits, TOKEN_MAP.int(), 7), project_teacher_logits(logits, TOKEN_MAP, 7))


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"token_map": torch.tensor([0, 1])}, ValueError, "token_map must have shape (9,)"),
        ({"token_map": TOKEN_MAP.float()}, TypeError, "token_map must be an integer tensor"),
        ({"token_map": TOKEN_MAP.tolist()}, TypeError, "token_map must be a torch.Tensor"),
        ({"token_map": torch.tensor([7, -1, 0, 3, 5, -1, 1, 3, 0])}, ValueError, "got values in [-1, 7]"),
        ({"token_map": torch.tensor([-2, -1, 0, 3, 5, -1, 1, 3, 0])}, ValueError, "[-1, 7)"),
        ({"token_map": torch.full((9,), -1)}, ValueError, "at least one teacher column"),
        ({"student_vocab_size": 0}, ValueError, "student_vocab_size must be > 0, got 0"),
        ({"student_vocab_size": True}, TypeError, "student_vocab_size must be an int"),
        ({"unmatched": "drop"}, ValueError, "unmatched must be one of ('renormalize', 'mask'), got 'drop'"),
        ({"temperature": 0.0}, ValueError, "temperature must be a finite real number > 0, got 0.0"),
        ({"temperature": math.nan}, ValueError, "temperature must be a finite real number > 0"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"teacher_logits": torch.zeros(2, 9, dtype=torch.long)}, TypeError, "teacher_logits must be a floating"),
        ({"teacher_logits": torch.tensor(1.0)}, ValueError, "teacher_logits must have at least one dimension"),
    ],
)
def test_projection_rejects_bad_arguments(kwargs, error, fragment):
    arguments = {"teacher_logits": torch.zeros(2, 9), "token_map": TOKEN_MAP, "student_vocab_size": 7}
    arguments.update(kwargs)
    positional = [arguments.pop(name) for name in ("teacher_logits", "token_map", "student_vocab_size")]
    with pytest.raises(error) as info:
        project_teacher_logits(*positional, **arguments)
    assert fragment in str(info.value)


def test_projected_teacher_drives_the_core_kl_like_the_dense_formula():
    from orda_tp import PrecomputedTeacher, distillation_loss

    gen = _generator(7)
    hidden = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0, 1, 3, -100, 5, 3])
    teacher_logits = torch.randn(6, 9, generator=gen, dtype=torch.float64) * 2
    temperature = 2.0
    projected = project_teacher_logits(teacher_logits, TOKEN_MAP, 7, temperature=temperature)
    out = distillation_loss(
        hidden,
        weight,
        labels,
        PrecomputedTeacher(logits=projected, logits_temperature=temperature),
        student_ce_weight=0.0,
        kl_weight=1.0,
        kl_temperature=temperature,
        backend="torch",
    )
    q = _reference_projection(teacher_logits, TOKEN_MAP, 7, "renormalize", temperature).exp()
    log_p = torch.log_softmax(hidden.detach() @ weight.T / temperature, -1)
    per_row = (q * (torch.where(q > 0, q.log(), 0.0) - log_p)).sum(-1) * temperature**2
    expected = per_row[labels != -100].mean()
    torch.testing.assert_close(out.kl, expected, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- mixing


def _dense_mixture(logits_list, weights):
    probs = [torch.softmax(x.double(), -1) for x in logits_list]
    return sum(w * p for w, p in zip(weights, probs))


def _teachers(count=3, shape=(4, 6), seed=8):
    gen = _generator(seed)
    return [torch.randn(*shape, generator=gen) * 2 for _ in range(count)]


def test_arithmetic_mix_is_log_of_weighted_probability_average():
    teachers, weights = _teachers(), [0.2, 0.5, 0.3]
    mixed = mix_teacher_logits(teachers, weights)
    assert mixed.dtype == torch.float32 and mixed.shape == (4, 6)
    torch.testing.assert_close(mixed.double(), _dense_mixture(teachers, weights).log(), rtol=1e-6, atol=1e-6)


def test_geometric_mix_is_weighted_sum_of_log_probs_not_renormalized():
    teachers, weights = _teachers(), [0.2, 0.5, 0.3]
    mixed = mix_teacher_logits(teachers, weights, mode="geometric")
    probs = [torch.softmax(x.double(), -1) for x in teachers]
    expected = sum(w * p.log() for w, p in zip(weights, probs))
    torch.testing.assert_close(mixed.double(), expected, rtol=1e-6, atol=1e-6)
    assert bool((torch.logsumexp(mixed, -1) < -1e-4).all())  # disagreeing teachers: not normalized
    product = probs[0] ** 0.2 * probs[1] ** 0.5 * probs[2] ** 0.3
    torch.testing.assert_close(torch.softmax(mixed.double(), -1), product / product.sum(-1, keepdim=True))


def test_arithmetic_and_geometric_mixes_differ_and_agree_for_identical_teachers():
    teachers = _teachers(count=2)
    assert not torch.allclose(
        mix_teacher_logits(teachers, [0.5, 0.5]), mix_teacher_logits(teachers, [0.5, 0.5], mode="geometric")
    )
    same = [teachers[0], teachers[0].clone()]
    log_q = torch.log_softmax(teachers[0], -1)
    for mode in ("arithmetic", "geometric"):
        torch.testing.assert_close(mix_teacher_logits(same, [0.25, 0.75], mode=mode), log_q)


def test_zero_weight_teacher_is_left_out_even_with_zero_support():
    teachers = _teachers(count=2, seed=9)
    vetoing = teachers[1].clone()
    vetoing[:, :3] = -INF
    for mode in ("arithmetic", "geometric"):
        mixed = mix_teacher_logits([teachers[0], vetoing], [1.0, 0.0], mode=mode)
        torch.testing.assert_close(mixed, torch.log_softmax(teachers[0], -1))
    geometric = mix_teacher_logits([teachers[0], vetoing], [0.5, 0.5], mode="geometric")
    assert bool((geometric[:, :3] == -INF).all()) and bool(geometric[:, 3:].isfinite().all())


def test_mixing_accepts_tensor_weights_and_promotes_to_float64():
    teachers = _teachers(count=2)
    teachers[1] = teachers[1].double()
    mixed = mix_teacher_logits(teachers, torch.tensor([0.4, 0.6]))
    assert mixed.dtype == torch.float64
    torch.testing.assert_close(mixed, _dense_mixture(teachers, [0.4, 0.6]).log(), rtol=1e-6, atol=1e-7)


def test_weights_summing_to_one_within_tolerance_are_accepted():
    teachers = _teachers(count=10, shape=(2, 5))
    mixed = mix_teacher_logits(teachers, [0.1] * 10)
    torch.testing.assert_close(mixed.double(), _dense_mixture(teachers, [0.1] * 10).log(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("logits_list", "weights", "mode", "error", "fragment"),
    [
        (None, [1.0, 1.0], "arithmetic", ValueError, "weights must sum to 1 (within 1e-06), got sum 2.0"),
        (None, [1.5, -0.5], "arithmetic", ValueError, "weights[1] must be a finite real number >= 0, got -0.5"),
        (None, [math.nan, 1.0], "arithmetic", ValueError, "weights[0] must be a finite real number >= 0"),
        (None, [INF, 0.0], "arithmetic", ValueError, "weights[0]"),
        (None, [True, False], "arithmetic", ValueError, "weights[0]"),
        (None, [1.0], "arithmetic", ValueError, "one entry per tensor of logits_list (2), got 1"),
        (None, torch.ones(2, 1), "arithmetic", ValueError, "weights must be 1-D"),
        (None, 1.0, "arithmetic", TypeError, "weights must be a sequence"),
        (None, [0.5, 0.5], "harmonic", ValueError, "mode must be one of ('arithmetic', 'geometric')"),
        ([], [], "arithmetic", ValueError, "logits_list must hold at least one tensor"),
        (torch.zeros(2, 3), [0.5, 0.5], "arithmetic", TypeError, "logits_list must be a list or tuple"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], [0.5, 0.5], "arithmetic", ValueError, "logits_list[1] must have"),
        (
            [torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)],
            [0.5, 0.5],
            "arithmetic",
            TypeError,
            "logits_list[1] must be a floating-point tensor",
        ),
    ],
)
def test_mixing_rejects_bad_arguments(logits_list, weights, mode, error, fragment):
    logits_list = [torch.zeros(2, 3), torch.zeros(2, 3)] if logits_list is None else logits_list
    with pytest.raises(error) as info:
        mix_teacher_logits(logits_list, weights, mode=mode)
    assert fragment in str(info.value)
    if mode == "arithmetic":
        with pytest.raises(error):
            generalized_jensen_shannon(logits_list, weights)


# --------------------------------------------------------------------------- generalized Jensen-Shannon


def test_gjs_matches_dense_formula_and_is_nonnegative():
    teachers, weights = _teachers(seed=10), [0.3, 0.3, 0.4]
    value = generalized_jensen_shannon(teachers, weights)
    mix = _dense_mixture(teachers, weights)
    expected = sum(
        w * (torch.softmax(x.double(), -1) * (torch.log_softmax(x.double(), -1) - mix.log())).sum(-1)
        for w, x in zip(weights, teachers)
    )
    assert value.shape == (4,)
    torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6)
    assert bool((value > 0).all())


def test_gjs_is_zero_for_identical_teachers():
    teacher = _teachers(count=1)[0]
    value = generalized_jensen_shannon([teacher, teacher.clone(), teacher + 3.0], [0.2, 0.3, 0.5])
    assert bool((value >= 0).all())
    torch.testing.assert_close(value, torch.zeros(4), rtol=0, atol=1e-6)


def test_gjs_of_disjoint_teachers_is_the_entropy_of_the_weights():
    first = torch.tensor([[0.0, 1.0, -INF, -INF]], dtype=torch.float64)
    second = torch.tensor([[-INF, -INF, 2.0, 0.5]], dtype=torch.float64)
    value = generalized_jensen_shannon([first, second], [0.25, 0.75])
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert value.item() == pytest.approx(entropy, rel=1e-12)


def test_gjs_gradient_matches_dense_autograd():
    teachers = [x.double().requires_grad_() for x in _teachers(count=2, seed=11)]
    generalized_jensen_shannon(teachers, [0.4, 0.6]).sum().backward()
    references = [x.detach().clone().requires_grad_() for x in teachers]
    mix = _dense_mixture(references, [0.4, 0.6])
    sum(
        w * (torch.softmax(x, -1) * (torch.log_softmax(x, -1) - mix.log())).sum()
        for w, x in zip([0.4, 0.6], references)
    ).backward()
    for got, want in zip(teachers, references):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- spans


def test_log1mexp_matches_high_precision_reference():
    points = [-1e-300, -1e-20, -1e-8, -0.3, -math.log(2.0), -0.7, -5.0, -40.0, -745.0]
    got = log1mexp(torch.tensor(points, dtype=torch.float64))
    with localcontext() as context:
        context.prec = 400  # enough digits that 1 − e^x keeps 1e-300
        for x, value in zip(points, got.tolist()):
            exact = float((1 - Decimal(x).exp()).ln())
            assert value == pytest.approx(exact, rel=1e-14)
    assert log1mexp(torch.tensor([0.0], dtype=torch.float64)).item() == -INF


def _span_reference(s_hidden, s_weight, s_labels, t_log_likelihoods, t_counts, s_ranges, config):
    """Full-logits float64 reference with explicit loops over spans."""
    log_p = torch.log_softmax(s_hidden @ s_weight.T, -1)
    valid = s_labels != config.ignore_index
    nll = [-log_p[i, s_labels[i]] if valid[i] else log_p.new_zeros(()) for i in range(len(s_labels))]
    terms = []
    for c, (start, stop) in enumerate(s_ranges.tolist()):
        if not any(valid[start:stop]) or t_counts[c] == 0:
            continue
        ls = -sum((nll[i] for i in range(start, stop)), log_p.new_zeros(()))
        lt = float(t_log_likelihoods[c])
        pt = math.exp(lt)
        log_else_s = torch.log(1 - torch.exp(ls))
        if config.objective == "binary_kl":
            other = (1 - pt) * (math.log(1 - pt) - log_else_s) if pt < 1 else 0.0
            terms.append(pt * (lt - ls) + other)
        else:
            terms.append(-(pt * ls + (1 - pt) * log_else_s))
    ce = sum(nll, log_p.new_zeros(()))
    span = sum(terms, log_p.new_zeros(()))
    if config.reduction == "mean":
        ce = ce / max(int(valid.sum()), 1)
        span = span / max(len(terms), 1)
    return config.student_ce_weight * ce + config.span_kl_weight * span, ce, span


def _span_problem(seed=12, dtype=torch.float64):
    gen = _generator(seed)
    s_hidden = (torch.randn(12, 4, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    s_weight = (torch.randn(9, 4, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    s_labels = torch.randint(0, 9, (12,), generator=gen)
    s_labels[[4, 9, 10]] = -100
    t_hidden = torch.randn(10, 3, generator=gen, dtype=torch.float64) * 0.5
    t_weight = torch.randn(11, 3, generator=gen, dtype=torch.float64) * 0.5
    t_labels = torch.randint(0, 11, (10,), generator=gen)
    t_labels[7] = -100
    # spans: ordinary, overlapping, one student token with a dropped teacher span ([7, 8) is all
    # ignored), an all-ignored student span ([9, 11)), an empty span, a long span
    s_ranges = torch.tensor([[0, 2], [1, 4], [4, 5], [5, 6], [9, 11], [6, 6], [2, 9]])
    t_ranges = torch.tensor([[0, 3], [2, 4], [4, 5], [7, 8], [5, 7], [8, 10], [1, 6]])
    return s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, AlignedSpanPairs(s_ranges, t_ranges)


def _reference_teacher(t_hidden, t_weight, t_labels, t_ranges):
    log_q = torch.log_softmax(t_hidden @ t_weight.T, -1)
    values, counts = [], []
    for start, stop in t_ranges.tolist():
        rows = [i for i in range(start, stop) if t_labels[i] != -100]
        values.append(sum(float(log_q[i, t_labels[i]]) for i in rows))
        counts.append(len(rows))
    return torch.tensor(values, dtype=torch.float64), torch.tensor(counts)


def test_span_teacher_matches_dense_reference_and_holds_no_graph():
    _, _, _, t_hidden, t_weight, t_labels, pairs = _span_problem()
    t_hidden.requires_grad_()
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    values, counts = _reference_teacher(t_hidden.detach(), t_weight, t_labels, pairs.teacher_ranges)
    assert isinstance(teacher, PrecomputedSpanTeacher) and teacher.num_spans == 7
    assert teacher.log_likelihoods.dtype == torch.float64 and not teacher.log_likelihoods.requires_grad
    torch.testing.assert_close(teacher.log_likelihoods, values, rtol=1e-12, atol=1e-12)
    assert teacher.valid_counts.tolist() == counts.tolist() == [3, 2, 1, 0, 2, 2, 5]


@pytest.mark.parametrize("objective", ["binary_kl", "binary_ce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_span_loss_value_and_gradients_match_full_logits_reference(objective, reduction):
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, pairs = _span_problem()
    config = AlignedLikelihoodConfig(
        student_ce_weight=0.6, span_kl_weight=0.7, reduction=reduction, objective=objective
    )
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    hidden, weight = s_hidden.clone().requires_grad_(), s_weight.clone().requires_grad_()
    out = aligned_span_distillation_loss(hidden, weight, s_labels, teacher, pairs, config)
    out.loss.backward()

    ref_hidden, ref_weight = s_hidden.clone().requires_grad_(), s_weight.clone().requires_grad_()
    loss, ce, span = _span_reference(
        ref_hidden, ref_weight, s_labels, teacher.log_likelihoods, teacher.valid_counts, pairs.student_ranges, config
    )
    loss.backward()
    assert isinstance(out, AlignedSpanLossOutput)
    assert not out.student_ce.requires_grad and not out.span_kl.requires_grad
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(out.student_ce, ce.detach(), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(out.span_kl, span.detach(), rtol=1e-11, atol=1e-12)
    assert span.item() > 1e-3
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-10, atol=1e-12)


def test_span_loss_in_float32_stays_close_to_float64_reference():
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, pairs = _span_problem(seed=13)
    teacher = build_precomputed_span_teacher(t_hidden.float(), t_weight.float(), t_labels, pairs.teacher_ranges)
    hidden, weight = s_hidden.float().requires_grad_(), s_weight.float().requires_grad_()
    out = aligned_span_distillation_loss(hidden, weight, s_labels, teacher, pairs)
    out.loss.backward()
    ref_hidden, ref_weight = s_hidden.clone().requires_grad_(), s_weight.clone().requires_grad_()
    loss, _, _ = _span_reference(
        ref_hidden,
        ref_weight,
        s_labels,
        teacher.log_likelihoods,
        teacher.valid_counts,
        pairs.student_ranges,
        AlignedLikelihoodConfig(),
    )
    loss.backward()
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), ref_weight.grad, rtol=1e-4, atol=1e-5)


def test_dropped_spans_do_not_change_the_loss():
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, pairs = _span_problem()
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    kept = [0, 1, 2, 6]  # 3: teacher span all ignored, 4: student span all ignored, 5: empty
    kept_pairs = AlignedSpanPairs(pairs.student_ranges[kept], pairs.teacher_ranges[kept])
    kept_teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, kept_pairs.teacher_ranges)
    for reduction in ("mean", "sum"):
        config = AlignedLikelihoodConfig(reduction=reduction, student_ce_weight=0.0)
        full = aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher, pairs, config)
        only_kept = aligned_span_distillation_loss(s_hidden, s_weight, s_labels, kept_teacher, kept_pairs, config)
        torch.testing.assert_close(full.span_kl, only_kept.span_kl, rtol=1e-14, atol=0)
        assert full.span_kl.item() > 0


def test_span_loss_without_kept_spans_has_a_zero_span_term():
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, _ = _span_problem()
    pairs = AlignedSpanPairs(torch.tensor([[9, 11], [6, 6]]), torch.tensor([[0, 2], [3, 4]]))
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    hidden = s_hidden.clone().requires_grad_()
    out = aligned_span_distillation_loss(hidden, s_weight, s_labels, teacher, pairs)
    assert out.span_kl.item() == 0.0
    torch.testing.assert_close(out.loss, out.student_ce)
    out.loss.backward()
    assert bool(hidden.grad.isfinite().all())


def test_span_loss_with_no_pairs_is_the_student_cross_entropy():
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, _ = _span_problem()
    empty = torch.zeros(0, 2, dtype=torch.long)
    pairs = AlignedSpanPairs(empty, empty)
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    out = aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher, pairs)
    log_p = torch.log_softmax(s_hidden @ s_weight.T, -1)
    valid = s_labels != -100
    expected = -log_p[valid, s_labels[valid]].mean()
    assert teacher.num_spans == 0 and out.span_kl.item() == 0.0
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-12)


def test_zero_weights_leave_terms_out_of_the_loss_but_report_them():
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, pairs = _span_problem()
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    span_only = aligned_span_distillation_loss(
        s_hidden, s_weight, s_labels, teacher, pairs, AlignedLikelihoodConfig(student_ce_weight=0.0)
    )
    ce_only = aligned_span_distillation_loss(
        s_hidden, s_weight, s_labels, teacher, pairs, AlignedLikelihoodConfig(span_kl_weight=0.0)
    )
    assert span_only.loss.item() == span_only.span_kl.item() and span_only.student_ce.item() > 0
    assert ce_only.loss.item() == ce_only.student_ce.item() and ce_only.span_kl.item() > 0
    hidden = s_hidden.clone().requires_grad_()
    nothing = aligned_span_distillation_loss(
        hidden, s_weight, s_labels, teacher, pairs, AlignedLikelihoodConfig(student_ce_weight=0.0, span_kl_weight=0.0)
    )
    nothing.loss.backward()
    assert nothing.loss.item() == 0.0 and bool((hidden.grad == 0).all())


def _certain_student(rows=3):
    """A student whose every label has probability exactly 1 in floating point (``nll = 0``)."""
    hidden = torch.eye(rows, dtype=torch.float64) * 2000.0
    return hidden, torch.eye(rows, dtype=torch.float64), torch.arange(rows)


def test_certain_teacher_reduces_binary_kl_to_minus_student_log_likelihood():
    s_hidden, s_weight, s_labels, *_ = _span_problem()
    pairs = AlignedSpanPairs(torch.tensor([[0, 2], [2, 3]]), torch.tensor([[0, 1], [1, 2]]))
    teacher = PrecomputedSpanTeacher(pairs.teacher_ranges, torch.zeros(2, dtype=torch.float64), torch.ones(2).long())
    config = AlignedLikelihoodConfig(student_ce_weight=0.0, reduction="sum")
    hidden = s_hidden.clone().requires_grad_()
    out = aligned_span_distillation_loss(hidden, s_weight, s_labels, teacher, pairs, config)
    out.loss.backward()
    ref_hidden = s_hidden.clone().requires_grad_()
    log_p = torch.log_softmax(ref_hidden @ s_weight.T, -1)
    expected = -log_p[[0, 1, 2], s_labels[:3]].sum()  # −ℓ_s summed over the two spans
    expected.backward()
    torch.testing.assert_close(out.loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("objective", ["binary_kl", "binary_ce"])
def test_certain_student_against_uncertain_teacher_is_infinite_with_finite_gradient(objective):
    hidden, weight, labels = _certain_student()
    pairs = AlignedSpanPairs(torch.tensor([[0, 1], [1, 3]]), torch.tensor([[0, 1], [1, 2]]))
    teacher_ll = torch.tensor([-0.5, 0.0], dtype=torch.float64)  # span 1: both certain, contributes 0
    teacher = PrecomputedSpanTeacher(pairs.teacher_ranges, teacher_ll, torch.ones(2).long())
    hidden.requires_grad_()
    config = AlignedLikelihoodConfig(objective=objective)
    out = aligned_span_distillation_loss(hidden, weight, labels, teacher, pairs, config)
    assert out.student_ce.item() == 0.0
    assert out.span_kl.item() == INF and out.loss.item() == INF
    out.loss.backward()
    assert bool(hidden.grad.isfinite().all())
    both_certain = PrecomputedSpanTeacher(
        pairs.teacher_ranges, torch.zeros(2, dtype=torch.float64), torch.ones(2).long()
    )
    assert aligned_span_distillation_loss(hidden, weight, labels, both_certain, pairs, config).span_kl.item() == 0


def test_rounding_below_zero_in_the_core_nll_does_not_make_nan(monkeypatch):
    original = spans_module.distillation_loss

    def slightly_negative(*args, **kwargs):
        out = original(*args, **kwargs)
        return out._replace(loss=out.loss - 1e-12)  # a backend's rounding: nll = −ε

    monkeypatch.setattr(spans_module, "distillation_loss", slightly_negative)
    hidden, weight, labels = _certain_student()
    pairs = AlignedSpanPairs(torch.tensor([[0, 2]]), torch.tensor([[0, 1]]))
    teacher = PrecomputedSpanTeacher(pairs.teacher_ranges, torch.zeros(1, dtype=torch.float64), torch.ones(1).long())
    out = aligned_span_distillation_loss(hidden, weight, labels, teacher, pairs)
    assert out.span_kl.item() == 0.0


def test_span_loss_reads_per_token_likelihoods_from_the_core(monkeypatch):
    calls = []
    original = spans_module.distillation_loss

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(spans_module, "distillation_loss", spy)
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, pairs = _span_problem()
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher, pairs)
    assert len(calls) == 2
    for kwargs in calls:
        assert kwargs["reduction"] == "none" and kwargs["kl_weight"] == 0.0 and kwargs["teacher_ce_weight"] == 0.0


@pytest.mark.parametrize(
    ("student_ranges", "teacher_ranges", "error", "fragment"),
    [
        (torch.tensor([[0.0, 1.0]]), torch.tensor([[0, 1]]), TypeError, "student_ranges must be an integer"),
        (torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1]]), ValueError, "student_ranges must have shape [C, 2]"),
        (torch.tensor([[0, 1]]), torch.tensor([[3, 2]]), ValueError, "got [3, 2] at row 0"),
        (torch.tensor([[0, 1], [-1, 2]]), torch.tensor([[0, 1], [1, 2]]), ValueError, "0 <= start <= stop"),
        (torch.tensor([[0, 1]]), torch.tensor([[0, 1], [1, 2]]), ValueError, "same number of spans, got 1 and 2"),
        ([[0, 1]], torch.tensor([[0, 1]]), TypeError, "student_ranges must be a torch.Tensor"),
        (torch.tensor([[True, True]]), torch.tensor([[0, 1]]), TypeError, "integer tensor, got dtype torch.bool"),
    ],
)
def test_span_pairs_reject_bad_ranges(student_ranges, teacher_ranges, error, fragment):
    with pytest.raises(error) as info:
        AlignedSpanPairs(student_ranges, teacher_ranges)
    assert fragment in str(info.value)


def test_span_pairs_store_int64():
    pairs = AlignedSpanPairs(torch.tensor([[0, 2]], dtype=torch.int32), torch.tensor([[1, 1]], dtype=torch.int16))
    assert pairs.student_ranges.dtype == pairs.teacher_ranges.dtype == torch.long and pairs.num_spans == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"objective": "kl"}, ValueError, "objective must be one of ('binary_kl', 'binary_ce'), got 'kl'"),
        ({"reduction": "none"}, ValueError, "reduction must be one of ('mean', 'sum'), got 'none'"),
        ({"span_kl_weight": -0.1}, ValueError, "span_kl_weight must be a finite real number >= 0, got -0.1"),
        ({"student_ce_weight": math.inf}, ValueError, "student_ce_weight must be a finite real number"),
        ({"ignore_index": True}, TypeError, "ignore_index must be an int, got True"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, fragment):
    with pytest.raises(error) as info:
        AlignedLikelihoodConfig(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("values", "counts", "error", "fragment"),
    [
        (torch.tensor([0.1, -1.0], dtype=torch.float64), torch.ones(2).long(), ValueError, "<= 0"),
        (torch.tensor([math.nan, -1.0]), torch.ones(2).long(), ValueError, "no NaN"),
        (torch.tensor([-1.0]), torch.ones(1).long(), ValueError, "log_likelihoods must have shape (2,)"),
        (torch.tensor([-1.0, -1.0]), torch.ones(2), TypeError, "valid_counts must be an int64 tensor"),
        (torch.tensor([-1, -1]), torch.ones(2).long(), TypeError, "log_likelihoods must be a floating-point"),
        (torch.tensor([-1.0, -1.0]), torch.tensor([1, -1]), ValueError, "valid_counts must be >= 0"),
        (torch.tensor([-1.0, -1.0], requires_grad=True), torch.ones(2).long(), ValueError, "must not require grad"),
    ],
)
def test_span_teacher_rejects_bad_values(values, counts, error, fragment):
    with pytest.raises(error) as info:
        PrecomputedSpanTeacher(torch.tensor([[0, 1], [1, 2]]), values, counts)
    assert fragment in str(info.value)


def test_span_functions_reject_mismatched_inputs():
    s_hidden, s_weight, s_labels, t_hidden, t_weight, t_labels, pairs = _span_problem()
    teacher = build_precomputed_span_teacher(t_hidden, t_weight, t_labels, pairs.teacher_ranges)
    with pytest.raises(
        ValueError, match="teacher_ranges must stop within the 10 rows of teacher_labels, got a stop of 11"
    ):
        build_precomputed_span_teacher(t_hidden, t_weight, t_labels, torch.tensor([[0, 11]]))
    short = AlignedSpanPairs(torch.tensor([[0, 13]] * 7), pairs.teacher_ranges)
    with pytest.raises(ValueError, match="pairs.student_ranges must stop within the 12 rows of student_labels"):
        aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher, short)
    shifted = AlignedSpanPairs(pairs.student_ranges, pairs.teacher_ranges.flip(0))
    with pytest.raises(ValueError, match="span_teacher must be built on pairs.teacher_ranges"):
        aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher, shifted)
    with pytest.raises(TypeError, match="pairs must be an AlignedSpanPairs, got tuple"):
        aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher, (pairs.student_ranges,))
    with pytest.raises(TypeError, match="span_teacher must be a PrecomputedSpanTeacher"):
        aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher.log_likelihoods, pairs)
    with pytest.raises(TypeError, match="config must be an AlignedLikelihoodConfig or None, got dict"):
        aligned_span_distillation_loss(s_hidden, s_weight, s_labels, teacher, pairs, {"reduction": "sum"})
    with pytest.raises(ValueError, match=r"student_labels must be 1-D \(BT,\), got shape \(3, 4\)"):
        aligned_span_distillation_loss(s_hidden, s_weight, s_labels.reshape(3, 4), teacher, pairs)
