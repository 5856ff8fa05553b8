"""Tensor-parallel layer (vocabulary-sharded heads): group and vocab-range resolution, record
exchange across ranks, sequence-parallel gather/reduce-scatter. Reserved for the next release;
the single-device code already routes every statistics merge through
:class:`orda_tp.exchange.RecordExchange`, the seam this layer plugs into."""
