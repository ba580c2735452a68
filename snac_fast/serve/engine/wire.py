"""The engine process's messages on its Unix socket (:mod:`snac_fast.serve.engine.process`).

Front-end -> engine process: pushes (:func:`push_message`: raw int64 arrays, no pickle to take
apart), or a pickled list of ops: ``("open", req, seed)``, ``("flush", req, sid)``,
``("release", sid)``, ``("stats", req)``. Back: an engine call's audio (:func:`audio_message`, read
as the item ``("audio", reqs, offsets, pcm)``), or a pickled list of items: ``("opened", req, sid)``,
``("audio", reqs, offsets, pcm)``, ``("error", req, kind, message)``, ``("stats", req, dict)``.
Every message starts with an 8-byte tag; on the wire each has its length before it, as
``multiprocessing.connection`` writes and reads it.
"""

from __future__ import annotations

import struct

import numpy as np

ERRORS = {"ValueError": ValueError, "RuntimeError": RuntimeError}  # what a front-end raises again
TAG = 8
PUSH, OPS, AUDIO = b"push\0\0\0\0", b"ops\0\0\0\0\0", b"audio\0\0\0"
_AUDIO_HEAD = struct.Struct("<qqq")  # n, samples, 0 for int16 or 1 for float32
_PCM_TYPES = (np.dtype(np.int16), np.dtype(np.float32))
# a message's length: a big-endian int32, or -1 and a uint64 for 2 GiB and more
SIZE, LONG_SIZE = struct.Struct("!i"), struct.Struct("!Q")


def audio_message(reqs: np.ndarray, offsets: np.ndarray, pcm: np.ndarray) -> np.ndarray:
    """Requests ``reqs``' audio, ``pcm[offsets[j]:offsets[j + 1]]``, as one message (uint8): the tag,
    n, the samples, the PCM type, then reqs (int64 [n]), offsets (int64 [n + 1]) and the PCM, written
    once (a pickle copied the PCM twice, with the sender thread holding the interpreter)."""
    at = TAG + _AUDIO_HEAD.size
    out = np.empty(at + 8 * (2 * len(reqs) + 1) + pcm.nbytes, np.uint8)
    out[:TAG] = np.frombuffer(AUDIO, np.uint8)
    _AUDIO_HEAD.pack_into(out, TAG, len(reqs), pcm.size, _PCM_TYPES.index(pcm.dtype))
    for part in (reqs, offsets, pcm):
        out[at:at + part.nbytes].view(part.dtype)[:] = part
        at += part.nbytes
    return out


def read_audio(data: bytes) -> tuple:
    """:func:`audio_message`'s message as an item ("audio", reqs, offsets, pcm); the PCM copied out
    (writable, as a pickle's would be)."""
    n, samples, kind = _AUDIO_HEAD.unpack_from(data, TAG)
    at = TAG + _AUDIO_HEAD.size
    reqs = np.frombuffer(data, np.int64, n, at)
    offsets = np.frombuffer(data, np.int64, n + 1, at + 8 * n)
    pcm = np.frombuffer(data, _PCM_TYPES[kind], samples, at + 8 * (2 * n + 1)).copy()
    return ("audio", reqs, offsets, pcm)


def error_item(req: int, error: BaseException) -> tuple:
    """An error as a message item: the front-end raises the same type (ValueError, RuntimeError)."""
    return ("error", req, type(error).__name__, str(error))


def push_message(reqs: list[int], sids: list[int], frames: int, rows: list[np.ndarray]) -> bytes:
    """Pushes of ``frames`` frames each as one message: int64 n, frames, the request numbers, the
    stream ids, the level-major rows."""
    return PUSH + np.concatenate([np.array([len(reqs), frames], np.int64), np.asarray(reqs, np.int64),
                                  np.asarray(sids, np.int64), np.concatenate(rows).astype(np.int64, copy=False)]).tobytes()


def read_pushes(message: bytes) -> tuple[np.ndarray, list[int], int, np.ndarray]:
    """:func:`push_message`'s message as (request numbers, stream ids, frames, rows [n, row])."""
    n, frames = np.frombuffer(message, np.int64, 2, TAG).tolist()
    body = np.frombuffer(message, np.int64, offset=TAG + 16)
    return body[:n], body[n:2 * n].tolist(), frames, body[2 * n:].reshape(n, -1)
