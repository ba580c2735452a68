# Source on the GPU machine (see README, "Running the GPU checks"): installs the carried wheels
# (.whl/, filled by scripts/device_wheels.sh) into /tmp/site and puts the project on the path.
# soundfile: carry its manylinux wheel, which bundles libsndfile (the H200 image of 2026-11-28 has no
# libsndfile.so: with the py3-none-any wheel, test_cli/test_datasets/test_reference fail to import).
# WHEELS=.whl-cpu: the CPU benchmark's set instead (snac, onnxruntime, onnx, onnxscript and their deps:
# with .whl they pass the 64 MiB a call may carry)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS:-.whl}"/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH  # bin: py-spy
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
