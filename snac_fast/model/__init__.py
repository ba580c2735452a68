"""The model: ``loading`` (checkpoints from the hub or a folder), ``synthetic`` (seeded checkpoints of
the published shapes), ``layers`` (SNAC's layers by kind, the receptive field), ``modules`` and
``local_attention`` (the fused layers around the kernels of :mod:`snac_fast.ops`), ``noise`` (the
decoder's noise, seeded), ``surgery`` (upstream's modules swapped for the fused ones)."""
