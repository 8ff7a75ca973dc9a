"""Child side of :func:`jdist.launch.spawn`: load ``(fn, args)``, run, save the result."""

from __future__ import annotations

import pickle
import sys


def main(argv: list[str]) -> int:
    payload, result_path = argv
    with open(payload, "rb") as f:
        fn, args = pickle.load(f)
    result = fn(*args)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    import os

    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
