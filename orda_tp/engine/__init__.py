"""The engine: every door's prepared call (:mod:`.call`), the row walk of the chunked backends
(:mod:`.row_walk`), the fused loss (:mod:`.fused`), the losses on given logits (:mod:`.given_logits`)
and the full-logits oracle (:mod:`.reference`). The ``torch`` and ``triton`` backends differ only in
their block math (:mod:`.block_math`); docs/architecture.md, "The parts".
"""
