"""The 32/44 kHz local attention: half-precision module and fused kernel against float64."""

import pytest
import torch
from helpers import DTYPES, close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, windows", [(1, 1), (3, 3), (2, 5)])
def test_half_local_mha_matches_float64_upstream(dtype, batch, windows):
    """The 32/44 kHz LocalMHA in the model's dtype against upstream's in float64 (random, non-zero
    norm and weights), odd batch sizes and window counts; the output is poisoned-free (a new tensor)."""
    import copy

    from snac.attention import LocalMHA

    from snac_fast.model.local_attention import HalfLocalMHA

    torch.manual_seed(batch * 10 + windows)
    upstream = LocalMHA(dim=128, window_size=32, dim_head=64)
    with torch.no_grad():
        upstream.norm.weight.uniform_(0.5, 1.5)
        upstream.norm.bias.uniform_(-0.2, 0.2)
    x = torch.randn(batch, 128, 32 * windows)
    expected = copy.deepcopy(upstream).double()(x.double())
    half = HalfLocalMHA.convert(copy.deepcopy(upstream).to(dtype))
    y = half(x.to(dtype))
    assert y.dtype == dtype and torch.isfinite(y).all()
    close(y, expected, dtype)
    with pytest.raises(ValueError, match="divisible by its window 32"):
        half(x.to(dtype)[..., 1:])
    with pytest.raises(ValueError, match="upstream LocalMHA"):
        HalfLocalMHA.convert(half)


def _float64_window_attention(qkv, heads, window, cos, sin):
    """Upstream's LocalMHA core (rotate_half, apply_rotary_pos_emb, SDPA) in float64 from [B, T, 3C]."""
    from einops import rearrange
    from snac.attention import apply_rotary_pos_emb

    q, k, v = qkv.double().chunk(3, dim=-1)
    q, k, v = (rearrange(t, "b (w n) (h d) -> b h w n d", n=window, h=heads) for t in (q, k, v))
    freqs = torch.atan2(sin.double(), cos.double())
    q, k = apply_rotary_pos_emb(q, k, torch.cat((freqs, freqs), -1), torch.ones(1, dtype=torch.float64))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return rearrange(out, "b h w n d -> b (w n) (h d)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, windows, heads", [(1, 1, 2), (3, 3, 1), (2, 5, 3)])
def test_local_attention_kernel_matches_float64(dtype, batch, windows, heads):
    """The fused window-attention kernel against upstream's rotary + SDPA in float64, odd batch
    sizes, window and head counts, a strided qkv (a view into a wider buffer), the output a new
    tensor; and its errors."""
    from snac_fast.ops.attention import local_attention, local_attention_reference

    torch.manual_seed(batch * 100 + windows * 10 + heads)
    d, n = 64, 32
    wide = torch.randn(batch, n * windows, 3 * heads * d + 5, dtype=dtype)
    qkv = wide[:, :, 5:]
    angles = torch.outer(torch.arange(n, dtype=torch.float32), torch.rand(d // 2) * 2)
    cos, sin = angles.cos(), angles.sin()
    expected = _float64_window_attention(qkv, heads, n, cos, sin)
    got = local_attention(qkv, heads, n, cos, sin)
    assert got.dtype == dtype and got.shape == (batch, n * windows, heads * d) and got.is_contiguous()
    close(got, expected, dtype)
    close(local_attention_reference(qkv, heads, n, cos, sin), expected, dtype)
    with pytest.raises(ValueError, match="divisible by its window 32"):
        local_attention(qkv[:, 1:], heads, n, cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must be \[32, 32\]"):
        local_attention(qkv, heads, n, cos[:, :16], sin[:, :16])
    with pytest.raises(ValueError, match="3 \\* heads \\* d"):
        local_attention(qkv[:, :, 1:], heads, n, cos, sin)
