"""Helpers of the tests (tests/test_*.py): shared problems, oracles and the workers of multi-process tests
(tests/README.md: which test file checks what).

- cases: the shared problems (random heads, teachers of every mode), the variants' keywords
  (``VARIANT_KWARGS``, ``call_kwargs``), ``loss_and_grads`` and the error measures; benchmarks/ and
  checks/ use it too.
- collective_workers: gloo workers of test_collectives.py (tensors lent to collectives, deprecated
  collectives).
- distributed: ``run_distributed``, which runs a worker on N gloo processes (forkserver, a FileStore
  in a temporary directory, timeouts, each rank's traceback), and ``note``.
- doc_snippets: reads the ```python snippets of README.md and docs/*.md and their markers, for
  test_doc_snippets.py.
- error_cases: the small problem, the ``no_compute`` fixture and the shared checks of the error
  tests (test_errors_*.py).
- exit_job: a 2-rank job run by test_clean_exit.py under torchrun as a script (by its path).
- extreme_logit_workers: logits near ±1000 with their maximum in one block or shard, and their gloo
  worker (test_extreme_logits.py).
- fault_cases: the faults injected into the checks of a tensor-parallel call, and their gloo worker
  (test_fault_injection.py).
- logits_workers: the gloo worker of KDLoss / flash_ce_kd_loss on vocabulary-sharded logits
  (test_logits_losses.py).
- megatron_workers: real megatron-core GPTModels with orda_tp's head on 2 gloo ranks
  (test_megatron.py).
- scale_bias: biased heads, the teacher of every kind, and the fp64 oracle of logit scales and
  biases written from the definitions (test_scale_bias.py).
- scale_bias_workers: scales and biases on vocabulary shards and a biased TeacherHead under FSDP2,
  their gloo workers (test_scale_bias.py).
- stack_workers: the loss inside FSDP2 and DTensor tensor-parallel models (test_training_stacks.py).
- term_workers: the loss terms (label smoothing, z-loss, token weights, softcaps) on vocabulary shards
  (test_loss_terms.py).
- topk_cases: top-k caches and the dense teachers they stand for, written from the definitions.
- topk_extraction_cases: the fp64 oracle of top-k extraction (test_topk_extraction.py).
- topk_extraction_workers: the gloo worker of top-k extraction on shards (test_topk_extraction.py).
- topk_workers: the gloo worker of top-k teacher caches on shards (test_topk_teacher.py).
- tp_workers: the gloo workers of the tensor-parallel contract (test_tensor_parallel.py) and the
  shard helpers other workers share (``chunk_ranges``, ``plain_case``, ...).
- triton_workers: the gloo worker of ``backend="triton"`` on shards (test_triton_kernels.py).
- upstream_workers: non-unit upstream gradients through "mean"/"sum", checks and gloo worker
  (test_upstream_scale.py).

Workers run in processes that ``distributed.run_distributed`` starts (forkserver or spawn): they
must stay module-level functions of an importable module (``tests.support.NAME``), which the
children import by name. Nothing here imports its siblings at package import.
"""
