"""torch's bin/test_script_is_torchelastic_launched.py: writes whether this process was
started by the launcher (``jdist.is_torchelastic_launched()``) to ``--out-file``."""

import argparse

import jdist

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-file", required=True)
    args = parser.parse_args()
    with open(args.out_file, "w") as f:
        f.write(str(jdist.is_torchelastic_launched()))
