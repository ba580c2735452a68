"""Where streams decode: ``backend`` (the protocol the routes call: an engine in this process, or
the engine process), ``process`` + ``batcher`` (one engine process per GPU and its batcher),
``client`` (a front-end's connection to it), ``wire`` (their messages on its Unix socket)."""
