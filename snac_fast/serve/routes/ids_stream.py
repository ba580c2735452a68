"""``WS /v1/audio/stream``: LM token ids in, PCM out, one stream per connection.

Messages in: JSON ``{"ids": [...]}`` or binary int32 little-endian ids; ``{"end": true}`` (or
closing) ends the stream. Out: binary PCM (``?sample_format=s16|f32``), ``{"type": "error",
"message"}`` for a push that failed, ``{"type": "done"}`` after the last audio. ``?seed=N`` seeds
the decoder's noise.
"""

from __future__ import annotations

import asyncio

import numpy as np

from snac_fast.model.noise import check_seed
from snac_fast.serve.access.limits import MessageRate, TooManyStreams, client_of
from snac_fast.serve.engine.client import EngineLostError
from snac_fast.serve.routes.protocol import json_or_none
from snac_fast.serve.routes.schema import SAMPLE_FORMATS
from snac_fast.serve.services.formats import pcm_bytes

CLOSE_REASON_BYTES = 120  # a close frame's reason holds 123 bytes
# a message's ids go to the engine this many frames at a time, each piece a round of its own: one
# message of 2,000 frames (112 KB, inside the size limit) was one engine call that held the event
# loop, every other stream and /health for 22.7 s on a CPU
MESSAGE_PIECE_FRAMES = 16


async def stream_ids(websocket) -> None:
    """The route."""
    from starlette.websockets import WebSocketDisconnect

    server = websocket.app.state.server
    await websocket.accept()
    seed = websocket.query_params.get("seed")
    try:
        seed = check_seed(int(seed)) if seed and seed.lstrip("-").isdigit() else None
    except ValueError as e:
        await websocket.close(code=1008, reason=str(e)[:CLOSE_REASON_BYTES])
        return
    try:
        sid = await server.open_stream(seed, client_of(websocket.scope))
    except EngineLostError as e:
        await websocket.close(code=1011, reason=str(e)[:CLOSE_REASON_BYTES])
        return
    except TooManyStreams as e:
        await websocket.close(code=1008, reason=str(e)[:CLOSE_REASON_BYTES])
        return
    if sid is None:
        await websocket.close(code=1013, reason="all stream slots are in use; retry shortly")
        return
    sample_format = websocket.query_params.get("sample_format", "s16")
    backend = server.backend
    if sample_format not in SAMPLE_FORMATS:
        server.stream_ended(sid, release=True)
        await websocket.close(code=1003, reason=f"sample_format must be one of {list(SAMPLE_FORMATS)}")
        return
    ended = False
    rate = MessageRate(server.settings.http.max_ws_messages_per_s)
    try:
        while True:
            try:
                message = await asyncio.wait_for(websocket.receive(), server.settings.http.ws_idle_timeout_s)
            except asyncio.TimeoutError:
                await websocket.close(code=1008, reason=f"nothing sent for {server.settings.http.ws_idle_timeout_s:g} s")
                break
            if message["type"] == "websocket.disconnect":
                break
            if not rate.allow():
                await websocket.close(code=1008, reason="more messages than --max-ws-messages-per-s")
                break
            parsed = _parse(message)
            if isinstance(parsed, str):
                await websocket.send_json({"type": "error", "message": parsed})
                continue
            ids, end = parsed
            try:
                if len(ids):
                    audio = await _pushed_in_pieces(server, sid, ids, websocket, sample_format)
                    if audio.size:
                        await websocket.send_bytes(pcm_bytes(audio, sample_format))
                if end:
                    ended = True
                    audio = await backend.flush(sid, drop_incomplete_frame=True)
                    if audio.size:
                        await websocket.send_bytes(pcm_bytes(audio, sample_format))
                    await websocket.send_json({"type": "done"})
                    await websocket.close()
                    break
            except ValueError as e:  # a bad id: this push fails, the stream goes on (if still open)
                await websocket.send_json({"type": "error", "message": str(e)})
                if not backend.is_open(sid):
                    await websocket.close(code=1011, reason="the stream has ended")
                    break
            except RuntimeError as e:  # the engine process went away, or an engine call failed
                await websocket.send_json({"type": "error", "message": str(e)})
                await websocket.close(code=1011, reason="the engine process went away" if isinstance(e, EngineLostError)
                                      else "the engine call failed")
                break
    except (WebSocketDisconnect, OSError):
        pass
    finally:
        server.stream_ended(sid, release=not ended)
        server.metrics.outcome("stream", "done" if ended else "closed")


async def _pushed_in_pieces(server, sid: int, ids, websocket, sample_format: str) -> np.ndarray:
    """The audio of a message's ids, pushed :data:`MESSAGE_PIECE_FRAMES` frames at a time (other
    streams' pushes and requests run between the pieces). A bad id fails its piece: the pieces
    before it were pushed, and their audio goes out before the error."""
    piece = MESSAGE_PIECE_FRAMES * server.settings.layout.frame_size
    if len(ids) <= piece:
        return await server.push(sid, ids)
    pieces = []
    for start in range(0, len(ids), piece):
        try:
            pieces.append(await server.push(sid, ids[start:start + piece]))
        except ValueError:
            pieces = [p for p in pieces if p.size]
            if pieces:
                await websocket.send_bytes(pcm_bytes(np.concatenate(pieces), sample_format))
            raise
    return np.concatenate(pieces)


def _parse(message: dict) -> tuple | str:
    """(ids, end) of one message, or what is wrong with it."""
    if message.get("bytes") is not None:
        data = message["bytes"]
        if len(data) % 4:
            return "binary ids must be int32 little-endian"
        return np.frombuffer(data, "<i4"), False
    request = json_or_none(message.get("text"))
    if not isinstance(request, dict):
        return 'text messages must be JSON: {"ids": [...]} or {"end": true}'
    if "ids" not in request and "end" not in request:
        if "prompt" in request or "text" in request:
            return ("this WebSocket takes LM token ids ({\"ids\": [...]}, then {\"end\": true}); "
                    "send text to POST /v1/audio/speech")
        return f"unknown message with keys {sorted(request)[:8]}: expected {{\"ids\": [...]}} or {{\"end\": true}}"
    ids = request.get("ids", [])
    if not isinstance(ids, list):
        return "'ids' must be a list of token ids"
    return ids, bool(request.get("end", False))
