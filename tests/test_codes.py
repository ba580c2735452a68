"""Token files: upstream's torch.save(codes) list and our {"codes", "model"} dict."""

import pytest
import torch
from helpers import random_codes

from snac_fast import load_tokens, save_tokens
from snac_fast.configs import published_config


def test_round_trip_dict(tmp_path):
    codes = random_codes(published_config("snac_32khz"), 4, batch=2)
    save_tokens(tmp_path / "t.pt", codes, model="synthetic:snac_32khz")
    loaded, model = load_tokens(tmp_path / "t.pt")
    assert model == "synthetic:snac_32khz"
    assert all(torch.equal(a, b) for a, b in zip(codes, loaded)) and len(loaded) == 4


def test_plain_list_as_upstream_writes_it(tmp_path):
    codes = random_codes(published_config("snac_24khz"), 3)
    torch.save(codes, tmp_path / "t.pt")
    loaded, model = load_tokens(tmp_path / "t.pt")
    assert model is None and all(torch.equal(a, b) for a, b in zip(codes, loaded))


@pytest.mark.parametrize("payload, message", [
    ({"codes": [torch.zeros(1, 2, dtype=torch.long)], "extra": 1}, "found keys"),
    ({"model": "x"}, "found keys"),
    ({"codes": [torch.zeros(1, 2, dtype=torch.long)], "model": 3}, "'model' must be a string"),
    ([1, 2, 3], "list of code tensors"),
    ([], "list of code tensors"),
    (torch.zeros(3), "list of code tensors"),
])
def test_rejects_other_contents(tmp_path, payload, message):
    torch.save(payload, tmp_path / "t.pt")
    with pytest.raises(ValueError, match=message):
        load_tokens(tmp_path / "t.pt")


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"\x00junk")
    with pytest.raises(ValueError, match="cannot read token file"):
        load_tokens(tmp_path / "junk.pt")

    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    torch.save([Evil()], tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="cannot read token file"):
        load_tokens(tmp_path / "evil.pt")
