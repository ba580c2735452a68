"""FastSNAC in the contexts servers use: building and decoding under inference_mode / no_grad, threads sharing one codec,
the caller's CUDA stream, GPU out-of-memory during graph capture."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from helpers import NARROW, assert_matches_upstream_fp32, random_codes

from snac_fast import FastSNAC
from snac_fast.configs import published_config
from snac_fast.metrics import snr_db
from snac_fast.model.noise import decode_with_keyed_noise
from snac_fast.model.synthetic import make_checkpoint, synthetic_model


def test_build_and_decode_inside_inference_mode_and_no_grad(tmp_path):
    folder = make_checkpoint(tmp_path, "snac_24khz", **NARROW)  # loading, surgery and decode; widths do not matter
    codes = random_codes(published_config("snac_24khz"), 1, seed=3)
    plain = FastSNAC.from_pretrained(str(folder), device="cpu")
    expected = plain.decode(codes, seed=5)
    assert_matches_upstream_fp32(decode_with_keyed_noise(plain.reference_model(), codes, 5), expected)
    with torch.inference_mode():
        built = FastSNAC.from_pretrained(str(folder), device="cpu")
        wrapped = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")  # an upstream model made in inference mode
        inside = built.decode(codes, seed=5)
    assert not any(p.is_inference() for p in built.model.parameters())
    assert torch.equal(inside, expected)
    with torch.no_grad():
        assert torch.equal(wrapped.decode(codes, seed=5), expected)
    assert torch.equal(built.decode(codes, seed=5), expected)  # and afterwards, outside inference mode


def _decode_in_threads(codec, jobs, threads=4):
    results, errors = {}, []

    def work(i):
        try:
            for j, (codes, seed) in enumerate(jobs):
                if j % threads == i:
                    results[j] = codec.decode(codes, seed=seed)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    return [results[j] for j in range(len(jobs))]


def test_threads_share_one_codec():
    """Decodes from several threads at once patch the same NoiseBlocks: each must get its own seed's audio."""
    codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu", fuse=False)
    jobs = [(random_codes(codec.config, 1 + j % 3, seed=j), 100 + j) for j in range(8)]
    expected = [codec.decode(codes, seed=seed) for codes, seed in jobs]
    reference = codec.reference_model()
    for (codes, seed), want in zip(jobs[:2], expected):  # the single-thread decodes are upstream's
        assert_matches_upstream_fp32(decode_with_keyed_noise(reference, codes, seed), want)
    for got, want in zip(_decode_in_threads(codec, jobs), expected):
        assert torch.equal(got, want)


def test_inference_keeps_torch_compiler_stack_unloaded():
    """A fresh process's decode calls the kernels directly, not through their torch.library ops: a
    registered op's first call imports torch._dynamo (850 modules, seconds of a cold start)."""
    script = textwrap.dedent("""
        import sys, torch
        from helpers import NARROW, random_codes
        from snac_fast import FastSNAC
        from snac_fast.model.synthetic import synthetic_model
        codec = FastSNAC(synthetic_model("snac_24khz", **NARROW), device="cpu")
        codec.decode(random_codes(codec.config, 1), seed=0)
        print("dynamo" if "torch._dynamo" in sys.modules else "clean")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "clean"


@pytest.mark.gpu
def test_gpu_server_contexts(cuda):
    """Graphs under inference_mode, threads sharing graph buffers, a caller's side stream."""
    with torch.inference_mode():
        codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda)
    jobs = [(random_codes(codec.config, 4 if j % 2 else 16, batch=1 + j % 3, seed=j), 50 + j) for j in range(12)]
    expected = [codec.decode(codes, seed=seed).clone() for codes, seed in jobs]
    for got, want in zip(_decode_in_threads(codec, jobs), expected):
        assert torch.equal(got, want)
    side = torch.cuda.Stream(cuda)
    with torch.cuda.stream(side):
        codes, seed = jobs[0]
        got = codec.decode(codes, seed=seed)
        side.synchronize()
    assert torch.equal(got, expected[0])


@pytest.mark.gpu
def test_gpu_out_of_memory_during_capture_is_clear_and_recoverable(cuda, monkeypatch):
    codec = FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda)
    codes = random_codes(codec.config, 4, seed=1)
    expected = codec.decode(codes, seed=2).clone()
    codec.graphs.clear()

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.cuda, "graph", no_memory)
    with pytest.raises(RuntimeError, match="out of memory.*CUDA graph"):
        codec.decode(codes, seed=2)
    monkeypatch.undo()
    assert torch.equal(codec.decode(codes, seed=2), expected)


@pytest.mark.gpu
def test_gpu_models_on_two_devices():
    """A model on cuda:1 while cuda:0 is current, next to one on cuda:0, in one process."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the nvidia-h200-x2 device kind)")
    torch.cuda.set_device(0)
    first = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda:0")
    second = FastSNAC.from_pretrained("synthetic:snac_24khz", device="cuda:1")
    codes = random_codes(first.config, 6, batch=2, seed=8)
    on_first, on_second = first.decode(codes, seed=4), second.decode(codes, seed=4)
    assert torch.cuda.current_device() == 0 and on_second.device == torch.device("cuda:1")
    assert torch.equal(on_first.cpu(), on_second.cpu())  # same GPUs, same kernels, same noise
    stream = second.stream(seed=4)
    strides = second.config["vq_strides"]
    pieces = [stream.push([c[:1, f * strides[0] // s:(f + 1) * strides[0] // s] for c, s in zip(codes, strides)])
              for f in range(6)] + [stream.flush()]
    assert torch.cat(pieces).device == torch.device("cuda:1")
    assert snr_db(on_second[0, 0].float(), torch.cat(pieces).float()) >= 50  # fp16 rounding apart
    with torch.cuda.device(1):
        assert torch.equal(first.decode(codes, seed=4).cpu(), on_first.cpu())
