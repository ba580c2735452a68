"""Serving streams: the batchers (library), the engine process, and ``snac-fast serve``'s app.

Layout: ``settings`` (one :class:`ServeSettings`), ``rounds`` + ``drivers`` -> ``batchers`` (the
batcher's round logic, its thread and event-loop drivers, the public batchers), ``engine_wire`` /
``engine_batcher`` / ``engine_process`` / ``engine_client`` (one engine process fed by front-ends),
``backend`` (in-process or engine process, one protocol), ``app`` + ``speech`` + ``websocket`` +
``metrics`` (the Starlette app and its routes), ``lm_client`` / ``fake_lm`` (the LM's side), ``run``
(uvicorn and its workers). Names are imported on first access: the CLI reads the settings without
importing torch.
"""

_NAMES = {
    "AsyncStreamBatcher": "batchers", "StreamBatcher": "batchers", "freeze_startup_objects": "batchers",
    "EngineClient": "engine_client", "EngineLostError": "engine_client", "EngineProcess": "engine_process",
    "PCMBlock": "pcm", "int16_pcm": "pcm", "ServeSettings": "settings", "SpeechServer": "app",
    "create_app": "app", "serve": "run",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(f"snac_fast.serve.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'snac_fast.serve' has no attribute {name!r}")
