"""Compile the Triton kernels of representative calls for an H200 (sm_90) on a machine without a GPU.

The test suite runs the kernels under Triton's CPU interpreter, which accepts code that the compiler
refuses (a module global that is not a ``tl.constexpr``, a loop-carried value whose type changes).
This script runs each call below with ``backend="triton"`` on CPU tensors, captures every kernel
launch instead of running it (the outputs are left uninitialized: only the launches matter), and
compiles each distinct launch (kernel × constexpr arguments × argument types) through Triton's
frontend and ``ptxas`` for ``GPUTarget("cuda", 90, 32)``. It needs the ``triton`` wheel's CUDA
backend (it bundles ``ptxas``), not a GPU or its driver.

    python checks/compile_kernels.py          # prints one line per compiled launch; exit 1 on a failure
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be compiled, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import orda_tp  # noqa: E402
from orda_tp.engine import block_math, triton_math  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.bool: "*i1",
}
Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


def signature_type(value: object) -> object:
    """Triton's signature type of one launch argument (a tuple's, element by element)."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, tuple):
        return tuple(signature_type(item) for item in value)
    raise TypeError(f"no Triton signature type for {type(value).__name__}")


def captured_launches(call: Callable[[], object]) -> list[Launch]:
    """The distinct kernel launches of ``call`` (run with the launches replaced by a recorder)."""
    launches: dict[str, Launch] = {}

    def recorder(kernel: Any, grid: tuple[int, ...]) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            key = repr((kernel.fn.__name__, [signature_type(a) for a in args], sorted(map(repr, kwargs.items()))))
            launches.setdefault(key, (kernel, args, kwargs))

        return record

    def available(*args: object, **kwargs: object) -> None:
        return None

    patched = [(triton_math, "grid_launcher", recorder), (block_math, "unavailable_reason", available)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, value in patched:
        setattr(module, name, value)
    block_math.select_backend.cache_clear()
    try:
        call()
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        block_math.select_backend.cache_clear()
    return list(launches.values())


def compile_launch(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Compile one launch for :data:`TARGET` (raises Triton's error on failure); its PTX."""
    signature: dict[str, object] = dict(zip(kernel.arg_names, (signature_type(a) for a in args)))
    constexprs = {name: value for name, value in kwargs.items() if name != "num_warps"}
    signature.update({name: "constexpr" for name in constexprs})
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    ptx: str = triton.compile(source, target=TARGET).asm["ptx"]
    return ptx


def subnormal_exponentials(ptx: str) -> int:
    """How many ``ex2`` of a PTX text keep subnormal results (``tl.exp``'s: three more SASS
    instructions each than ``kernels.elementwise.exp``'s ``ex2.approx.ftz``)."""
    return ptx.count("ex2.approx.f32")


def calls() -> dict[str, Callable[[], object]]:
    """Representative calls: a tied KD with every student term and soft-caps, a separate teacher
    with a co-training variant, a top-k cache, the student's entropy (with a KL term and alone), the
    logits-level KDLoss, a teacher's top-k extraction, a teacher mixture, and backward's in-place
    scaling."""
    generator = torch.Generator().manual_seed(0)
    rows, hidden, vocab = 48, 32, 3000
    student = (torch.randn(rows, hidden, generator=generator) / 2).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).requires_grad_()
    teacher_hidden = torch.randn(rows, hidden, generator=generator)
    teacher_weight = torch.randn(vocab, hidden, generator=generator) / hidden**0.5
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    top = torch.log_softmax(teacher_hidden @ teacher_weight.T, dim=-1).topk(64, dim=-1)
    common: dict[str, Any] = {"backend": "triton", "kl_weight": 1.0}

    def tied_terms() -> object:
        terms = {"label_smoothing": 0.1, "z_loss_weight": 1e-3, "logit_softcap": 20.0, "teacher_logit_softcap": 15.0}
        teacher = orda_tp.TiedTeacher(teacher_hidden)
        return orda_tp.distillation_loss(student, weight, labels, teacher, **common, **terms)

    def separate_mutual() -> object:
        teacher = orda_tp.SeparateTeacher(teacher_hidden.requires_grad_(), teacher_weight.requires_grad_())
        return orda_tp.distillation_loss(student, weight, labels, teacher, kl_divergence="mutual", **common)

    def topk_skew() -> object:
        cache = orda_tp.PrecomputedTeacher(topk_ids=top.indices, topk_logprobs=top.values)
        return orda_tp.distillation_loss(student, weight, labels, cache, kl_divergence="skew_js", **common)

    def student_entropy() -> object:  # its column summed by the gradient pass (forward), and alone (no teacher)
        teacher = orda_tp.TiedTeacher(teacher_hidden)
        orda_tp.distillation_loss(student, weight, labels, teacher, student_entropy=True, **common)
        return orda_tp.distillation_loss(student, weight, labels, teacher, backend="triton", student_entropy=True)

    def kd_loss() -> object:  # 2**15 columns: the wide blocks, whose bf16 tiles are HALF_PRECISION_TILES'
        wide = torch.randn(rows, 1 << 15, generator=generator)
        logits = wide.to(torch.bfloat16).requires_grad_()
        loss = orda_tp.KDLoss(backend="triton")(logits, (wide + 0.5).bfloat16(), labels)
        loss.backward()
        return loss

    def teacher_topk() -> object:  # the outputs are never written: their log-partition may be anything
        try:
            return orda_tp.teacher_topk(teacher_hidden, teacher_weight, 64, temperature=2.0, logit_softcap=30.0,
                                        backend="triton")  # fmt: skip
        except ValueError:
            return None

    def mixture() -> object:  # each teacher's tile partitioned alone; later views' gradients accumulated
        teachers = [orda_tp.TiedTeacher(teacher_hidden), orda_tp.SeparateTeacher(teacher_hidden, teacher_weight)]
        for combine in ("divergences", "probabilities"):
            mixed = orda_tp.TeacherMixture(teachers, [0.25, 0.75], combine)
            orda_tp.distillation_loss(student, weight, labels, mixed, kl_divergence="reverse", **common)
        return None

    def scale() -> object:  # what backward runs on CUDA gradient buffers (torch's foreach on the CPU)
        triton_math.scale_in_place([torch.empty(1000, dtype=torch.bfloat16)], torch.tensor(0.5))
        return None

    return {"tied KD + terms + caps": tied_terms, "separate mutual": separate_mutual, "top-64 skew_js": topk_skew,
            "student entropy": student_entropy, "KDLoss": kd_loss, "teacher top-64": teacher_topk,
            "teacher mixture": mixture, "backward's scale": scale}  # fmt: skip


def main() -> int:
    failures = 0
    for name, call in calls().items():
        for kernel, args, kwargs in captured_launches(call):
            label = f"{name}: {kernel.fn.__name__}"
            try:
                ptx = compile_launch(kernel, args, kwargs)
                print(f"compiled  {label}  [{subnormal_exponentials(ptx)} ex2 without ftz]")
            except Exception as error:  # noqa: BLE001 - every failure is reported, then the next
                failures += 1
                cause, text = error.__cause__, str(error)
                while cause is not None:
                    text, cause = f"{text}\n  caused by: {cause}", cause.__cause__
                print(f"FAILED    {label}: {type(error).__name__}: {text}")
    print(f"{'FAIL' if failures else 'PASS'}: {failures} launch(es) failed to compile for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
