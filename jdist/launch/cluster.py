"""Cluster detection, published for the packages that start a job's runtime
(``jdist.collectives``): which environment launched this process (torchrun, SLURM, Open
MPI, ...) and the job it describes. The code lives in ``_cluster.py``."""

from jdist.launch._cluster import JobSpec as JobSpec
from jdist.launch._cluster import detect_job as detect_job
from jdist.launch._cluster import local_device_ids as local_device_ids

__all__ = ["JobSpec", "detect_job", "local_device_ids"]
