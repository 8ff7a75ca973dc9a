"""Worker of tests/launch/test_torch_run.py (torch's bin/test_script_init_method.py):
``init_process_group`` with ``--init-method``, then an all-reduce of a one-hot row must
sum to the world size."""

import argparse
import os

import numpy as np

import jdist

parser = argparse.ArgumentParser()
parser.add_argument("--init-method", "--init_method", required=True)
parser.add_argument("--world-size", "--world_size", type=int,
                    default=int(os.getenv("WORLD_SIZE", "-1")))
parser.add_argument("--rank", type=int, default=int(os.getenv("RANK", "-1")))
args = parser.parse_args()
jdist.init_process_group(backend="gloo", init_method=args.init_method,
                         world_size=args.world_size, rank=args.rank)
rank, world_size = jdist.get_rank(), jdist.get_world_size()
derived = int(np.sum(jdist.all_reduce(np.eye(world_size, dtype=np.int64)[rank])))
if derived != world_size:
    raise RuntimeError(f"Wrong world size derived. Expected: {world_size}, Got: {derived}")
jdist.destroy_process_group()
print("Done")
