"""torch's collective test cases, run inside each process of one 4-process job.

Each function follows one test of torch's ``distributed_test.py`` (``DistributedTest``)
or ``test_c10d_gloo.py``, named in its docstring, with torch's inputs and assertions:
tensors become numpy arrays, ``_build_tensor(size, value)`` is ``np.full((size,) * 3,
value)``, and results that torch writes in place are read from the return value (a
writable numpy argument is filled in place too, which is also checked). Imported by
``run_procs`` children only (see ``tests/helpers.py``).
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta

import numpy as np


def _build(size, value, dtype=np.float32):
    return np.full((size, size, size), value, dtype=dtype)


def _eq(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(a, b, err_msg=what)


def _raises(exc, pattern, fn, what):
    import re

    try:
        fn()
    except exc as e:
        assert re.search(pattern, str(e)), (what, str(e))
        return e
    raise AssertionError(f"{what}: no {exc.__name__} matching {pattern!r}")


# ------------------------------------------------------------------ complex dtypes


def all_reduce_sum_complex(dist, rank, group):
    """test_all_reduce_sum_complex (via _test_all_reduce_helper)."""
    master, worker = complex(2, 3), complex(10, 11)
    for src in group:
        tensor = _build(src + 1, master if rank == src else worker, np.complex64)
        out = dist.all_reduce(tensor, dist.ReduceOp.SUM)
        expected = _build(src + 1, master + worker * (len(group) - 1), np.complex64)
        _eq(tensor, expected, "all_reduce complex (in place)")
        _eq(out, expected, "all_reduce complex (returned)")


def all_reduce_complex_unsupported_ops(dist, rank, group):
    """test_all_reduce_complex_unsupported_ops."""
    R = dist.ReduceOp
    for op in (R.MAX, R.MIN, R.PRODUCT, R.BAND, R.BOR, R.BXOR):
        _raises(ValueError, "all_reduce does not support",
                lambda op=op: dist.all_reduce(_build(1, 1, np.complex64), op), f"{op}")


def all_gather_complex(dist, rank, group):
    """test_all_gather_complex (via _test_all_gather_helper)."""
    for dest in group:
        tensor = _build(dest + 1, rank, np.complex64)
        tensors = [_build(dest + 1, -1, np.complex64) for _ in group]
        dist.all_gather(tensors, tensor)
        for t1, i in zip(tensors, group, strict=True):
            _eq(t1, _build(dest + 1, i, np.complex64), "all_gather complex")


def scatter_complex_and_plain(dist, rank, group, group_id=None, dtype=np.float32):
    """test_scatter / test_scatter_complex / _group / _full_group (via
    _test_scatter_helper): non-source ranks pass ``scatter_list=[]``."""
    for dest in group:
        tensor = _build(dest + 1, -1, dtype)
        expected = _build(dest + 1, rank, dtype)
        tensors = [_build(dest + 1, i, dtype) for i in group] if rank == dest else []
        out = dist.scatter(tensor, src=dest, scatter_list=tensors, group=group_id)
        _eq(tensor, expected, "scatter (in place)")
        _eq(out, expected, "scatter (returned)")


def gather_plain(dist, rank, group, group_id=None):
    """test_gather / _group / _full_group (via _test_gather_helper): non-destination
    ranks pass ``gather_list=[]``."""
    for dest in group:
        tensor = _build(dest + 1, rank)
        tensors = [_build(dest + 1, -1) for _ in group] if rank == dest else []
        out = dist.gather(tensor, dst=dest, gather_list=tensors, group=group_id)
        if rank == dest:
            for t1, i in zip(tensors, group, strict=True):
                _eq(t1, _build(dest + 1, i), "gather")
            assert out is tensors
        else:
            assert out is None


def scatter_gather_checks(dist, rank, group):
    """test_scatter_checks / test_gather_checks: list only on the root, src/dst default."""
    one = np.ones([1], np.float32)
    output = one * -1
    if rank == 0:
        dist.scatter(output, src=0, scatter_list=[one * i for i in group])
    else:
        dist.scatter(output, src=0)
    _eq(output, one * rank, "scatter_checks src=0")
    output = one * -1
    if rank == 0:
        dist.scatter(output, scatter_list=[one * i for i in group])
    else:
        dist.scatter(output)
    _eq(output, one * rank, "scatter_checks default src")
    if rank == 0:
        gather_list = [one.copy() for _ in group]
        dist.gather(one * rank, dst=0, gather_list=gather_list)
        for i in group:
            _eq(gather_list[i], one * i, "gather_checks")
    else:
        dist.gather(one * rank, dst=0)


def all_to_all_single_equal_split_complex(dist, rank, group):
    """test_all_to_all_single_equal_split_complex."""
    size = len(group)
    in_tensor = np.ones([size, size], np.complex64) * rank
    expected = np.concatenate([np.ones([1, size], np.complex64) * i for i in group])
    out_tensor = np.ones([size, size], np.complex64) * -1
    out = dist.all_to_all_single(out_tensor, in_tensor)
    _eq(out_tensor, expected, "all_to_all_single complex (in place)")
    _eq(out, expected, "all_to_all_single complex")


def all_to_all_uneven(dist, rank, group):
    """test_all_to_all / test_all_to_all_single_unequal_split (via their helpers), and
    the same with jax arrays and complex values."""
    size = len(group)
    in_splits = [i + 1 for i in group]
    for dtype in (np.float32, np.complex64):
        in_tensors = [np.ones([in_splits[i], size], dtype) * rank for i, _ in enumerate(group)]
        out_tensors = [np.ones([rank + 1, size], dtype) for _ in group]
        dist.all_to_all(out_tensors, in_tensors)
        for t1, i in zip(out_tensors, group, strict=True):
            _eq(t1, np.ones([rank + 1, size], dtype) * i, "all_to_all uneven")
        out_splits = [rank + 1 for _ in group]
        in_tensor = np.ones([sum(in_splits), size], dtype) * rank
        out_tensor = np.ones([(rank + 1) * size, size], dtype)
        expected = np.concatenate([np.ones([rank + 1, size], dtype) * i for i in group])
        out = dist.all_to_all_single(out_tensor, in_tensor, out_splits, in_splits)
        _eq(out_tensor, expected, "all_to_all_single unequal (in place)")
        _eq(out, expected, "all_to_all_single unequal (returned)")
    import jax.numpy as jnp

    got = dist.all_to_all_single(None, jnp.arange(sum(in_splits), dtype=jnp.int32) + 100 * rank,
                                 [rank + 1] * size, in_splits)
    offsets = np.concatenate([[0], np.cumsum(in_splits)])
    want = np.concatenate([np.arange(offsets[rank], offsets[rank + 1], dtype=np.int32) + 100 * i
                           for i in group])
    _eq(np.asarray(got), want, "all_to_all_single jax, no output array")


def complex_jax_and_avg(dist, rank, group):
    """Beyond torch's cases: jax.Array complex in -> out, AVG, and complex128."""
    import jax.numpy as jnp

    x = jnp.full((2, 3), complex(rank, -rank), jnp.complex64)
    out = dist.all_reduce(x, dist.ReduceOp.AVG)
    mean = sum(complex(r, -r) for r in group) / len(group)
    assert out.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(out), np.full((2, 3), mean, np.complex64))
    y = np.full((3,), complex(1.5, rank), np.complex128)
    _eq(dist.broadcast(y, src=1), np.full((3,), complex(1.5, 1), np.complex128),
        "broadcast complex128")


