"""Host time of the Ray engine's actor per 256-file shard (10 s clips, float16 batches), before its
encode: the pickled float32 clips it used to get against the flat float16 array it gets now
(``snac_fast.datasets.ray_engine``), through a real local Ray Data pipeline. No GPU needed.

    python scripts/experiments/ray_actor_host_time.py
"""
import time, pickle, dataclasses, numpy as np, torch, ray
from types import SimpleNamespace
from snac_fast.configs import published_config
from snac_fast.datasets.inputs import Clip, AudioInput
from snac_fast.datasets.batching import batch_audio
from snac_fast.datasets.ray_engine import _clips_of

def clips_for(n):
    rng = np.random.default_rng(n)
    return [Clip(AudioInput(f"s{n}/f{i}.wav", f"/x/f{i}.wav"), rng.random(240000, dtype=np.float32), 10.0, 24000, None) for i in range(256)]

def read_old(row):
    return {"shard": row["shard"], "clips": pickle.dumps(clips_for(row["shard"]))}

def read_new(row):
    clips = clips_for(row["shard"])
    audio = np.concatenate([c.audio.astype("float16") for c in clips])
    return {"shard": row["shard"], "audio": audio, "clips": pickle.dumps(([dataclasses.replace(c, audio=None) for c in clips], [c.audio.size for c in clips]))}

class Actor:
    def __init__(self, new):
        self.new = new
        self.codec = SimpleNamespace(config=published_config("snac_24khz"), dtype=torch.float16, device=torch.device("cpu"))
    def __call__(self, row):
        t = time.perf_counter()
        clips = _clips_of(row) if self.new else pickle.loads(row["clips"])
        t1 = time.perf_counter()
        batch_audio(self.codec, clips, 1.0, 300.0)
        t2 = time.perf_counter()
        return {"shard": row["shard"], "unpack_s": t1 - t, "batch_s": t2 - t1}

ray.init(num_cpus=2, log_to_driver=False)
for new in (False, True, False, True):
    data = ray.data.from_items([{"shard": n} for n in range(4)], override_num_blocks=4)
    data = data.map(read_new if new else read_old, num_cpus=1)
    out = data.map(Actor, fn_constructor_kwargs={"new": new}, concurrency=1, num_cpus=1).take_all()
    u = np.median([o["unpack_s"] for o in out]); b = np.median([o["batch_s"] for o in out])
    print("flat array" if new else "pickled clips", f"unpack {u*1000:.0f} ms, batch {b*1000:.0f} ms, actor host {1000*(u+b):.0f} ms per shard", flush=True)
ray.shutdown()
