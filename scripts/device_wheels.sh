#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (Python 3.12, x86-64) into .whl/ (git-ignored);
# carry .whl to each call and `source scripts/device_setup.sh` there. The GPU image has torch,
# triton, torchaudio, huggingface_hub, pyarrow, numpy, aiohttp, httpx, anyio, click, h11,
# prometheus-client, nvidia-ml-py, hypothesis, pytest-xdist; what it lacks is listed here, with the
# dependencies each one adds (openai 3.x: httpx2, httpcore2, truststore, jiter, pydantic).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(snac==1.2.1 soundfile cffi pycparser starlette uvicorn httptools websockets av
        openai jiter distro pydantic pydantic-core annotated-types typing-inspection typing-extensions
        sniffio httpx2 httpcore2 truststore idna anyio h11 swagger-ui-py)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
du -sh .whl  # a call carries at most 64 MiB
