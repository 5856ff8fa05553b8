"""The engine: the backends that compute a loss, and the row walk they share.

Backends: ``reference`` (full logits, the oracle: :mod:`.reference`), ``torch`` and ``triton``
(chunked: rows in chunks, columns in blocks, never a (BT, V) tensor), which differ only in their
per-block math (:mod:`.block_math`: :mod:`.torch_math`, or :mod:`.triton_math`, which launches
the kernels of ``orda_tp.kernels``); ``select_backend`` picks one for a call.

- :mod:`.row_walk`: the one row walker of the fused path and the logits-level losses; it reads
  logits blocks from :mod:`.logits` and runs a chunk's statistics rounds, whose row steps are the
  programs of :mod:`.row_formulas`, unpacked into :mod:`.stats`.
- :mod:`.fused`: the fused loss's autograd Function (logits from hidden states and head weights),
  with its row groups' gradient GEMMs (:mod:`.gradient_gemms`; the rows per chunk and group: :mod:`.workspace`).
"""
