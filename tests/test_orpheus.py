"""snac_fast.orpheus: LM token ids to codes and back (the 7-slot Orpheus layout), and its errors."""

import pytest
import torch
from helpers import engine64, random_codes

from snac_fast.configs import published_config
from snac_fast.orpheus import ORPHEUS, TokenLayout
from snac_fast.streaming import DecoderStream


def test_orpheus_layout_round_trip_and_errors():
    config = published_config("snac_24khz")
    ORPHEUS.check_model(config)
    with pytest.raises(ValueError, match="does not fit"):
        ORPHEUS.check_model(published_config("snac_32khz"))
    codes = random_codes(config, 5, seed=0)
    ids = ORPHEUS.codes_to_ids(codes)
    assert ids.shape == (35,) and int(ids[0]) == 128266 + int(codes[0][0, 0])
    assert int(ids[4]) == 128266 + 4 * 4096 + int(codes[1][0, 1]) and int(ids[6]) == 128266 + 6 * 4096 + int(codes[2][0, 3])
    back = ORPHEUS.ids_to_codes(ids)
    assert all(torch.equal(a, b) for a, b in zip(back, codes))
    wrong = ids.clone()
    wrong[9] = 128266 + 5 * 4096  # position 9 is slot 2; this id belongs to slot 5
    with pytest.raises(ValueError, match=r"token 9 \(id 148746\) is not a code of frame slot 2"):
        ORPHEUS.ids_to_codes(wrong)
    framer = ORPHEUS.framer()
    assert framer.push(ids[:3]) is None
    with pytest.raises(ValueError, match="token 10 "):
        framer.push(torch.cat([ids[3:10], torch.tensor([5])]))  # caught as it arrives, mid-frame
    got = framer.push(ids[3:17])
    assert [c.shape[1] for c in got] == [2, 4, 8] and all(torch.equal(a, b[:, :a.shape[1]]) for a, b in zip(got, codes))
    with pytest.raises(ValueError, match="ends inside a frame"):
        framer.finish()
    for bad in ([1.5] * 7, torch.ones(7), [True] * 7, [[1, 2], [3]]):
        with pytest.raises(ValueError, match="token ids must be integers"):
            ORPHEUS.framer().push(bad)
    assert ORPHEUS.framer().push_row(ids[:7].tolist())[0] == 1  # a plain list of ints, as servers have them
    with pytest.raises(ValueError, match="does not fit"):  # where the stream is made, not at its first push
        DecoderStream(engine64("snac_32khz", narrow=True), 0, ORPHEUS)
    custom = TokenLayout(offset=10, levels=(0, 1, 1, 2, 2, 2, 2))
    assert all(torch.equal(a, b) for a, b in zip(custom.ids_to_codes(custom.codes_to_ids(codes)), codes))
