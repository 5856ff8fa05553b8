"""A 2-rank tensor-parallel job written like the guide's examples (§12.2 and §13.3), for
tests/test_clean_exit.py: one loss call and its backward, one line per rank, exit.

Run with: python -m torch.distributed.run --standalone --nproc-per-node 2 tests/support/exit_job.py PATH
where PATH is ``hidden`` (``distillation_loss`` from hidden states: the row walk's asynchronous
gradient sums) or ``logits`` (``KDLoss`` on vocabulary-sharded logits: all-gathers only). Each
rank prints ``exit_job PATH RANK loss=L reference=R grad_error=E``: the tensor-parallel loss, the
single-device loss on the full tensors (computed first, so that the job ends right after its last
collective), and max |grad - reference grad| / max |reference grad| over this rank's columns.

As in the guide, the group and the loss stay referenced by module globals until the interpreter
exits, so the process group outlives ``destroy_process_group()`` and its worker threads are joined
only at interpreter exit: the case that aborted ("terminate called without an active exception")
when a worker thread still held a collective's tensors then.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import orda_tp

PATH = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tp_group = dist.group.WORLD
torch.manual_seed(0)  # the full tensors are built identically on every rank

if PATH == "hidden":  # guide §12.2
    BT, H, V = 16, 32, 1001
    hidden = torch.randn(BT, H, requires_grad=True)
    labels = torch.randint(0, V, (BT,))
    teacher_hidden, full_teacher_weight = torch.randn(BT, 48), torch.randn(V, 48) / 48**0.5
    full_weight = (torch.randn(V, H) / H**0.5).requires_grad_()
    columns = torch.arange(V).chunk(world)[rank]

    teacher = orda_tp.SeparateTeacher(teacher_hidden, full_teacher_weight)
    reference = orda_tp.distillation_loss(hidden, full_weight, labels, teacher, kl_weight=1.0, kl_temperature=2.0).loss
    reference.backward()
    reference_grad = full_weight.grad[columns]

    weight = full_weight.detach()[columns].clone().requires_grad_()
    shard_teacher = orda_tp.SeparateTeacher(teacher_hidden, full_teacher_weight[columns])
    out = orda_tp.distillation_loss(
        hidden, weight, labels, shard_teacher, kl_weight=1.0, kl_temperature=2.0, tp_group=tp_group
    )
    loss = out.loss
    loss.backward()
    grad = weight.grad
elif PATH == "logits":  # guide §13.3
    batch, seq, vocab = 2, 8, 1001
    student_full = torch.randn(batch, seq, vocab, requires_grad=True)
    teacher_full = torch.randn(batch, seq, vocab)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[:, :2] = -100  # e.g. the prompt
    columns = torch.arange(vocab).chunk(world)[rank]

    reference = orda_tp.KDLoss(temperature=2.0)(student_full, teacher_full, labels)
    reference.backward()
    reference_grad = student_full.grad[..., columns]

    student = student_full.detach()[..., columns].clone().requires_grad_()
    loss = orda_tp.KDLoss(temperature=2.0, tp_group=tp_group, chunk_size=4)(student, teacher_full[..., columns], labels)
    loss.backward()
    grad = student.grad
else:
    raise SystemExit(f"unknown path {PATH!r}: hidden or logits")

grad_error = ((grad - reference_grad).abs().max() / reference_grad.abs().max()).item()
line = f"exit_job {PATH} {rank} loss={loss.item():.9g} reference={reference.item():.9g} grad_error={grad_error:.3g}\n"
sys.stdout.write(line)  # one write: the ranks share torchrun's stdout
sys.stdout.flush()
dist.destroy_process_group()
