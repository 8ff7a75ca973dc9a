"""jdist.pipelining: torch's ``torch.distributed.pipelining`` for Flax NNX modules.

``PipelineStage`` runs one stage as compiled forward and backward programs;
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleaved1F1B``
and ``ScheduleInterleavedZeroBubble`` follow torch's action orders (``pipeline_order``)
and ``step(*args, target=, losses=)``; ``split_args_kwargs_into_chunks`` and
``merge_chunks`` are torch's micro-batching; ``pipeline`` groups a list of layers into
stages. Stages run in one process or in several (one pipeline rank each), see
docs/pipelining.md.

| file | job |
|---|---|
| ``_actions.py`` | an action (stage, F/B/I/W, micro-batch) and its text |
| ``_orders.py`` | each schedule's per-rank action lists, pure |
| ``_microbatch.py`` | split a step's arguments, merge outputs |
| ``_stage.py`` | ``PipelineStage``: compiled forward/backward of one stage |
| ``_schedules.py`` | the schedules: run an order over the stages |
| ``_remote.py`` | one rank's share of a pipeline over processes |
| ``_links.py`` | activations and gradients between processes, over XLA's p2p |
| ``_sockets.py`` | the same over jdist's mailbox; which transport a pipeline uses |
| ``_agree.py`` | through the store: peers' liveness and addresses, how a step ended |
| ``_split.py`` | ``pipeline``: layers grouped into stages |
"""

from jdist.pipelining._actions import Action as Action
from jdist.pipelining._actions import Kind as Kind
from jdist.pipelining._microbatch import merge_chunks as merge_chunks
from jdist.pipelining._microbatch import (
    split_args_kwargs_into_chunks as split_args_kwargs_into_chunks,
)
from jdist.pipelining._schedules import Schedule1F1B as Schedule1F1B
from jdist.pipelining._schedules import ScheduleGPipe as ScheduleGPipe
from jdist.pipelining._schedules import ScheduleInterleaved1F1B as ScheduleInterleaved1F1B
from jdist.pipelining._schedules import (
    ScheduleInterleavedZeroBubble as ScheduleInterleavedZeroBubble,
)
from jdist.pipelining._schedules import ScheduleLoopedBFS as ScheduleLoopedBFS
from jdist.pipelining._schedules import get_schedule_class as get_schedule_class
from jdist.pipelining._split import pipeline as pipeline
from jdist.pipelining._stage import PipelineStage as PipelineStage