# ------------------------------------------------------------------ reduce_scatter


def reduce_scatter_v(dist, rank, group):
    """test_reduce_scatter_v_cuda, on CPU: uneven input splits ``src + 1``."""
    split = [src + 1 for src in group]
    start, total = sum(split[:rank]), sum(split)
    for async_val in (True, False):
        tensor = np.full((total, total, total), 10, np.float32)
        tensor[start:start + split[rank]] = 2
        out_tensor = np.full((split[rank], total, total), -1, np.float32)
        parts = np.split(tensor, np.cumsum(split)[:-1])
        req = dist.reduce_scatter(out_tensor, list(parts), dist.ReduceOp.SUM, None, async_val)
        if async_val:
            req.wait()
        expected = np.full((split[rank], total, total), 2 + 10 * (len(group) - 1),
                           np.float32)
        _eq(out_tensor, expected, f"reduce_scatter_v async={async_val}")


def reduce_scatter_gloo_shapes(dist, rank, group):
    """ProcessGroupGlooTest.test_reduce_scatter's uneven shapes (0,), (1,), (2,), (3,):
    member j's input for destination i is ``full(i, 10 * j + i)``; member i gets the
    sum over j (checked against numpy), for float32 and int64."""
    for dtype in (np.float32, np.int64):
        inputs = [np.full((i,), 10 * rank + i, dtype) for i in range(len(group))]
        out = dist.reduce_scatter(None, inputs)
        expected = np.sum([np.full((rank,), 10 * j + rank, dtype) for j in group], 0)
        _eq(out, expected.astype(dtype), f"reduce_scatter uneven {np.dtype(dtype).name}")


