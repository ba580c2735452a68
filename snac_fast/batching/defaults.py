"""How full and how often a batcher's engine calls are, by default. A library batcher and a server
differ on purpose: a Python caller alone on its GPU gets each push's audio from the smallest calls
at once (64 streams, no wait); ``snac-fast serve``, whose LM usually shares the GPU, makes fuller,
fewer calls (256 streams, at most one per 60 ms while pushes keep coming) so the LM loses few steps
(docs/http_server.md, "GPU memory and an LM beside it"). Both run a stream engine's steps of more
than ``ROWS_PER_PASS`` streams in slices of that many rows (:class:`~snac_fast.streaming.StreamEngine`'s
``rows_per_pass``): on an H100 a 256-stream step in two slices took +6% GPU time (2.34 -> 2.49 ms)
and the process 0.63 GB less (2.36 -> 1.73 GB); steps of up to 128 streams are unchanged.
Importing this module imports no torch."""

LIBRARY_MAX_BATCH, LIBRARY_MAX_WAIT_MS = 64, 0.0
SERVER_MAX_BATCH, SERVER_MAX_WAIT_MS = 256, 60.0
ROWS_PER_PASS = 128
