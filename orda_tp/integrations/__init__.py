"""Adapters for training stacks that hold the LM head in their own modules: Megatron-core
(:mod:`.megatron`). (FSDP2 and ``parallelize_module`` need no adapter: ``orda_tp.DistillationHead``,
``orda_tp.VocabParallel`` and ``orda_tp.parallel.fsdp``.)

An adapter is thin: it finds the tensors a stack holds (the tensor-parallel group, the hidden
states its output layer receives, the weight it passes) and calls :func:`orda_tp.distillation_loss`.
Nothing here is imported by ``import orda_tp``; an adapter imports its stack only when it is used.
"""
