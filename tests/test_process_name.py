"""A process named for ps and top (serve's engine process and workers: tests/serve/test_app.py sees
them by name)."""

import subprocess
import sys

import pytest

from snac_fast.runtime.process_name import name_process


def test_a_process_takes_the_name_given():
    code = ("from snac_fast.runtime.process_name import name_process; import sys; "
            "done = name_process(sys.argv[1]); print(done, open('/proc/self/comm').read().strip())")
    out = subprocess.run([sys.executable, "-c", code, "snac-test-15byt"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "snac-test-15byt"]


def test_a_name_longer_than_the_kernel_keeps_is_refused():
    with pytest.raises(ValueError, match="at most 15 bytes"):
        name_process("snac-fast-engine")  # 16 bytes: the kernel would cut it to 15
