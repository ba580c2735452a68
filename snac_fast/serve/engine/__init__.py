"""Where streams decode: ``backend`` (the protocol the routes call: an engine in this process, or
the engine process), ``process`` + ``batcher`` (one engine process per GPU and its batcher),
``client`` (a front-end's connection to it), ``wire`` (their messages on its Unix socket),
``gpu_memory`` (what a serving process holds on its GPU; step graphs sized to a budget)."""
