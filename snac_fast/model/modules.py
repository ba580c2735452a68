"""nn.Module wrappers around the ops: drop-in replacements for upstream snac layers.

Each fused module is a subclass of the upstream layer it replaces (or shares its parameters), so
state-dict keys, module names and ``isinstance`` checks keep working. A layer whose computation moved
into a neighbour's kernel stays in the tree as an ``Absorbed*`` module: same parameters, forward
passes its input through, ``absorbed_by`` names the module that computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from snac_fast.ops.device import exact_float32_cudnn
from snac_fast.ops.snake import snake


class FastSnake1d(nn.Module):
    """Drop-in for ``snac.layers.Snake1d``: same ``alpha`` parameter ([1, C, 1]), Triton forward.

    Input and output: [B, C, T] in the module's dtype (float16, bfloat16 or float32).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    @classmethod
    def from_snake(cls, module: nn.Module) -> "FastSnake1d":
        """A FastSnake1d that shares ``module.alpha`` (the same Parameter object, not a copy)."""
        alpha = getattr(module, "alpha", None)
        if not isinstance(alpha, nn.Parameter) or alpha.dim() != 3 or alpha.shape[0] != 1 or alpha.shape[2] != 1:
            raise ValueError(f"expected a Snake1d with alpha shaped [1, C, 1], got {type(module).__name__}")
        fast = cls.__new__(cls)
        nn.Module.__init__(fast)
        fast.alpha = alpha
        return fast

    @property
    def channels(self) -> int:
        return self.alpha.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha)

    def extra_repr(self) -> str:
        return f"channels={self.channels}"


# --- absorbed layers --------------------------------------------------------------------------

class Absorbed:
    """Mixin: the layer's computation runs inside the kernel of ``absorbed_by``; forward is identity."""

    absorbed_by = ""

    def forward(self, x: Tensor) -> Tensor:
        return x

    def extra_repr(self) -> str:
        return f"absorbed by {self.absorbed_by}"


class AbsorbedSnake1d(Absorbed, FastSnake1d):
    """A decoder Snake1d applied in the epilogue of the fused layer before it (or the prologue of the
    one after it). Keeps ``alpha``."""


class AbsorbedConv1d(Absorbed, nn.Conv1d):
    """The decoder's input 1x1 conv, computed by the DepthwisePointwiseConv1d before it."""


class AbsorbedTanh(Absorbed, nn.Tanh):
    """The decoder's final tanh, computed by OutputConvTanh."""


_ABSORBED = ((FastSnake1d, AbsorbedSnake1d), (nn.Conv1d, AbsorbedConv1d), (nn.Tanh, AbsorbedTanh))


def absorb(module: nn.Module, by: str) -> nn.Module:
    """The same module (same parameters, same attributes) as an Absorbed* whose forward is identity."""
    for base, cls in _ABSORBED:
        if isinstance(module, base) and not isinstance(module, Absorbed):
            absorbed = cls.__new__(cls)
            absorbed.__dict__.update(module.__dict__)
            absorbed.absorbed_by = by
            return absorbed
    raise ValueError(f"cannot absorb a {type(module).__name__}")


class SnakeOut:
    """Mixin for fused layers that can apply the next Snake1d in their epilogue: instead of their
    output (:meth:`absorb_next_snake`, when the next layer needs only the snake), or beside it
    (:meth:`pair_next_snake`, for a residual unit, which needs both: the layer then returns the
    tuple ``(y, snake(y))`` from one kernel). After :meth:`write_channels_last` a plain output is
    laid out [B, T, C] in memory (a transposed view), for a transposed conv after it."""

    _snake_out: nn.Module | None = None
    snake_pair: nn.Module | None = None
    channels_last_out = False

    def write_channels_last(self) -> None:
        self.channels_last_out = True

    def absorb_next_snake(self, snake_module: nn.Module) -> None:
        object.__setattr__(self, "_snake_out", snake_module)  # not a child: it stays where it is

    def pair_next_snake(self, snake_module: nn.Module) -> None:
        object.__setattr__(self, "snake_pair", snake_module)

    @property
    def alpha_out(self) -> Tensor | None:
        return None if self._snake_out is None else self._snake_out.alpha


# --- fused layers -----------------------------------------------------------------------------

def _upstream_layers():
    from snac.layers import NoiseBlock, ResidualUnit

    return NoiseBlock, ResidualUnit


