"""Every door's outputs here against another checkout of orda_tp, compared exactly: a restructuring
moves no number.

Each version runs the same calls in its own process (``PYTHONPATH`` pointing at its checkout) and
saves what they return: ``distillation_loss`` for every teacher kind and a spread of variants,
reductions and settings (label smoothing, z-loss, soft-caps, token weights, ignored rows) with the
gradients of every input; ``DistillationHead``; ``KDLoss`` with the student logits' gradient and a
top-k cache; ``flash_ce_kd_loss``; ``teacher_topk`` and ``teacher_topk_of_logits``. With ``--tp``
each version also runs the calls on 2 gloo ranks (``torchrun``, the head split unevenly), rank 0's
results saved. Only public names are called, so any two versions compare. Two values are the same
when they are equal as numbers (``-0.0 == 0.0``) or both NaN; the script prints each output that
differs with its largest difference, and exits 1 if any does.

Commands:
  git archive <commit> orda_tp | tar -x -C /tmp/base   # the other version, e.g. the last release
  python checks/same_outputs.py --other /tmp/base                       # CPU, torch backend
  TRITON_INTERPRET=1 python checks/same_outputs.py --other /tmp/base --backend triton
  python checks/same_outputs.py --other /tmp/base --device cuda --backend triton --tp   # a GPU
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
Outputs = dict[str, torch.Tensor]


def _inputs(device: str, rows: int = 24, hidden: int = 16, vocab: int = 61) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).float().to(device)

    labels = torch.randint(0, vocab - 3, (rows,), generator=generator).to(device)
    labels[::5] = -100
    return {
        "hidden": randn(rows, hidden),
        "weight": randn(vocab, hidden, scale=0.5),
        "teacher_hidden": randn(rows, hidden),
        "teacher_hidden_wide": randn(rows, hidden + 8),
        "teacher_weight": randn(vocab, hidden + 8, scale=0.5),
        "teacher_logits": randn(rows, vocab, scale=2.0),
        "student_logits": randn(rows, vocab, scale=2.0),
        "token_weights": randn(rows).abs(),
        "labels": labels,
    }


def _grads(loss: torch.Tensor, tensors: dict[str, torch.Tensor]) -> Outputs:
    wanted = {name: tensor for name, tensor in tensors.items() if tensor.requires_grad}
    grads = torch.autograd.grad(loss, list(wanted.values()), allow_unused=True)
    return {f"grad.{name}": grad for name, grad in zip(wanted, grads) if grad is not None}


def _teachers(orda_tp: Any, x: dict[str, torch.Tensor], shard: slice) -> dict[str, Callable[[], Any]]:
    """The teachers of every kind, their heads and logits cut to this rank's ``shard`` of columns."""
    topk = orda_tp.teacher_topk_of_logits(x["teacher_logits"], 8)  # global ids: the whole cache on every rank
    hidden, weight = x["teacher_hidden_wide"], x["teacher_weight"][shard]
    return {
        "tied": lambda: orda_tp.TiedTeacher(x["teacher_hidden"]),
        "separate": lambda: orda_tp.SeparateTeacher(hidden, weight),
        "logits": lambda: orda_tp.PrecomputedTeacher(logits=x["teacher_logits"][:, shard]),
        "hidden": lambda: orda_tp.PrecomputedTeacher(teacher_hidden=hidden, teacher_weight=weight),
        "topk": lambda: _retempered(topk),
    }


def _retempered(topk: Any) -> Any:
    """A top-k result as a teacher that every checkout reads alike at any temperature: re-tempered
    (``retemper=True``; a checkout before the argument existed always re-tempered)."""
    try:
        return topk.teacher("uniform", retemper=True)
    except TypeError:
        return topk.teacher("uniform")


LOSS_SETTINGS: dict[str, dict[str, Any]] = {
    "ce": {},
    "forward": {"kl_weight": 1.0, "kl_temperature": 2.0},
    "reverse_sum": {"kl_weight": 0.7, "kl_divergence": "reverse", "reduction": "sum"},
    "jeffreys_none": {"kl_weight": 1.0, "kl_divergence": "jeffreys", "reduction": "none"},
    "skew_js_terms": {
        "kl_weight": 1.0,
        "kl_divergence": "skew_js",
        "label_smoothing": 0.1,
        "z_loss_weight": 1e-3,
        "logit_softcap": 5.0,
    },  # fmt: skip
    "alpha": {"kl_weight": 1.0, "kl_divergence": "alpha_divergence", "kl_temperature": 1.5},
    "dkd": {"kl_weight": 1.0, "kl_divergence": "dkd"},
}


def _loss_cases(orda_tp: Any, x: dict[str, torch.Tensor], backend: str, group: Any, shard: slice) -> Outputs:
    """``distillation_loss`` of every teacher kind and setting, its outputs and input gradients."""
    out: Outputs = {}
    tp = {} if group is None else {"tp_group": group}
    for teacher_name, teacher in _teachers(orda_tp, x, shard).items():
        for name, settings in LOSS_SETTINGS.items():
            hidden = x["hidden"].clone().requires_grad_()
            weight = x["weight"][shard].clone().requires_grad_()
            extra = {"teacher_ce_weight": 0.5} if teacher_name == "tied" and "kl_weight" in settings else {}
            extra["token_weights"] = x["token_weights"] if name == "forward" else None
            result = orda_tp.distillation_loss(
                hidden, weight, x["labels"], teacher(), backend=backend, **settings, **extra, **tp
            )
            key = f"loss.{teacher_name}.{name}"
            out.update({f"{key}.{field}": value.detach() for field, value in result._asdict().items()})
            total = result.loss.sum() if settings.get("reduction") == "none" else result.loss
            out.update({f"{key}.{k}": v for k, v in _grads(total, {"hidden": hidden, "weight": weight}).items()})
    return out


