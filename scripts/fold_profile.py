"""Summarize a py-spy raw profile (``py-spy record --threads -f raw``) per thread: the share of the
thread's samples in which each function is on the stack (inclusive) and at the top (self).

    python scripts/fold_profile.py server_profile.txt --top 40
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")  # "function (path/file.py:line)"


def frame_name(frame: str) -> str:
    """'function (file.py)': the path's last part, no line, so one function counts once."""
    match = FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    return f"{match.group(1)} ({match.group(2).rsplit('/', 1)[-1]})"


def fold(path: str) -> dict[str, tuple[int, Counter, Counter]]:
    """Thread -> (samples, inclusive counts, self counts)."""
    threads: dict[str, list] = defaultdict(lambda: [0, Counter(), Counter()])
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            # py-spy --threads puts "process ...;thread (id)" first, --subprocesses the process before it
            head = [x for x in frames[:2] if x.startswith(("thread", "process"))]
            thread = ";".join(head) or "all"
            names = [frame_name(x) for x in frames[len(head):]]
            entry = threads[thread]
            entry[0] += int(count)
            for name in set(names):
                entry[1][name] += int(count)
            if names:
                entry[2][names[-1]] += int(count)
    return {k: tuple(v) for k, v in threads.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    for thread, (samples, inclusive, own) in sorted(fold(args.profile).items(), key=lambda kv: -kv[1][0]):
        print(f"== {thread}: {samples} samples")
        print("  inclusive:")
        for name, n in inclusive.most_common(args.top):
            print(f"  {100 * n / samples:5.1f}% {name}")
        print("  self:")
        for name, n in own.most_common(args.top // 2):
            print(f"  {100 * n / samples:5.1f}% {name}")


if __name__ == "__main__":
    main()
