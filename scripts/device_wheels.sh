#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (Python 3.12, x86-64) into .whl/ (git-ignored);
# carry .whl to each call and `source scripts/device_setup.sh` there. The GPU image has torch,
# triton, torchaudio, huggingface_hub, pyarrow, numpy, aiohttp, httpx, anyio, click, h11,
# prometheus-client, nvidia-ml-py, hypothesis, pytest-xdist; what it lacks is listed here, with the
# dependencies each one adds (openai 3.x: httpx2, httpcore2, truststore, jiter, pydantic), and uvloop, which
# uvicorn[standard] installs for users (uvicorn, the fake LM and the load clients run on it where present).
# `bash scripts/device_wheels.sh corpora` fills .whl-corpora instead, for the corpora benchmark
# (WHEELS=.whl-corpora): datasets 3 (4 and later decode audio through torchcodec and a system FFmpeg)
# with the pins it needs (dill < 0.3.9, multiprocess < 0.70.17, pandas 2), snac, soundfile, av;
# `... cpu` fills .whl-cpu, for bench_cpu.py's peers (snac, ONNX Runtime and the ONNX exporter's packages).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(snac==1.2.1 soundfile cffi pycparser starlette uvicorn httptools uvloop websockets av
        openai jiter distro pydantic pydantic-core annotated-types typing-inspection typing-extensions
        sniffio httpx2 httpcore2 truststore idna anyio h11 swagger-ui-py)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
OUT=.whl
if [ "${1:-}" = corpora ]; then
  OUT=.whl-corpora
  WHEELS=(snac==1.2.1 soundfile cffi pycparser av datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16 xxhash
          pandas==2.3.3 python-dateutil==2.9.0.post0 pytz tzdata six fsspec==2025.3.0 pyyaml)
elif [ "${1:-}" = cpu ]; then
  OUT=.whl-cpu
  WHEELS=(snac==1.2.1 onnxruntime onnx onnxscript onnx_ir ml_dtypes protobuf coloredlogs humanfriendly flatbuffers)
fi
mkdir -p "$OUT"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$OUT" "${WHEELS[@]}"
du -sh "$OUT"  # a call carries at most 64 MiB