def _other_doors(orda_tp: Any, x: dict[str, torch.Tensor], backend: str, group: Any, shard: slice) -> Outputs:
    out: Outputs = {}
    tp = {} if group is None else {"tp_group": group}
    student = x["student_logits"][:, shard].clone().requires_grad_()
    for variant in ("forward", "reverse", "dkd"):
        loss = orda_tp.KDLoss(temperature=2.0, kl_divergence=variant, backend=backend, **tp)(
            student, x["teacher_logits"][:, shard], x["labels"]
        )
        out[f"kd_loss.{variant}"] = loss.detach()
        out[f"kd_loss.{variant}.grad"] = torch.autograd.grad(loss, student)[0]
    cache = orda_tp.teacher_topk_of_logits(x["teacher_logits"], 8).teacher("uniform")
    loss = orda_tp.KDLoss(backend=backend, **tp)(student, cache, x["labels"])
    out["kd_loss.topk"] = loss.detach()
    out["kd_loss.topk.grad"] = torch.autograd.grad(loss, student)[0]
    ce, kd = orda_tp.flash_ce_kd_loss(
        x["student_logits"][:, shard], x["teacher_hidden_wide"], x["teacher_weight"][shard], x["labels"],
        ignore_index=-100, temperature=2.0, backend=backend, **tp,
    )  # fmt: skip
    out["flash.ce"], out["flash.kd"] = ce, kd
    for name, found in (
        ("topk", orda_tp.teacher_topk(x["teacher_hidden_wide"], x["teacher_weight"][shard], 7, temperature=2.0, **tp)),
        ("topk_of_logits", orda_tp.teacher_topk_of_logits(x["teacher_logits"][:, shard], 7, logit_softcap=4.0, **tp)),
    ):
        # The tensors (a later TeacherTopK also states its settings, which are not outputs).
        out.update({f"{name}.{field}": value for field, value in found._asdict().items() if torch.is_tensor(value)})
    if group is None:
        head = orda_tp.DistillationHead(x["weight"].shape[1], x["weight"].shape[0], kl_weight=1.0, backend=backend)
        with torch.no_grad():
            head.weight.copy_(x["weight"])
        result = head(x["hidden"].view(4, -1, x["hidden"].shape[1]), labels=x["labels"].view(4, -1),
                      teacher=orda_tp.TiedTeacher(x["teacher_hidden"]))  # fmt: skip
        out["head.loss"] = result.loss.detach()
        out["head.grad.weight"] = torch.autograd.grad(result.loss, head.weight)[0]
    return out


def dump(path: Path, device: str, backend: str, tp: bool) -> None:
    """Run every call with the ``orda_tp`` on ``sys.path`` and save the outputs to ``path``."""
    import orda_tp

    group, shard = None, slice(None)
    if tp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        vocab = _inputs(device)["weight"].shape[0]
        bounds = [0, vocab // world + 3, vocab] if world == 2 else torch.linspace(0, vocab, world + 1).long().tolist()
        group, shard = dist.group.WORLD, slice(bounds[rank], bounds[rank + 1])
    x = _inputs(device)
    outputs = {**_loss_cases(orda_tp, x, backend, group, shard), **_other_doors(orda_tp, x, backend, group, shard)}
    if not tp or dist.get_rank() == 0:
        torch.save({name: value.detach().cpu() for name, value in outputs.items()}, path)
    if tp:
        dist.destroy_process_group()


def _run_version(checkout: Path, path: Path, args: argparse.Namespace) -> None:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, str(Path(__file__).resolve()), "--dump", str(path), "--device", args.device]
    command += ["--backend", args.backend] + (["--tp"] if args.tp else [])
    if args.tp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *command[1:]]
    subprocess.run(command, check=True, env=env, cwd=tempfile.gettempdir())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def compare(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as folder:
        here, other = Path(folder, "here.pt"), Path(folder, "other.pt")
        _run_version(ROOT, here, args)
        _run_version(Path(args.other).resolve(), other, args)
        mine, theirs = torch.load(here), torch.load(other)
    differing = [name for name in mine if name not in theirs or not same(mine[name], theirs[name])]
    missing = sorted(set(theirs) - set(mine))
    for name in differing:
        if name in theirs and mine[name].shape == theirs[name].shape:
            gap = (mine[name].double() - theirs[name].double()).abs().nan_to_num(float("inf")).max().item()
            print(f"DIFFERS {name}: largest difference {gap:.3e}")
        else:
            print(f"DIFFERS {name}: absent or another shape in the other version")
    for name in missing:
        print(f"MISSING {name}: only the other version returns it")
    print(f"{len(mine) - len(differing)} of {len(mine)} outputs the same ({args.device}, {args.backend}"
          f"{', 2 gloo ranks' if args.tp else ''})")  # fmt: skip
    return 1 if differing or missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="the other checkout's root (it holds orda_tp/)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="torch", choices=("torch", "triton"))
    parser.add_argument("--tp", action="store_true", help="also on 2 gloo ranks (under torchrun)")
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump:
        dump(Path(args.dump), args.device, args.backend, args.tp)
        return 0
    if not args.other:
        parser.error("--other is required")
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