def reduce_scatter_tensor_forms(dist, rank, group):
    """test_reduce_scatter_tensor_cuda, on CPU: concatenated and stacked inputs."""
    size = 2
    tensor_out = np.zeros(size, np.int64)
    tensor_in = np.arange(len(group) * size, dtype=np.int64)
    dist.reduce_scatter_tensor(tensor_out, tensor_in, dist.ReduceOp.SUM)
    expected = np.arange(rank * size, (rank + 1) * size, dtype=np.int64) * len(group)
    _eq(tensor_out, expected, "reduce_scatter_tensor concatenated")
    stacked = tensor_in.reshape(len(group), size)
    tensor_out = np.zeros(size, np.int64)
    out = dist.reduce_scatter_tensor(tensor_out, stacked, dist.ReduceOp.SUM)
    _eq(tensor_out, expected, "reduce_scatter_tensor stacked (in place)")
    _eq(out, expected, "reduce_scatter_tensor stacked (returned, shape (2,))")


# ------------------------------------------------------------------ groups and objects


def get_backend(dist, rank, group):
    """test_get_backend: members get the backend, non-members torch's ValueError."""
    members = [1, 2] if dist.get_world_size() > 2 else [0, 1]
    group_id = dist.new_group(members)
    assert dist.get_backend() == "gloo"
    if rank in members:
        assert dist.get_backend(group_id) == "gloo"
    else:
        e = _raises(ValueError, "Invalid process group specified",
                    lambda: dist.get_backend(group_id), "get_backend non-member")
        from jdist.errors import GroupMismatchError

        assert isinstance(e, GroupMismatchError)
    return group_id


