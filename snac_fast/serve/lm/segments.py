"""Long text for an LM that speaks a sentence or two at a time.

Orpheus-family LMs stop after about 1,200 audio tokens (~14 s of speech, ~200 characters) and drift
on long prompts, so a long ``input`` is cut into segments at sentence ends, each at most
``max_chars``, and each is one LM request. The speech route pushes every segment's ids into the
request's one stream (:func:`snac_fast.serve.services.speech.speech_chunks`), so the audio across a join is
the decode of the joined codes: no crossfade, no seam.
"""

from __future__ import annotations

import re

# a sentence ends at . ! ? … with any closing quotes or brackets, then space or the end; or at the CJK 。！？
_SENTENCE_END = re.compile(r"(?<=[.!?…])[\"'”’)\]]*(?:\s+|$)|(?<=[。！？])[\"'”’」』)\]]*\s*")
_CLAUSE_END = re.compile(r"(?<=[,;:，；：])\s+")
# in text still arriving, a sentence has ended only once a space follows its mark (or a CJK mark ends it)
_ENDED = re.compile(r"(?<=[.!?…])[\"'”’)\]]*\s+|(?<=[。！？])[\"'”’」』)\]]*")


def ended_sentences(text: str) -> tuple[str, str]:
    """Text arriving piece by piece, split into (its whole sentences, the rest still open)."""
    end = 0
    for match in _ENDED.finditer(text):
        end = match.end()
    return text[:end], text[end:]


def split_text(text: str, max_chars: int) -> list[str]:
    """``text`` as segments of at most ``max_chars`` characters, cut where sentences end, each
    sentence whole where it fits; sentences packed together up to ``max_chars``. A sentence longer
    than that is cut at clause marks (, ; :), then at spaces, then anywhere. Pieces packed into one
    segment are joined by one space; no other character is lost or changed."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    pieces: list[str] = []
    for sentence in _pieces(text.strip(), _SENTENCE_END):
        pieces += _fitted(sentence, max_chars)
    return _packed(pieces, max_chars)


def _packed(pieces: list[str], max_chars: int) -> list[str]:
    """Pieces joined by one space, in order, as many to a segment as fit in ``max_chars``."""
    segments: list[str] = []
    for piece in pieces:
        if segments and len(segments[-1]) + 1 + len(piece) <= max_chars:
            segments[-1] += " " + piece
        else:
            segments.append(piece)
    return segments


def _pieces(text: str, boundary: re.Pattern) -> list[str]:
    out, start = [], 0
    for match in boundary.finditer(text):
        if match.end() > start:
            out.append(text[start:match.end()].strip())
            start = match.end()
    out.append(text[start:].strip())
    return [piece for piece in out if piece]


def _fitted(sentence: str, max_chars: int) -> list[str]:
    """A sentence as pieces of at most ``max_chars``: clause marks first, then spaces, then hard cuts."""
    if len(sentence) <= max_chars:
        return [sentence]
    out: list[str] = []
    for clause in _pieces(sentence, _CLAUSE_END):
        if len(clause) <= max_chars:
            out.append(clause)
            continue
        line = ""
        for word in clause.split():
            while len(word) > max_chars:  # no space to cut at
                if line:
                    out.append(line)
                    line = ""
                out.append(word[:max_chars])
                word = word[max_chars:]
            if line and len(line) + 1 + len(word) > max_chars:
                out.append(line)
                line = ""
            line = f"{line} {word}" if line else word
        if line:
            out.append(line)
    return _packed(out, max_chars)  # clauses packed back together where they fit