def is_same_padding_depthwise(conv: nn.Module) -> bool:
    if type(conv) is not nn.Conv1d:
        return False
    k, d = conv.kernel_size[0], conv.dilation[0]
    return (conv.groups == conv.in_channels == conv.out_channels and k % 2 == 1
            and conv.padding[0] == (k - 1) * d // 2 and conv.stride[0] == 1)


def is_pointwise(conv: nn.Module) -> bool:
    return type(conv) is nn.Conv1d and conv.kernel_size[0] == 1 and conv.groups == 1 and conv.stride[0] == 1


class FusedResidualUnit(SnakeOut, _upstream_layers()[1]):
    """A residual unit (Snake -> dilated depthwise conv7 -> Snake -> 1x1 conv, plus x) in two
    kernels: depthwise conv + bias + snake; 1x1 conv + bias + residual add, whose epilogue also
    writes the next unit's input snake (or applies the next layer's snake) once surgery set that up.
    On Hopper, fp16 units run as one Gluon kernel instead where it measured faster (ops/residual_unit:
    up to 64 channels, and 128 at dilations 1 and 3).
    The unit's own first snake is then computed by the layer before it; called on a plain tensor,
    the unit runs it itself (a third kernel).

    Keeps upstream's ``block`` (the same four modules, weights folded), so state-dict keys and module
    names are unchanged. Input: [B, C, T], or the pair (x, snake(x)) from the layer before; output:
    [B, C, T], or such a pair for the next unit.
    """

    replaces = ("block.0", "block.1", "block.2", "block.3")

    def __init__(self, block: nn.Sequential) -> None:
        nn.Module.__init__(self)
        self.block = block

    @classmethod
    def fusable(cls, unit: nn.Module) -> bool:
        b = getattr(unit, "block", None)
        return (isinstance(b, nn.Sequential) and len(b) == 4 and type(b[0]) is FastSnake1d
                and type(b[2]) is FastSnake1d and is_same_padding_depthwise(b[1]) and is_pointwise(b[3])
                and b[3].in_channels == b[3].out_channels == b[1].in_channels
                and not any(hasattr(m, "parametrizations") for m in b))

    @classmethod
    def from_unit(cls, unit: nn.Module) -> "FusedResidualUnit":
        if not cls.fusable(unit):
            raise ValueError("residual unit is not fusable: needs FastSnake1d, folded weights, same-padding depthwise conv")
        return cls(unit.block)

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        """A pair input belongs to the unit: the previous layer made it for this call alone, so the
        unit's output overwrites it (no new activation buffers)."""
        from snac_fast.ops.depthwise import depthwise_conv_snake
        from snac_fast.ops.pointwise import pointwise_conv, pointwise_conv_pair
        from snac_fast.ops.residual_unit import KERNEL_SIZE, residual_unit, unit_applies

        snake1, dw, snake2, pw = self.block
        if isinstance(x, tuple):
            x, s = x
            # Inductor's reinplacing can hand an in-place output the memory of h: fresh ones there
            out, snake_out = (None, None) if torch.compiler.is_compiling() else (x, s)
        else:
            s = snake(x, snake1.alpha) if isinstance(snake1, Absorbed) else snake1(x)
            out = snake_out = None
        if (unit_applies(x, dw.in_channels, dw.dilation[0]) and dw.kernel_size[0] == KERNEL_SIZE and not torch.compiler.is_compiling()
                and x.is_contiguous() and s.is_contiguous()):
            # one kernel; its output may go over x but never over s (other tiles read s's halo)
            unit = (x, s, dw.weight, dw.bias, dw.dilation[0], snake2.alpha, pw.weight, pw.bias)
            if self.snake_pair is not None:
                return residual_unit(*unit, pair_alpha=self.snake_pair.alpha, out=out)
            if self.channels_last_out:
                return residual_unit(*unit, alpha_out=self.alpha_out, channels_last=True)
            return residual_unit(*unit, alpha_out=self.alpha_out, out=out)
        h = depthwise_conv_snake(s, dw.weight, dw.bias, dw.dilation[0], snake2.alpha)
        if self.snake_pair is not None:
            return pointwise_conv_pair(h, pw.weight, pw.bias, residual=x, alpha=self.snake_pair.alpha,
                                       out=out, snake_out=snake_out)
        if self.channels_last_out:  # into the spent snake's memory (not over x: the layouts differ)
            into = None
            if snake_out is not None and snake_out.is_contiguous():
                B, C, T = snake_out.shape
                into = snake_out.view(B, T, C).transpose(1, 2)
            return pointwise_conv(h, pw.weight, pw.bias, residual=x, alpha_out=self.alpha_out, out=into,
                                  channels_last=True)
        return pointwise_conv(h, pw.weight, pw.bias, residual=x, alpha_out=self.alpha_out, out=out)


class DepthwisePointwiseConv1d(SnakeOut, nn.Conv1d):
    """The decoder's first two layers, depthwise conv7 then 1x1 conv (+ the first block's snake
    once absorbed), as two Triton kernels under one module. It is the depthwise conv (same
    parameters and name); the 1x1 conv stays in the tree as AbsorbedConv1d."""

    @classmethod
    def from_convs(cls, depthwise: nn.Conv1d, pointwise: nn.Conv1d, name: str) -> tuple["DepthwisePointwiseConv1d", nn.Module]:
        """(the fused layer, the AbsorbedConv1d to put where ``pointwise`` was); ``name``: the fused
        layer's qualified name."""
        if not is_same_padding_depthwise(depthwise) or not is_pointwise(pointwise) \
                or pointwise.in_channels != depthwise.out_channels:
            raise ValueError("needs a same-padding depthwise Conv1d followed by a 1x1 Conv1d, weights folded")
        fused = cls.__new__(cls)
        fused.__dict__.update(depthwise.__dict__)
        absorbed = absorb(pointwise, name)
        object.__setattr__(fused, "_pointwise", absorbed)  # not a child: it stays in the tree where it was
        return fused, absorbed

    def forward(self, x: Tensor) -> Tensor:
        from snac_fast.ops.depthwise import depthwise_conv_snake
        from snac_fast.ops.pointwise import pointwise_conv

        h = depthwise_conv_snake(x, self.weight, self.bias, self.dilation[0])
        return pointwise_conv(h, self._pointwise.weight, self._pointwise.bias, alpha_out=self.alpha_out,
                              channels_last=self.channels_last_out)


class _FromConv:
    """Mixin for a fused conv that is the upstream conv itself under another class: ``from_conv``
    checks ``fusable`` and moves the conv's parameters and attributes over (no copies)."""

    requirement = ""  # what ``fusable`` checks, for from_conv's error

    @classmethod
    def fusable(cls, conv: nn.Module) -> bool:
        raise NotImplementedError

    @classmethod
    def from_conv(cls, conv: nn.Module):
        if not cls.fusable(conv):
            raise ValueError(f"needs {cls.requirement}, weights folded")
        fused = cls.__new__(cls)
        fused.__dict__.update(conv.__dict__)
        return fused


class DepthwiseConv1d(_FromConv, nn.Conv1d):
    """A same-padded depthwise conv (the encoder's output conv7) on the Triton depthwise kernel.
    Same parameters and name as the conv. Input and output: [B, C, T]."""

    requirement = "a same-padding depthwise Conv1d"

    @classmethod
    def fusable(cls, conv: nn.Module) -> bool:
        return is_same_padding_depthwise(conv)

    def forward(self, x: Tensor) -> Tensor:
        from snac_fast.ops.depthwise import depthwise_conv_snake

        return depthwise_conv_snake(x, self.weight, self.bias, self.dilation[0])


class PackedWeights:
    """Mixin: the weight in the layouts a kernel reads (``_layouts(weight, dtype)``), cached while
    the weight is unchanged.

    Under ``torch.compile`` the cache is read, never keyed or filled: a key on ``data_ptr`` breaks
    the graph, and a tensor made inside a compiled graph lives in its memory (with CUDA graphs, the
    next replay overwrites it). Surgery fills the cache eagerly (:meth:`pack`); for another dtype the
    compiled graph makes its own copies per call."""

    _packed: tuple = (None, None)

    def _layouts(self, weight: Tensor, dtype: torch.dtype):
        raise NotImplementedError

    def kernel_weights(self, dtype: torch.dtype):
        w = self.weight
        if torch.compiler.is_compiling():
            cached = self._packed[1]
            first = cached[0] if isinstance(cached, tuple) else cached
            if cached is not None and first.dtype == dtype and first.device == w.device:
                return cached
            return self._layouts(w, dtype)
        key = (w.data_ptr(), w._version, w.device, dtype)
        if self._packed[0] != key:
            with torch.no_grad():
                object.__setattr__(self, "_packed", (key, self._layouts(w, dtype)))
        return self._packed[1]

    def pack(self) -> None:
        """Fill the weight cache for the module's own dtype now, outside any compiled graph."""
        self.kernel_weights(self.weight.dtype)


class FusedDenseConv1d(_FromConv, PackedWeights, SnakeOut, nn.Conv1d):
    """A dense Conv1d (groups 1, dilation 1; any kernel, stride, zero padding) on the Triton implicit
    GEMM (:func:`snac_fast.ops.dense_conv.dense_conv1d`): the encoder's input conv and strided
    downsampling convs. With :meth:`pair_next_snake` it returns (y, snake(y)) for the residual unit
    after it. Reads its input fastest channels-last, which surgery has the layer before write.
    Same parameters and name as the conv."""

    requirement = "a plain Conv1d (groups 1, dilation 1, numeric zero padding)"

    @classmethod
    def fusable(cls, conv: nn.Module) -> bool:
        return (type(conv) is nn.Conv1d and conv.groups == 1 and conv.dilation[0] == 1 and conv.kernel_size[0] > 1
                and conv.padding_mode == "zeros" and isinstance(conv.padding, tuple)
                and not hasattr(conv, "parametrizations"))

    def _layouts(self, weight: Tensor, dtype: torch.dtype) -> Tensor:
        from snac_fast.ops.dense_conv import pack_dense_weight

        return pack_dense_weight(weight.detach().to(dtype))

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        from snac_fast.ops.dense_conv import dense_conv1d

        pair = None if self.snake_pair is None else self.snake_pair.alpha
        return dense_conv1d(x, self.weight, self.bias, self.stride[0], self.padding[0], pair_alpha=pair,
                            packed=self.kernel_weights(x.dtype))


class FusedConvTranspose1d(_FromConv, PackedWeights, nn.ConvTranspose1d):
    """The decoder block's upsampling ConvTranspose1d (and the block's input Snake1d, when no layer
    before could absorb it, as after attention: one snake kernel before either path).

    Reads its input fastest laid out [B, T, C] in memory (:func:`~snac_fast.ops.common.is_channels_last`,
    which surgery has the layer before write), and takes one of two paths:

    - outputs up to ``kernel_max_elements``: the Triton phase GEMM with the bias inside, output
      contiguous [B, C, T] (streaming chunks at small batch sizes);
    - larger ones: cuDNN's tensor-core kernel in channels-last layout (no layout transforms), output
      a [B, C, T] view of [B, T, C] memory without the bias: the FusedNoiseBlock after it adds the
      bias as it loads its input (:meth:`defers_bias`).

    Why the split at ``kernel_max_elements`` (each path's timings): docs/kernels.md, "Transposed conv".
    Same parameters and name; the kernels' weight layouts are rebuilt whenever the weight changes.
    """

    kernel_max_elements = 1 << 19
    requirement = "a plain ConvTranspose1d with kernel 2 * stride and SNAC's padding"
    snake_in: nn.Module | None = None
    bias_taken = False  # set when a FusedNoiseBlock after it adds the bias for the cuDNN path

    @classmethod
    def fusable(cls, conv: nn.Module) -> bool:
        from snac_fast.ops.conv_transpose import upsampling_padding

        if type(conv) is not nn.ConvTranspose1d or hasattr(conv, "parametrizations"):
            return False
        s = conv.stride[0]
        return (conv.kernel_size[0] == 2 * s and (conv.padding[0], conv.output_padding[0]) == upsampling_padding(s)
                and conv.groups == 1 and conv.dilation[0] == 1)

    def absorb_previous_snake(self, snake_module: nn.Module) -> None:
        object.__setattr__(self, "snake_in", snake_module)

    def runs_cudnn(self, output_elements: int) -> bool:
        return output_elements > self.kernel_max_elements

    def defers_bias(self, output_elements: int) -> bool:
        """True when an output of this many elements comes from cuDNN without the bias."""
        return self.runs_cudnn(output_elements) and self.bias is not None and self.bias_taken

    def _layouts(self, weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        from snac_fast.ops.conv_transpose import pack_phase_weight

        w = weight.detach().to(dtype)
        return pack_phase_weight(w, self.stride[0]), w.unsqueeze(2).contiguous(memory_format=torch.channels_last)

    def forward(self, x: Tensor) -> Tensor:
        from snac_fast.ops.conv_transpose import conv_transpose

        packed, cudnn_weight = self.kernel_weights(x.dtype)
        if self.snake_in is not None:
            # its own kernel before either path (cuDNN takes no snake; conv_transpose would run it so too)
            x = snake(x, self.snake_in.alpha)
        out_elements = x.shape[0] * self.out_channels * x.shape[2] * self.stride[0]
        if not self.runs_cudnn(out_elements):
            return conv_transpose(x, self.weight, self.bias, self.stride[0], packed=packed)
        bias = None if self.defers_bias(out_elements) else self.bias
        with exact_float32_cudnn(x):
            y = F.conv_transpose2d(x.unsqueeze(2), cudnn_weight, bias, (1, self.stride[0]), (0, self.padding[0]),
                                   (0, self.output_padding[0]))
        return y.squeeze(2)


class OutputConvTanh(_FromConv, nn.Conv1d):
    """The decoder's output conv7 (to one channel) and tanh in one kernel; the Tanh module stays in
    the tree as AbsorbedTanh. Same parameters and name as the conv."""

    requirement = "a plain same-padded Conv1d"

    @classmethod
    def fusable(cls, conv: nn.Module) -> bool:
        if type(conv) is not nn.Conv1d:
            return False
        k = conv.kernel_size[0]
        return (k % 2 == 1 and conv.padding[0] == (k - 1) // 2 and conv.stride[0] == 1
                and conv.dilation[0] == 1 and conv.groups == 1)

    def forward(self, x: Tensor) -> Tensor:
        from snac_fast.ops.conv_tanh import conv_tanh

        return conv_tanh(x, self.weight, self.bias)


class FusedNoiseBlock(SnakeOut, _upstream_layers()[0]):
    """NoiseBlock ``x + noise * conv1x1(x)`` in one kernel (GEMM with noise-scale and residual
    epilogue; with :meth:`pair_next_snake` it returns (y, snake(y)) for the residual unit after it).

    ``draw_noise(x) -> [B, 1, T]`` supplies the noise: fresh ``torch.randn`` like upstream by default;
    seeded decodes, fidelity checks and CUDA graphs replace it per instance. After
    :meth:`follow` it adds the preceding FusedConvTranspose1d's bias whenever that layer deferred it.
    Its input may be laid out [B, T, C] (the cuDNN path's output); its outputs are contiguous.
    """

    replaces = ("linear",)

    def __init__(self, linear: nn.Conv1d) -> None:
        nn.Module.__init__(self)
        self.linear = linear
        object.__setattr__(self, "upsampler", None)  # not a child: the conv stays where it is

    def follow(self, conv: "FusedConvTranspose1d") -> None:
        """Add ``conv``'s bias whenever it runs on cuDNN without it (it runs right before this block)."""
        object.__setattr__(self, "upsampler", conv)
        object.__setattr__(conv, "bias_taken", True)

    def input_bias(self, x: Tensor) -> Tensor | None:
        conv = self.upsampler
        return conv.bias if conv is not None and conv.defers_bias(x.numel()) else None

    def folded_bias(self, input_bias: Tensor) -> Tensor:
        """The GEMM bias that adds ``input_bias`` to the input (``bias + W @ input_bias``, float32
        [C]), cached while the weight and the bias are unchanged; under ``torch.compile`` read, or
        made per call (the rules of :class:`PackedWeights`)."""
        from snac_fast.ops.pointwise import fold_input_bias

        w, b = self.linear.weight, self.linear.bias
        cached = self.__dict__.get("_folded")
        if torch.compiler.is_compiling():
            return cached[1] if cached is not None and cached[1].device == w.device else fold_input_bias(w, b, input_bias)
        key = tuple((p.data_ptr(), p._version, p.device, p.dtype) for p in (w, b, input_bias) if p is not None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                self.__dict__["_folded"] = cached = (key, fold_input_bias(w, b, input_bias))
        return cached[1]

    def pack(self) -> None:
        """Fill the folded-bias cache now (surgery, on the final device and dtype), outside any
        compiled graph or capture."""
        conv = self.upsampler
        if conv is not None and conv.bias is not None:
            self.folded_bias(conv.bias)

    @classmethod
    def from_block(cls, block: nn.Module) -> "FusedNoiseBlock":
        lin = block.linear
        if not isinstance(lin, nn.Conv1d) or lin.kernel_size[0] != 1 or hasattr(lin, "parametrizations"):
            raise ValueError("NoiseBlock is not fusable: needs a folded 1x1 conv")
        return cls(lin)

    @staticmethod
    def draw_noise(x: Tensor) -> Tensor:
        return torch.randn((x.shape[0], 1, x.shape[2]), device=x.device, dtype=x.dtype)

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        from snac_fast.ops.pointwise import pointwise_conv, pointwise_conv_pair

        input_bias = self.input_bias(x)
        bias = self.linear.bias if input_bias is None else self.folded_bias(input_bias)
        args = (x, self.linear.weight, bias, x, self.draw_noise(x))
        if self.snake_pair is not None:
            return pointwise_conv_pair(*args, alpha=self.snake_pair.alpha, residual_bias=input_bias)
        return pointwise_conv(*args, residual_bias=input_bias)


def _upstream_quantizer():
    from snac.vq import ResidualVectorQuantize

    return ResidualVectorQuantize


class FusedResidualVectorQuantize(_upstream_quantizer()):
    """Upstream's residual quantizer whose ``from_codes`` (codes -> latent, about five launches per
    level) is one kernel (:func:`snac_fast.ops.codebook.codes_to_latent`), and whose encoding
    (``forward``), once :func:`snac_fast.model.surgery.fuse_encoder` set ``fused_encode``, runs in float32
    whatever the model's dtype (:func:`snac_fast.ops.codebook.quantize`). Same submodules and parameters."""

    replaces = ("from_codes", "forward")
    bad_ids: Tensor | None = None  # int32 [1] flag set when an id is out of range (CUDA graphs set it)
    fused_encode = False

    def forward(self, z: Tensor) -> tuple[Tensor, list[Tensor]]:
        """z: latent [B, latent_dim, T] -> (quantized latent like z, codes: int64 [B, T // stride] per level)."""
        if not self.fused_encode:
            return super().forward(z)
        from snac_fast.ops.codebook import quantize

        return quantize(z, *self.float32_weights(), [q.stride for q in self.quantizers])

    def float32_weights(self) -> tuple[list[Tensor], ...]:
        """(in-projection weights, biases, codebooks, out-projection weights, biases, L2-normalised
        codebooks, their squared row norms) per level in float32, cached while the parameters are
        unchanged: the encoding runs in float32, and a cast per level and call would be 24 more
        kernels per encode."""
        qs = self.quantizers
        params = [(q.in_proj.weight, q.in_proj.bias, q.codebook.weight, q.out_proj.weight, q.out_proj.bias) for q in qs]
        key = tuple((p.data_ptr(), p._version, p.device) for level in params for p in level)
        cached = self.__dict__.get("_float32")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                lists = [[p.detach().float() for p in column] for column in zip(*params)]
                lists.append([F.normalize(table) for table in lists[2]])
                lists.append([table.pow(2).sum(1) for table in lists[-1]])
            self.__dict__["_float32"] = cached = (key, tuple(lists))
        return cached[1]

    @classmethod
    def from_quantizer(cls, quantizer: nn.Module) -> "FusedResidualVectorQuantize":
        if type(quantizer) is not _upstream_quantizer() or any(
                hasattr(q.out_proj, "parametrizations") or q.out_proj.bias is None for q in quantizer.quantizers):
            raise ValueError("needs an upstream ResidualVectorQuantize with folded weights")
        fused = cls.__new__(cls)
        fused.__dict__.update(quantizer.__dict__)
        return fused

    def from_codes(self, codes: list[Tensor]) -> Tensor:
        """codes: integer [B, L_i] per level, validated -> latent [B, latent_dim, L_0 * stride_0]."""
        from snac_fast.ops.codebook import codes_to_latent

        qs = self.quantizers
        return codes_to_latent(codes, [q.codebook.weight for q in qs], [q.out_proj.weight for q in qs],
                               [q.out_proj.bias for q in qs], [q.stride for q in qs], qs[0].out_proj.weight.dtype,
                               bad_ids=self.bad_ids)
