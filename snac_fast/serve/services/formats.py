"""Audio formats of the speech API, encoded as the audio is produced, through FFmpeg's encoders and
muxers (PyAV, whose manylinux wheels carry FFmpeg with LAME, Opus and its AAC and FLAC encoders).

Each chunk an encoder returns is a valid continuation of the ones before: MP3 frames, Ogg pages
of Opus (flushed every packet: ``page_duration`` 20 ms), ADTS frames of AAC, FLAC frames, WAV or
raw PCM samples, G.711 bytes. The samples enter as the server's int16 PCM (float audio scaled by
32767 and rounded, as ``pcm`` sends it), so a lossless format decodes back to exactly that PCM;
one resampler per stream keeps its state across chunks, so a rate change has no seams (at the
model's rate none is needed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np


@dataclass(frozen=True)
class AudioFormat:
    """One ``response_format``: FFmpeg's muxer (None: raw codec output), encoder and options, the
    HTTP media type, a fixed output rate (None: the model's, or the request's ``sample_rate``)."""

    name: str
    muxer: str | None
    encoder: str
    media_type: str
    rate: int | None = None
    bit_rate: int | None = None
    lossless: bool = True
    options: tuple[tuple[str, str], ...] = ()


PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
# OpenAI's six, then the rates and G.711 codings that telephony and voice agents ask for by name
FORMATS: dict[str, AudioFormat] = {
    "mp3": AudioFormat("mp3", "mp3", "libmp3lame", "audio/mpeg", bit_rate=64000, lossless=False),
    "opus": AudioFormat("opus", "ogg", "libopus", "audio/ogg", bit_rate=64000, lossless=False,
                        options=(("page_duration", "20000"),)),
    "aac": AudioFormat("aac", "adts", "aac", "audio/aac", bit_rate=64000, lossless=False),
    "flac": AudioFormat("flac", "flac", "flac", "audio/flac"),
    "wav": AudioFormat("wav", "wav", "pcm_s16le", "audio/wav"),
    "pcm": AudioFormat("pcm", None, "pcm_s16le", "audio/pcm"),
    **{f"pcm_{r}": AudioFormat(f"pcm_{r}", None, "pcm_s16le", "audio/pcm", rate=r) for r in PCM_RATES},
    "ulaw_8000": AudioFormat("ulaw_8000", None, "pcm_mulaw", "audio/basic", rate=8000),
    "alaw_8000": AudioFormat("alaw_8000", None, "pcm_alaw", "audio/x-alaw-basic", rate=8000),
}
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# sample_format f32 (an extension): float32 samples, as the engine makes them
FLOAT_FORMATS = {"pcm": AudioFormat("pcm", None, "pcm_f32le", "audio/pcm"),
                 "wav": AudioFormat("wav", "wav", "pcm_f32le", "audio/wav")}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # what libopus takes
MPEG_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # what LAME and FFmpeg's aac take
# the sample rates of 8-48 kHz each encoder opens at, where it does not take any (a rate it refuses
# failed inside the encoder, after the stream was opened: a 500 and a held slot)
ENCODER_RATES = {"mp3": MPEG_RATES, "aac": MPEG_RATES, "opus": OPUS_RATES}


def int16_samples(audio: np.ndarray) -> np.ndarray:
    """float audio in [-1, 1] -> int16 PCM: scaled by 32767, rounded, clipped (the batcher's rule)."""
    return np.clip(np.rint(audio * 32767.0), -32768, 32767).astype(np.int16)


def pcm_bytes(audio: np.ndarray, sample_format: str) -> bytes:
    """float32 audio -> raw little-endian PCM bytes, ``s16`` (:func:`int16_samples`) or ``f32``."""
    if sample_format == "s16":
        return int16_samples(audio).astype("<i2", copy=False).tobytes()
    return audio.astype("<f4", copy=False).tobytes()


class _Chunks:
    """A write-only file for FFmpeg's muxers: what they write is taken out after each chunk."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.written = 0  # bytes so far, taken or not

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        self.written += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class StreamEncoder:
    """One stream's encoder: :meth:`encode` takes float32 audio [n] at ``in_rate`` and returns the
    bytes of ``fmt`` that are ready (possibly none: an encoder holds a frame's worth);
    :meth:`finish` returns the rest. ``rate``: the output rate (None: ``fmt``'s fixed one, else
    ``in_rate``). ``seekable``: write into a seekable buffer, returned whole by :meth:`finish`, so
    that muxers write their true sizes (a WAV header's length) instead of streaming placeholders."""

    def __init__(self, fmt: AudioFormat, in_rate: int, rate: int | None = None, *, seekable: bool = False,
                 speed: float = 1.0) -> None:
        import io

        import av

        self.format, self.in_rate = fmt, in_rate
        self.rate = fmt.rate or rate or in_rate
        self._seekable = seekable
        self._sink = io.BytesIO() if seekable else _Chunks()
        self._container = None
        if fmt.muxer is not None:
            # bitexact: no encoder tags (a WAV header is then its plain 44 bytes)
            self._container = av.open(self._sink, mode="w", format=fmt.muxer,
                                      options={"fflags": "+bitexact", **dict(fmt.options)})
            self._stream = self._container.add_stream(fmt.encoder, rate=self.rate, layout="mono")
            context = self._stream.codec_context
        else:
            context = av.CodecContext.create(fmt.encoder, "w")
            context.sample_rate, context.layout = self.rate, "mono"
        self._float = fmt.encoder == "pcm_f32le"  # float32 in and out, no int16 rounding
        samples = "flt" if self._float else "s16"
        # speed: FFmpeg's atempo before the resampler (time scaled, pitch kept); 1.0 leaves the samples as they are
        self.speed = speed
        self._tempo = None if speed == 1.0 else Tempo(speed, in_rate, samples)
        # At the output rate and unscaled, the samples go into the encoder as they are where it takes
        # them (one channel's planar samples are the same bytes as packed ones; LAME lists s32p first,
        # and its s16p encodes the same frames): the resampler's set-up at the first chunk cost ~0.5 ms
        # of CPU on the way to a stream's first audio. Else a resampler to the encoder's first format
        # (LAME's s32p keeps a rate change's fractions).
        formats = [f.name for f in context.codec.audio_formats]
        same = self._tempo is None and self.rate == in_rate
        self._direct = next((f for f in (samples, samples + "p") if f in formats), None) if same else None
        context.format = self._direct or formats[0]
        if fmt.bit_rate:
            context.bit_rate = fmt.bit_rate
        self._context = context
        self._av = av
        self._frame_format = self._direct or samples
        self._resampler = None if self._direct else av.AudioResampler(format=formats[0], layout="mono", rate=self.rate)
        self._samples_in = 0
        self._header_bytes: int | None = None  # the container's header's length, once it is written
        self._done = False

    def prepare(self) -> None:
        """Open the encoder (and write the container's header) now instead of at the first
        :meth:`encode`: LAME's set-up is ~1.3 ms of CPU, better spent while the LM makes a stream's
        first frames than on the way to its first audio. The header's bytes come with that encode."""
        if self._header_bytes is not None:
            return
        if self._container is not None:
            self._container.start_encoding()
        else:
            self._context.open(strict=False)
        self._header_bytes = 0 if self._seekable else self._sink.written

    def encode(self, audio: np.ndarray) -> bytes:
        """Chunk of float32 audio in -> the format's bytes ready now."""
        if audio.size:
            samples = audio.astype(np.float32, copy=False) if self._float else int16_samples(audio)
            frame = self._av.AudioFrame.from_ndarray(samples[None], format=self._frame_format, layout="mono")
            # timestamps in samples: the muxers need them (unset, FFmpeg makes some up and warns per packet)
            frame.sample_rate, frame.pts, frame.time_base = self.in_rate, self._samples_in, Fraction(1, self.in_rate)
            self._samples_in += len(samples)
            if self._direct:
                self._write(frame)
            else:
                for scaled in [frame] if self._tempo is None else self._tempo.frames(frame):
                    for resampled in self._resampler.resample(scaled):
                        self._write(resampled)
        return b"" if self._seekable else self._sink.take()

    def encode_head(self, audio: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Before the first audio is out: the shortest start of ``audio``, in the encoder's frames,
        that brings out bytes past the container's header, encoded -> (its bytes, the rest of
        ``audio``, not yet encoded). An encoder that holds frames (LAME: 1,728 samples at 24 kHz for
        the first, ~1.7 ms of CPU against ~6.6 for a first chunk of 8,192) sends a stream's first
        audio sooner; the bytes are those of one encode (:meth:`encode` splits nowhere itself). One
        that holds nothing (PCM), one past its first audio, or a seekable one (its bytes come whole at
        the end) encodes nothing here."""
        if self._seekable or self._audio_out():
            return b"", audio
        if self._header_bytes is None:
            self.prepare()  # the header written first, so that what follows it is audio; frame_size set
        step = self._context.frame_size
        if not step:
            return b"", audio
        out, at = [], 0
        while at < audio.size and not self._audio_out():
            out.append(self.encode(audio[at:at + step]))
            at += step
        return b"".join(out), audio[at:]

    def _audio_out(self) -> bool:
        return self._header_bytes is not None and self._sink.written > self._header_bytes

    def finish(self) -> bytes:
        """The rest: the resampler's and encoder's held samples, the muxer's trailer (with
        ``seekable``, the whole file)."""
        if not self._done:
            self._done = True
            if not self._direct:
                for scaled in [] if self._tempo is None else self._tempo.frames(None):
                    for resampled in self._resampler.resample(scaled):
                        self._write(resampled)
                for resampled in self._resampler.resample(None):
                    self._write(resampled)
            self._write(None)
            if self._container is not None:
                self._container.close()
        return self._sink.getvalue() if self._seekable else self._sink.take()

    def _write(self, frame) -> None:
        if self._container is not None:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        else:
            for packet in self._context.encode(frame):
                self._sink.write(bytes(packet))


async def encoded(encoder: StreamEncoder, audio: AsyncIterator[np.ndarray]) -> AsyncIterator[bytes]:
    """A stream's float32 audio pieces in ``encoder``'s format: each piece's bytes as soon as the
    encoder has them, then the encoder's rest (its held frames, the container's trailer). The first
    audio packet goes out alone (:meth:`StreamEncoder.encode_head`), then the event loop's other tasks
    run before the rest of its piece is encoded: in a burst, every stream's first audio comes before
    any stream's rest (mp3: ~1.7 ms of CPU each on the way to it instead of ~6.6). Encoded on the
    event loop: a thread pool (FFmpeg releases the GIL) doubled the server's CPU at 256 mp3 streams
    and did not keep them in pace either (docs/http_server.md, "Formats")."""
    async for piece in audio:
        head, piece = encoder.encode_head(piece)
        if head:
            yield head
            await asyncio.sleep(0)
        data = encoder.encode(piece)
        if data:
            yield data
    rest = encoder.finish()
    if rest:
        yield rest


SPEEDS = (0.25, 4.0)  # OpenAI's range of ``speed``


def checked_speed(value, name: str = "speed") -> float:
    """A request's speed as a float; ValueError naming ``name`` when it is not a number within :data:`SPEEDS`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not SPEEDS[0] <= value <= SPEEDS[1]:
        raise ValueError(f"'{name}' must be a number within {SPEEDS[0]}-{SPEEDS[1]}, got {value!r}")
    return float(value)


def tempo_factors(speed: float) -> list[float]:
    """``speed`` as a chain of atempo factors, each within the filter's range (0.5 and up)."""
    factors = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    return factors + [speed]


class Tempo:
    """One stream's time scale: FFmpeg's ``atempo`` filter (WSOLA: the pitch kept), ``speed`` times
    as fast, on mono frames of ``sample_format`` at ``rate``. :meth:`frames` takes a frame (None:
    the end) and returns the scaled frames ready; the output depends only on the samples, not on how
    they were cut into frames (tested)."""

    def __init__(self, speed: float, rate: int, sample_format: str) -> None:
        import av

        checked_speed(speed)
        self._errors = (av.error.BlockingIOError, av.error.EOFError)
        self.graph = av.filter.Graph()
        node = self.graph.add_abuffer(format=sample_format, sample_rate=rate, layout="mono", time_base=Fraction(1, rate))
        for factor in tempo_factors(speed):
            scaled = self.graph.add("atempo", f"{factor:.9g}")
            node.link_to(scaled)
            node = scaled
        node.link_to(self.graph.add("abuffersink"))
        self.graph.configure()

    def frames(self, frame) -> list:
        self.graph.push(frame)
        out = []
        while True:
            try:
                out.append(self.graph.pull())
            except self._errors:  # nothing more until the next frame, or the end
                return out
