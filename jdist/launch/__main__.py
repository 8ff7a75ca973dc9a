"""``jdist-run`` / ``python -m jdist.launch``: start a job of N processes per node.

Example::

    jdist-run --nproc-per-node 2 --devices-per-proc 2 train.py --epochs 3
    # two simulated hosts on one machine:
    jdist-run --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-port 29400 train.py &
    jdist-run --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-port 29400 train.py

    # inside a SLURM allocation: the node flags come from the srun step
    srun --ntasks-per-node=1 jdist-run --nproc-per-node 4 train.py

Every line a worker prints is prefixed with ``[rank N]``, and progress bars stay live
(carriage-return updates are forwarded as they come). ``--log-dir`` writes per-rank
files; ``--redirects`` / ``--tee`` choose what the console shows, as in torchrun; the
runtime's routine messages are hidden unless ``--verbose``. When a worker fails, the
others are stopped (SIGTERM, SIGKILL after ``--shutdown-timeout``) and the job is
restarted while the job-wide ``--max-restarts`` budget lasts; otherwise the launcher
exits with the failed rank's exit code and prints its Python traceback (or its last
stderr lines). The failed rank is the first to fail by time, not the first exit noticed:
each worker records its uncaught exception or fatal signal with a timestamp
(``JDIST_ERROR_FILE``), so peers that died because of it are listed as consequences.
"""

from __future__ import annotations

import sys

from jdist.launch._agent import run
from jdist.launch._config import parse_args
from jdist.launch._config import parse_min_max_nnodes as parse_min_max_nnodes


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jdist-run`` console script."""
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
