"""ops/warm_start: CUDA and Triton's cache key started on background threads while a model builds."""

import pytest

from snac_fast import FastSNAC


@pytest.mark.gpu
def test_runtime_warms_up_while_the_model_builds(cuda):
    """from_pretrained starts CUDA and Triton's cache key on background threads and joins them
    before it returns: the first launch finds the key ready (read back from the cache directory, or
    computed once into Triton's lru_cache), never hashed a second time."""
    from triton.runtime import cache

    from snac_fast.ops import warm_start

    FastSNAC.from_pretrained("synthetic:snac_24khz", device=cuda)
    assert len(warm_start.warmup_threads) == 2 and not any(t.is_alive() for t in warm_start.warmup_threads)
    key = cache.triton_key
    assert not hasattr(key, "cache_info") or key.cache_info().currsize == 1


def test_triton_key_is_kept_beside_the_kernels(tmp_path, monkeypatch):
    """Triton's cache key (a 0.4-1.4 s hash of its compiler at a process's first launch) is stored in
    the Triton cache directory and reused while Triton's files are unchanged; a stale entry is not."""
    import json

    from triton.runtime import cache

    from snac_fast.ops import warm_start

    original = cache.triton_key
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    stored = tmp_path / warm_start.TRITON_KEY_FILE
    try:
        warm_start.cache_triton_key()  # computed as Triton does, and stored
        assert cache.triton_key is original and json.loads(stored.read_text())["key"] == original()
        warm_start.cache_triton_key()  # read back
        assert cache.triton_key is not original and cache.triton_key() == original()
        cache.triton_key = original
        stored.write_text(json.dumps({"stamp": "files since changed", "key": "stale"}))
        warm_start.cache_triton_key()
        assert cache.triton_key() == original() and json.loads(stored.read_text())["key"] == original()
    finally:
        cache.triton_key = original
