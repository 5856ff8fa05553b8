"""Tensor parallelism over vocabulary shards: the layout handshake (who owns which columns),
DTensor and FSDP2 inputs, the record exchange across ranks (one packed collective per statistics
round), sequence-parallel row gathers and gradient reduce-scatters, and the ``VocabParallel``
style."""
