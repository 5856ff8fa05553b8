"""A call's arguments, checked once: the checks (:mod:`.validation`), the execution settings
(:mod:`.config`) and orda-kernel's spellings of them (:mod:`.orda_kernel`), the keywords of a loss
(:mod:`.options`) and what a call computes (:mod:`.plan`)."""
