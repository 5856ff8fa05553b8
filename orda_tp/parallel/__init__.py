"""Tensor parallelism over vocabulary shards: a rank's inputs, the layout handshake and the record
exchange across ranks; it knows neither the variants nor the engine (docs/architecture.md, "A
tensor-parallel call")."""
