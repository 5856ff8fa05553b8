"""Distributed worker for the Triton-backend tests (importable by the spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import orda_tp

from .cases import call_kwargs, make_problem, relative_error, separate_problem
from .tp_workers import chunk_ranges


def triton_tp_worker(rank: int, world: int, variants: list[str]) -> list[str]:
    """Every variant × teacher mode through ``backend="triton"`` on vocabulary shards, against the
    single-device torch backend; returns the mismatches."""
    config = orda_tp.KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=5), vocab_block=64)
    problems: list[str] = []
    start, stop = chunk_ranges(203, world)[rank]
    for variant in variants:
        for mode in ("tied", "separate", "precomputed"):
            if variant in ("mutual", "cojeffreys") and mode == "precomputed":
                continue
            full = make_problem(rows=12, vocab=203, seed=5, dtype=torch.float32)
            if mode == "separate":
                full = separate_problem(full).to(torch.float32)
            kwargs = call_kwargs(variant, mode, "mean")
            expected = orda_tp.distillation_loss(
                full.student_hidden,
                full.weight,
                full.labels,
                full.teacher(mode),
                backend="torch",
                config=config,
                **kwargs,
            )
            expected_grads = torch.autograd.grad(expected.loss, [full.student_hidden, full.weight])
            hidden = full.student_hidden.detach().clone().requires_grad_()
            weight = full.weight.detach()[start:stop].clone().requires_grad_()
            teacher: orda_tp.TiedTeacher | orda_tp.SeparateTeacher | orda_tp.PrecomputedTeacher
            if mode == "tied":
                teacher = orda_tp.TiedTeacher(full.teacher_hidden.detach())
            elif mode == "separate":
                teacher = orda_tp.SeparateTeacher(
                    full.teacher_hidden.detach(), full.teacher_weight.detach()[start:stop]
                )
            else:
                teacher = orda_tp.PrecomputedTeacher(logits=full.teacher_logits[:, start:stop])
            out = orda_tp.distillation_loss(
                hidden,
                weight,
                full.labels,
                teacher,
                backend="triton",
                config=config,
                tp_group=dist.group.WORLD,
                **kwargs,
            )
            grads = torch.autograd.grad(out.loss, [hidden, weight])
            errors = [
                relative_error(out.loss, expected.loss),
                relative_error(grads[0], expected_grads[0]),
                relative_error(grads[1], expected_grads[1][start:stop]),
            ]
            if max(errors) > 1e-5:
                problems.append(f"rank {rank} {variant} {mode}: errors {errors}")
    return problems
