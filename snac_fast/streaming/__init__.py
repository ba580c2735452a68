"""Exact, stateful, batched streaming decode.

The decoder is cut into stages: the layers before the first DecoderBlock (with the 32/44 kHz local
attention), each DecoderBlock, and the output layers joined to the last block. A stage keeps, per
stream, the last ``left + right`` samples of its input (its context: the receptive field of its
layers, from their kernel sizes, dilations and strides) and, given n new input samples, runs its
layers on ``[context | new]`` and keeps the ``n * upsample`` outputs whose whole receptive field lay
inside that buffer. Each stage so lags its input by ``right`` samples, and the audio that comes out
is exactly what a whole decode gives there: the same layers, the same weights, and NoiseBlock noise
keyed by absolute position (:mod:`snac_fast.model.noise`), so ``stream(seed=s)`` equals
``decode(all_codes, seed=s)``.

Three kinds of step keep every layer's zero padding where upstream has it:

- prefill: a stream's first ``prefill_frames`` frames, each stage's buffer starting at sample 0 (the
  layers pad the left edge themselves) and long enough to fill the stage's context;
- step: ``k`` more frames for every stream in the batch (rows = streams at their own positions);
- flush: the end, each buffer ending at the stream's last sample (the layers pad the right edge).

A stream that ends before its prefill is decoded whole. The local attention of the 32/44 kHz models
sees whole windows of ``attn_window_size`` latent steps, aligned as in a whole decode: those models
step in groups of ``window / vq_strides[0]`` frames. Design notes: docs/streaming.md.

On a CPU, exact float32 streams step with state per layer instead (:mod:`.layer_state`: no
context recomputed), with the same audio at the same pushes.

Modules: :mod:`.geometry` (stages, contexts, where every sample sits), :mod:`.shapes` (step kinds, batch
buckets), :mod:`.pending` (codes pushed but
not decoded yet), :mod:`.engine` (the batched engine), :mod:`.step_graph` (a step captured as a CUDA
graph), :mod:`.layer_state` (the CPU's step), :mod:`.stream` (one stream, the public :class:`DecoderStream`).
"""

from snac_fast.streaming.engine import StreamEngine, StreamSlot
from snac_fast.streaming.geometry import Geometry, Stage, build_stages
from snac_fast.streaming.pending import CheckedCodes
from snac_fast.streaming.shapes import FLUSH, PREFILL, STEP
from snac_fast.streaming.stream import DecoderStream

__all__ = ["FLUSH", "PREFILL", "STEP", "CheckedCodes", "DecoderStream", "Geometry", "Stage", "StreamEngine",
           "StreamSlot", "build_stages"]
