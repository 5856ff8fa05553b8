"""Tensor parallelism over vocabulary shards: the layout handshake (who owns which columns),
DTensor and FSDP2 inputs, the record exchange across ranks (one packed collective per statistics
round), sequence-parallel row gathers and gradient reduce-scatters. It knows neither the variants
nor the engine (``orda_tp.VocabParallel``, the style that shards a head, calls the loss and lives
above it)."""
