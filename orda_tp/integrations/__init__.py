"""Adapters for training stacks that hold the LM head in their own modules: Megatron-core
(:mod:`.megatron`). Nothing here is imported by ``import orda_tp``; an adapter imports its stack only
when used (docs/integrations.md; FSDP2 and ``parallelize_module`` need none)."""
