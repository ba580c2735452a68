"""Per-layer profiling: every layer once, sane times, report formats."""

import json

import pytest
from helpers import NARROW, random_codes

from snac_fast import FastSNAC
from snac_fast.model.synthetic import synthetic_model
from snac_fast.profiling import _timed_modules


@pytest.fixture(scope="module")
def fast_and_report():
    fast = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")  # the layers, not their widths, matter here
    return fast, fast.profile(random_codes(fast.config, 1), runs=1, warmup=1)


def test_every_layer_once(fast_and_report):
    fast, report = fast_and_report
    names = [r.name for r in report.layers]
    assert len(names) == len(set(names))
    expected = {"quantizer.from_codes"} | {n for n, _, _ in _timed_modules(fast.model)}
    assert set(names) == expected
    kinds = {r.kind for r in report.layers}
    assert {"AbsorbedSnake1d", "DepthwisePointwiseConv1d", "AbsorbedConv1d", "FusedConvTranspose1d",
            "FusedNoiseBlock", "FusedResidualUnit", "DecoderBlock", "OutputConvTanh", "AbsorbedTanh"} <= kinds
    assert sum(r.kind in ("FastSnake1d", "AbsorbedSnake1d") for r in report.layers) == 29
    assert sum(r.depth == 0 for r in report.layers) == 1 + len(fast.model.decoder.model)
    # inside a fused unit nothing runs as its own module: the first snake is written by the layer
    # before (absorbed), the fused kernels replace the rest; all four are timed for the original only
    inner = [r for r in report.layers if ".block.3.block." in r.name]
    assert all(r.fast_ms is None for r in inner)
    assert [r.kind for r in inner if r.name.endswith(".block.0")] == ["AbsorbedSnake1d"] * 4
    assert all(r.original_ms is not None for r in inner) and len(inner) == 16
    assert all(r.fast_ms is not None for r in report.layers if r.kind == "FusedResidualUnit")


def test_times_are_sane(fast_and_report):
    _, report = fast_and_report
    assert all(r.fast_ms is None or r.fast_ms >= 0 for r in report.layers)
    assert all(r.original_ms is not None and r.original_ms >= 0 for r in report.layers)
    by_name = {r.name: r for r in report.layers}
    for r in report.layers:  # a container's time covers its children's (nested rows share one pass)
        if r.depth == 0:
            continue
        children = [c for c in report.layers if c.depth == r.depth + 1 and c.name.startswith(r.name + ".")]
        if children and r.fast_ms is not None and all(c.fast_ms is not None for c in children):
            assert sum(c.fast_ms for c in children) <= r.fast_ms * 1.05 + 0.5, r.name
    assert by_name["decoder.model.8"].shape == [1, 1, 2048]  # one frame
    assert 0.3 * report.fast_untimed_ms <= report.fast_timed_total_ms <= 3 * report.fast_untimed_ms


def test_report_formats(fast_and_report, tmp_path):
    _, report = fast_and_report
    text = str(report)
    assert "decoder.model.4.block.3.block.0" in text and "speedup" in text and "untimed decode" in text
    data = json.loads(report.to_json())
    assert len(data["layers"]) == len(report.layers) and "speedup" in data["layers"][0]
    report.plot(str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_profile_without_original():
    fast = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")  # the layers, not their widths, matter here
    report = fast.profile(random_codes(fast.config, 1), runs=1, warmup=0, original=False)
    assert report.original_dtype is None and all(r.original_ms is None for r in report.layers)
    assert all(r.fast_ms is not None for r in report.layers)  # without the original, only what ran


@pytest.mark.gpu
def test_gpu_profile_totals(cuda):
    fast = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda)
    report = fast.profile(random_codes(fast.config, 59), runs=10)
    print(f"\nPROFILE timed rows {report.fast_timed_total_ms:.3f} ms vs untimed {report.fast_untimed_ms:.3f} ms; "
          f"original {report.original_timed_total_ms:.3f} vs {report.original_untimed_ms:.3f} ms")
    assert all(r.fast_ms is None or r.fast_ms > 0 for r in report.layers)
    assert report.fast_timed_total_ms == pytest.approx(report.fast_untimed_ms, rel=0.05)
    assert report.original_timed_total_ms == pytest.approx(report.original_untimed_ms, rel=0.05)
