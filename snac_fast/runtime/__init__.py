"""Running the model fast: ``compiling`` (Triton kernels compiled ahead, concurrently), ``warmup``
(the cold start), ``graphs`` (CUDA graphs of whole decodes)."""
