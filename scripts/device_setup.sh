# Source on the GPU machine (see README, "Running the GPU checks"): installs the carried wheels
# (.whl/: snac, soundfile and their missing deps) into /tmp/site and puts the project on the path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH  # bin: py-spy
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
