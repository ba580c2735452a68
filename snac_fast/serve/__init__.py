"""``snac-fast serve``: OpenAI's and ElevenLabs' speech APIs over an LM and a stream engine.

Where a change goes:
``settings`` (:class:`ServeSettings`: a settings type per layer, the CLI's flags made from them), ``app`` (the server's state
and the map of its routes), ``run`` + ``workers`` (uvicorn, one process or several), ``metrics``;
``routes/`` (each API's routes, its request shapes and ``/openapi.json``'s schema; a route only
reads the request and calls a service), ``services/`` (speaking text into a stream, audio formats),
``lm/`` (the LM's completions client, long text's segments, the fake LM of the tests),
``engine/`` (where streams decode: in process or one engine process fed by front-ends),
``access/`` (keys, origins, limits). The batchers that Python servers of their own use are
:mod:`snac_fast.batching`, re-exported here. Names are imported on first access: the CLI reads the
settings without importing torch.
"""

_NAMES = {
    "AsyncStreamBatcher": "snac_fast.batching", "StreamBatcher": "snac_fast.batching",
    "freeze_startup_objects": "snac_fast.batching", "PCMBlock": "snac_fast.batching",
    "int16_pcm": "snac_fast.batching", "EngineClient": "snac_fast.serve.engine.client",
    "EngineLostError": "snac_fast.serve.engine.client", "EngineProcess": "snac_fast.serve.engine.process",
    "ServeSettings": "snac_fast.serve.settings", "EngineSettings": "snac_fast.serve.settings",
    "LMSettings": "snac_fast.serve.settings", "HTTPSettings": "snac_fast.serve.settings", "SpeechServer": "snac_fast.serve.app",
    "create_app": "snac_fast.serve.app", "serve": "snac_fast.serve.run",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'snac_fast.serve' has no attribute {name!r}")
