"""Adapters for the training stacks: FSDP2 (:mod:`.fsdp`) and Megatron-core (:mod:`.megatron`).

Each adapter is thin: it finds the tensors a stack holds (the unsharded head, the
tensor-parallel group, the hidden states its output layer receives) and calls
:func:`orda_tp.distillation_loss`. Nothing here is imported by ``import orda_tp``; an adapter
imports its stack only when it is used.
"""