def non_member_collectives(dist, rank, group_id, members):
    """torch: a collective on a group this rank is not in warns and returns None."""
    if rank in members:
        return
    x = np.ones(3, np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dist.all_reduce(x, group=group_id) is None
        assert dist.broadcast(x, src=members[0], group=group_id) is None
        assert dist.barrier(group=group_id) is None
        assert dist.all_gather_object([None] * len(members), rank, group=group_id) is None
    _eq(x, np.ones(3, np.float32), "non-member input untouched")
    texts = [str(w.message) for w in caught]
    assert len(texts) == 4 and all("does not belong to the given group" in t
                                   for t in texts), texts
    assert dist.get_rank(group_id) == -1 and dist.get_world_size(group_id) == -1


def scatter_object_list(dist, rank, group):
    """test_scatter_object_list."""
    objects = ["foo", 12, {"key": 2}, [1, 2, 3]]  # stand-ins for torch's object list
    scatter_list = objects if rank == 0 else [None for _ in objects]
    scatter_list = scatter_list[:len(group)]
    i = 0
    while len(scatter_list) < len(group):
        scatter_list.append(scatter_list[i])
        i += 1
    output = [None]
    dist.scatter_object_list(output, scatter_list, src=0)
    assert output[0] == objects[rank % len(objects)], output
    _raises(ValueError,
            "Expected argument scatter_object_output_list to be a list of size at least 1.",
            lambda: dist.scatter_object_list([], scatter_list, src=0), "scatter_object_list")


# ------------------------------------------------------------------ monitored_barrier


def monitored_barrier_gloo(dist, rank, group):
    """test_monitored_barrier_gloo (on a fresh group of all ranks: torch runs each test
    in fresh processes, so no case sees another's late arrivals)."""
    pg = dist.new_group()
    tensors = [np.ones(10, np.float32) * rank]
    for _ in range(10):
        dist.all_reduce(np.concatenate(tensors))
    timeout = timedelta(seconds=2)
    dist.monitored_barrier(pg, timeout=timeout)
    for _ in range(10):
        dist.all_reduce(np.concatenate(tensors))
    dist.monitored_barrier(pg, timeout=timeout, wait_all_ranks=True)
    failed_rank, src_rank = 1, 0
    if rank == src_rank:
        _raises(RuntimeError, f"Rank {failed_rank} failed to pass monitoredBarrier",
                lambda: dist.monitored_barrier(pg, timeout=timeout), "mb rank 0")
    elif rank != failed_rank:
        _raises(RuntimeError,
                f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                f"while waiting for send/recv from rank {src_rank}",
                lambda: dist.monitored_barrier(pg, timeout=timeout), "mb others")
    dist.barrier(timeout=30)


def monitored_barrier_subgroup(dist, rank, group):
    """test_monitored_barrier_gloo_subgroup: non-members return without error."""
    failed_rank, timeout = 1, 0.1
    subgroup = dist.new_group(ranks=[0, 1])
    if rank == failed_rank:
        return
    if rank == 0:
        _raises(RuntimeError, f"Rank {failed_rank} failed to pass monitoredBarrier",
                lambda: dist.monitored_barrier(subgroup, timeout), "mb subgroup")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert dist.monitored_barrier(subgroup, timeout) is None


def monitored_barrier_rank_0_timeout(dist, rank, group):
    """test_monitored_barrier_gloo_rank_0_timeout (function form of
    ``process_group.monitored_barrier(timeout)``)."""
    process_group = dist.new_group(ranks=list(range(len(group))))
    if rank == 0:
        _raises(RuntimeError, f"Rank {rank} timed out in monitoredBarrier",
                lambda: dist.monitored_barrier(process_group, timedelta(seconds=0)),
                "mb rank 0 timeout")


def monitored_barrier_failure_order(dist, rank, group):
    """test_monitored_barrier_failure_order: ranks 2 and 3 never call; rank 2 reported."""
    pg = dist.new_group()
    timeout = timedelta(seconds=2)
    if rank == 0:
        e = _raises(RuntimeError, "Rank 2", lambda: dist.monitored_barrier(pg, timeout),
                    "mb order")
        assert "Rank 3" not in str(e), str(e)
    elif rank == 1:
        _raises(RuntimeError,
                "Rank 1 successfully reached monitoredBarrier, but received errors while "
                "waiting for send/recv from rank 0",
                lambda: dist.monitored_barrier(pg, timeout), "mb order rank 1")


def monitored_barrier_wait_all_ranks(dist, rank, group):
    """test_monitored_barrier_wait_all_ranks."""
    pg = dist.new_group()
    if rank == 0:
        rank_str = ", ".join(str(i) for i in range(1, len(group)))
        _raises(RuntimeError, f"Ranks {rank_str} failed to pass monitoredBarrier",
                lambda: dist.monitored_barrier(pg, timedelta(seconds=0.1),
                                               wait_all_ranks=True), "mb wait all")


def lone_barrier_honours_group_timeout(dist, rank, group):
    """issue #15: a lone ``barrier()`` on ``new_group(timeout=1 s)`` raises after ~1 s."""
    from jdist.errors import CollectiveTimeoutError

    sub = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank != 0:
        return None
    t = time.monotonic()
    e = _raises(CollectiveTimeoutError, r" Timed out waiting 1000ms for ranks \[1\]",
                lambda: dist.barrier(group=sub), "lone barrier")
    assert isinstance(e, RuntimeError) and isinstance(e, TimeoutError)
    return time.monotonic() - t


def barrier_timeouts(dist, rank, group):
    """test_barrier_timeout_full_group and test_barrier_timeout_arg (via
    _test_barrier_timeout): only group rank 0 calls; it raises torch's " Timed out "
    text, not before the timeout."""
    timeout = timedelta(seconds=1)
    full = dist.new_group(timeout=timeout)
    pg = dist.new_group(timeout=timedelta(seconds=300))
    if dist.get_rank(full) != 0:
        return
    expected = time.time() + timeout.total_seconds()
    _raises(Exception, " (Timed out|closed|timeout) ", lambda: dist.barrier(full), "full")
    assert time.time() >= expected - 0.1
    _raises(RuntimeError, "Timed out waiting 1ms",
            lambda: dist.barrier(pg, timeout=timedelta(milliseconds=1)), "timeout arg")


# ------------------------------------------------------------------ the job


def conformance() -> dict:
    """Every case above, in torch's order of calls; ``dist`` is ``jdist``."""
    import jdist as dist

    dist.init_process_group(timeout=60)
    rank, n = dist.get_rank(), dist.get_world_size()
    assert n == 4 and rank == int(os.environ["RANK"])
    group = list(range(n))
    all_reduce_sum_complex(dist, rank, group)
    all_reduce_complex_unsupported_ops(dist, rank, group)
    all_gather_complex(dist, rank, group)
    scatter_complex_and_plain(dist, rank, group, dtype=np.complex64)
    scatter_complex_and_plain(dist, rank, group)
    gather_plain(dist, rank, group)
    full = dist.new_group()  # _init_full_group_test
    scatter_complex_and_plain(dist, rank, group, full)
    gather_plain(dist, rank, group, full)
    sub = dist.new_group([1, 2])  # _init_group_test: non-members run no case
    if rank in (1, 2):
        scatter_complex_and_plain(dist, rank, [1, 2], sub)
        gather_plain(dist, rank, [1, 2], sub)
    scatter_gather_checks(dist, rank, group)
    all_to_all_single_equal_split_complex(dist, rank, group)
    all_to_all_uneven(dist, rank, group)
    complex_jax_and_avg(dist, rank, group)
    reduce_scatter_v(dist, rank, group)
    reduce_scatter_gloo_shapes(dist, rank, group)
    reduce_scatter_tensor_forms(dist, rank, group)
    group_id = get_backend(dist, rank, group)
    non_member_collectives(dist, rank, group_id, [1, 2])
    scatter_object_list(dist, rank, group)
    dist.barrier()
    monitored_barrier_gloo(dist, rank, group)
    monitored_barrier_subgroup(dist, rank, group)
    dist.barrier(timeout=30)
    monitored_barrier_rank_0_timeout(dist, rank, group)
    dist.barrier(timeout=30)
    monitored_barrier_failure_order(dist, rank, group)
    dist.barrier(timeout=30)
    monitored_barrier_wait_all_ranks(dist, rank, group)
    dist.barrier(timeout=30)
    lone = lone_barrier_honours_group_timeout(dist, rank, group)
    dist.barrier(timeout=30)
    barrier_timeouts(dist, rank, group)
    dist.barrier(timeout=30)
    dist.destroy_process_group()
    return {"rank": rank, "lone_barrier_s": lone}
