"""Adapters for training stacks that hold the LM head in their own modules: Megatron-core
(:mod:`.megatron`) and TRL's ``DistillationTrainer`` (:mod:`.trl`, with :mod:`.fsdp_rows` for heads
FSDP2 shards). Nothing here is imported by ``import orda_tp``; an adapter imports its stack only when
used (docs/integrations.md; FSDP2 and ``parallelize_module`` need none)."""
