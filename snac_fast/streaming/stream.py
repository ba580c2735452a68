"""One stream on a :class:`~snac_fast.streaming.engine.StreamEngine`: the public DecoderStream."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from snac_fast.streaming.engine import StreamEngine


class DecoderStream:
    """One stream on a :class:`StreamEngine`: ``push(codes)`` returns the audio that became final,
    ``flush()`` the rest; their concatenation equals ``codec.decode(all_codes, seed=seed)``.
    With a token ``layout`` (:mod:`snac_fast.orpheus`), :meth:`push_ids` takes raw LM token ids."""

    def __init__(self, engine: StreamEngine, seed: int | None = None, layout=None) -> None:
        if layout is not None:
            layout.check_model(engine.config)  # where the stream is made, not at its first push
        self.engine = engine
        self.slot = engine.open(seed)
        self.layout = layout
        self._framer = layout.framer() if layout is not None else None

    @property
    def seed(self) -> int:
        return self.slot.seed

    @property
    def lookahead_samples(self) -> int:
        return self.engine.lookahead_samples

    @property
    def lookahead_ms(self) -> float:
        return self.engine.lookahead_ms

    @property
    def lookahead_frames(self) -> float:
        return self.engine.lookahead_frames

    @property
    def first_audio_frames(self) -> int:
        """Frames to push before the first audio comes out (:attr:`StreamEngine.first_audio_frames`)."""
        return self.engine.first_audio_frames

    @property
    def first_audio_ms(self) -> float:
        return self.engine.first_audio_ms

    def push(self, codes: Sequence[Tensor]) -> Tensor:
        """codes of k >= 1 new frames (per level [L_i] or [1, L_i]) -> new final audio, 1-D."""
        return self.engine.advance({self.slot: codes})[self.slot]

    def push_ids(self, ids) -> Tensor:
        """Raw LM token ids (any count; an incomplete frame waits for the next push) -> new audio."""
        if self._framer is None:
            raise ValueError("this stream has no token layout: open it with layout=... (snac_fast.orpheus)")
        codes = self._framer.push(ids)
        if codes is None:
            return self.engine.empty_audio()
        return self.push(codes)

    def flush(self) -> Tensor:
        """End the stream: the rest of its audio (1-D). The stream is closed afterwards."""
        if self._framer is not None:
            self._framer.finish()
        return self.engine.advance(finish=[self.slot])[self.slot]

    def close(self) -> None:
        self.engine.close(self.slot)

    def __enter__(self) -> "DecoderStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

