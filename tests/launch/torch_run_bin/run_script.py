"""Worker of tests/launch/test_torch_run.py (torch's launcher/bin/test_script.py): print
the variables torch's agent sets (each must exist), then fail (``--fail``) or write them
as JSON to ``TOUCH_FILE_DIR/<RANK>``."""

import argparse
import json
import os

NAMES = ["LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
         "WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
         "OMP_NUM_THREADS", "TEST_SENTINEL_PARENT", "TORCHELASTIC_ERROR_FILE"]

parser = argparse.ArgumentParser()
parser.add_argument("--fail", action="store_true")
parser.add_argument("--touch-file-dir", "--touch_file_dir")
args = parser.parse_args()
seen = {name: os.environ[name] for name in NAMES}  # KeyError: the agent did not set it
for name, value in seen.items():
    print(f"{name} = {value}")
if args.fail:
    raise RuntimeError("raising exception since --fail flag was set")
with open(os.path.join(args.touch_file_dir, os.environ["RANK"]), "w") as f:
    json.dump(seen, f)
print(f"Success, created {os.environ['RANK']}")
