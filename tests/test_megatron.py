"""orda_tp.integrations.megatron on real megatron-core 0.16.1 GPTModels: tensor parallel over 2
gloo ranks on the CPU (workers in tests/support/megatron_workers.py, one spawn per test), and the example
script under torchrun.

- CE only: the installed model's ``[b, s]`` losses and every gradient equal Megatron's own
  ``vocab_parallel_cross_entropy`` path (fp32, 1e-5), tied and untied, with and without sequence
  parallelism; parameters, state dicts, hooks and logits unchanged.
- KD with a frozen teacher GPTModel and with cached teacher logits, padded vocabulary: losses,
  components and the output layer's gradients against textbook fp64 formulas (1e-12).
- Every error the adapter raises, on every rank (and none left waiting in a collective).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from .support import megatron_workers  # noqa: E402
from .support.distributed import run_distributed  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO_ROOT / "examples" / "megatron_distill.py")
TIMEOUT_S = 180.0


def run_and_check(worker: Callable[[int, int], list[str]]) -> None:
    """Run ``worker`` on 2 ranks and fail with every rank's mismatches."""
    results = run_distributed(2, worker, timeout=TIMEOUT_S)
    problems = [f"rank {rank}: {problem}" for rank, found in enumerate(results) for problem in found]
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems)


def test_cross_entropy_equals_megatron() -> None:
    run_and_check(megatron_workers.cross_entropy_worker)


def test_distillation_against_fp64_reference() -> None:
    run_and_check(megatron_workers.distillation_worker)


# scenario → (exception type, a fragment of its message)
EXPECTED_ERRORS = {
    "not a GPTModel": ("TypeError", "must be a megatron.core GPTModel"),
    "no output layer": ("ValueError", "post_process=False"),
    "multi-token prediction": ("ValueError", "multi-token prediction (mtp_num_layers=1)"),
    "deferred embedding wgrad": ("ValueError", "defer_embedding_wgrad_compute=True"),
    "vocab_size above the padded vocabulary": ("ValueError", "vocab_size must be the real vocabulary size"),
    "reserved keyword": ("ValueError", "install_distillation_head sets ['reduction'] itself"),
    "unknown keyword": (
        "TypeError",
        "install_distillation_head() got an unexpected keyword argument 'kl_wieght'; did you mean 'kl_weight'?",
    ),
    "teacher with another padded vocabulary": ("ValueError", "with 32 vocabulary rows each, teacher tp ranks"),
    "teacher with sequence parallelism": ("ValueError", "the teacher must use the student's sequence parallelism"),
    "teacher without embeddings": ("ValueError", "without pipeline parallelism"),
    "teacher co-trained": ("ValueError", "kl_divergence='mutual' trains the teacher"),
    "KL without a teacher": ("ValueError", "need a teacher"),
    "two teachers": ("ValueError", "teacher_logits= would be a second teacher"),
    "teacher_logits not a tensor": ("TypeError", "teacher_logits must be a tensor [b, s, V_padded/tp], got list"),
    "teacher_logits without labels": ("ValueError", "need labels="),
    "teacher_logits [s, b, V/tp]": ("ValueError", "teacher_logits must be [b, s, V_padded/tp] = [3, 8]"),
    "teacher_logits of the full vocabulary": ("ValueError", "vocabulary shard on rank 0 has 64 columns but"),
    "two teachers on rank 1 only": ("ValueError", "invalid inputs on tp_group rank(s) [1]: rank 1: ValueError: "),
    "labels [s, b] on rank 1 only": ("ValueError", "invalid inputs on tp_group rank(s) [1]: rank 1: ValueError: "),
    "labels [s, b]": ("ValueError", "they must be [s, b, h] = [3, 8] + [h]"),
    "loss_mask of another shape": ("ValueError", "loss_mask must have labels' shape"),
    "megatron-core changed _postprocess": ("RuntimeError", "does not support this megatron-core version"),
}


def test_errors_on_every_rank() -> None:
    ranks = run_distributed(2, megatron_workers.error_worker, timeout=TIMEOUT_S)
    assert sorted(ranks[0]) == sorted(EXPECTED_ERRORS), sorted(ranks[0])
    for scenario, (kind, fragment) in EXPECTED_ERRORS.items():
        outcomes = [rank[scenario] for rank in ranks]
        assert outcomes[0] == outcomes[1], f"{scenario}: the ranks raised differently: {outcomes}"
        assert outcomes[0].startswith(f"{kind}: ") and fragment in outcomes[0], f"{scenario}: {outcomes[0]}"


def test_import_orda_tp_does_not_import_megatron() -> None:
    code = "import sys, orda_tp; sys.exit(any(name.startswith('megatron') for name in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=120).returncode == 0


FLOAT = r"([0-9.eE+-]+)"


def test_example_script_under_torchrun() -> None:
    """examples/megatron_distill.py: a teacher trained with Megatron's own loss, a student
    distilled from it through the installed head: the kl_weight=0 check passes, the losses fall."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    completed = subprocess.run([*torchrun, EXAMPLE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, f"{completed.stdout}\n{completed.stderr}"
    stdout = completed.stdout
    check = re.search(rf"^check (PASS|FAIL): kl_weight=0 .* \(max relative difference {FLOAT}\)$", stdout, re.M)
    assert check is not None and check.group(1) == "PASS" and float(check.group(2)) <= 1e-5, stdout
    teacher = [float(v) for v in re.findall(rf"^teacher step \d+ \| lm loss {FLOAT}$", stdout, re.M)]
    student = re.findall(rf"^student step \d+ \| loss {FLOAT} \| kl {FLOAT} \| student ce {FLOAT}$", stdout, re.M)
    loss, kl, student_ce = ([float(values[i]) for values in student] for i in range(3))
    assert len(teacher) >= 3 and teacher[-1] < 0.8 * teacher[0], f"teacher loss did not fall: {teacher}"
    assert len(loss) >= 3 and loss[-1] < 0.8 * loss[0], f"student loss did not fall: {loss}"
    assert kl[-1] < 0.5 * kl[0] and student_ce[-1] < 0.8 * student_ce[0], f"KL {kl}, student CE {student_ce}"
