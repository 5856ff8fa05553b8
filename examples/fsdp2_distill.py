"""Distillation under FSDP2, alone or with a vocabulary-parallel head on a 2-D (dp, tp) mesh.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_distill.py            # FSDP2 over 2 ranks
    torchrun --standalone --nproc-per-node 4 examples/fsdp2_distill.py --tp 2     # (dp=2, tp=2) mesh

The student's LM head is an ``orda_tp.DistillationHead``: the loss runs inside the head's forward,
where FSDP2 has gathered its weight (and, with ``--tp``, ``VocabParallel`` has split it along the
vocabulary over the tp ranks). Every block, the head and the root are ``fully_shard`` units, the
common per-block recipe. The frozen teacher is FSDP2-sharded too; its head is read through
``orda_tp.TeacherHead``, which gathers the weight for the call. After a few steps the script checks
one step against the single-process computation in float64 on gathered weights and prints
``check PASS`` (or exits 1 on every rank).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import orda_tp

VOCAB, SEQ, BATCH = 101, 8, 4
LOSS = {"kl_weight": 1.0, "kl_temperature": 2.0, "teacher_ce_weight": 0.0}


class TinyLM(nn.Module):
    """Embedding, a few residual MLP blocks, a final norm and an LM head."""

    def __init__(self, hidden: int, lm_head: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = lm_head

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the LM head receives: ``[batch, seq, hidden]``."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, teacher: orda_tp.TeacherHead) -> orda_tp.HeadOutput:
        return self.lm_head(self.hidden_states(tokens), labels=labels, teacher=teacher)


def build(hidden: int, seed: int, dtype: torch.dtype) -> TinyLM:
    """The same model on every rank (seeded), its head a DistillationHead computing the loss."""
    torch.manual_seed(seed)
    return TinyLM(hidden, orda_tp.DistillationHead(hidden, VOCAB, **LOSS)).to(dtype)


def shard(model: TinyLM, dp: DeviceMesh, tp: DeviceMesh | None) -> None:
    """Vocabulary-parallel head over tp (if any), then FSDP2 over dp: per block, the head, the root."""
    if tp is not None:
        parallelize_module(model, tp, {"lm_head": orda_tp.VocabParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model.lm_head, mesh=dp)
    fully_shard(model, mesh=dp)


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's tokens and next-token labels (the last position ignored)."""
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    return tokens, labels


def teacher_of(teacher: TinyLM, tokens: torch.Tensor) -> orda_tp.TeacherHead:
    """The frozen teacher's final hidden rows and its head module."""
    with torch.no_grad():
        hidden = teacher.hidden_states(tokens)
    return orda_tp.TeacherHead(hidden.reshape(-1, hidden.shape[-1]), teacher.lm_head)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check_step(student: TinyLM, teacher: TinyLM, reference: TinyLM, ref_teacher: TinyLM, dp: DeviceMesh) -> float:
    """Worst relative error over the ranks of one step's loss and gradients against the plain
    single-process model (gradients averaged over dp, as FSDP2 averages them), in float64."""
    tokens, labels = batch(10_000, dp.get_local_rank())
    for model in (student, reference):
        model.zero_grad()
    out = student(tokens, labels, teacher_of(teacher, tokens))
    out.loss.backward()
    want = reference(tokens, labels, teacher_of(ref_teacher, tokens))
    want.loss.backward()
    errors = [float((full(out.loss.detach()) - want.loss.detach()).abs() / want.loss.detach().abs())]
    for got, param in zip(student.parameters(), reference.parameters()):
        grad = param.grad.clone()
        dist.all_reduce(grad, group=dp.get_group())
        grad /= dp.size()
        errors.append(float((full(got.grad) - grad).norm() / grad.norm()))
    worst = torch.tensor(max(errors), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the head (the rest is dp)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], (mesh["tp"] if args.tp > 1 else None)

    dtype = torch.float64  # float64 so that the final check is exact; train in bf16/fp32 as usual
    student, teacher = build(32, seed=0, dtype=dtype), build(48, seed=1, dtype=dtype).requires_grad_(False)
    reference, ref_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    shard(student, dp, tp)
    shard(teacher, dp, tp)
    register_fsdp_forward_method(teacher, "hidden_states")  # FSDP gathers the root's weights for it too

    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    for step in range(1, args.steps + 1):
        tokens, labels = batch(step, dp.get_local_rank())
        out = student(tokens, labels, teacher_of(teacher, tokens))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if rank == 0 and step in (1, args.steps):
            values = f"loss {out.loss.item():.4f} student_ce {out.student_ce.item():.4f} kl {out.kl.item():.4f}"
            print(f"step {step}: {values}")

    # The reference continues from the trained weights: gather them into the plain copies.
    with torch.no_grad():
        for got, param in zip(student.parameters(), reference.parameters()):
            param.copy_(full(got))
    error = check_step(student, teacher, reference, ref_teacher, dp)
    passed = error <= 1e-12
    if rank == 0:
        print(f"mesh dp={dp.size()} tp={args.tp}: check {'PASS' if passed else 'FAIL'} max_rel_err {error:.2e}")
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    code = main()
    # Leave without interpreter shutdown: gloo's worker threads release a finished collective's tensors
    # only after wait() has returned, and a release during shutdown aborts the process ("terminate
    # called without an active exception"; docs/integrations.md §10).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
