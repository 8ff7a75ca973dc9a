"""torch's RPC / dist-autograd test cases, our own code with their inputs and assertions.

Run in 3 real processes by ``test_torch_conformance.py``. Each case is named after the
torch test function (``torch/testing/_internal/distributed/rpc/rpc_test.py`` and
``dist_autograd_test.py``) and runs on every rank, as torch's ``dist_init`` does,
inside its own RPC session where torch's test needs a fresh one (RRef ids). The result
is ``{case: "ok" | traceback}`` per rank. ``torch.add(torch.ones(n, n), 1)`` becomes
``np.add(np.ones((n, n)), 1)``.
"""

from __future__ import annotations

import io
import os
import re
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import numpy as np

from jdist import rpc
from jdist.rpc import RRef, WorkerInfo, functions
from jdist.store import PrefixStore, TCPStore

WS = 3
_CASES: list = []


def case(fn):
    _CASES.append(fn)
    return fn


def worker_name(r: int) -> str:
    return f"worker{r}"


class Raises:
    """``assertRaisesRegex``: the body must raise ``exc_type`` matching ``regex``."""

    def __init__(self, exc_type, regex: str = ""):
        self.exc_type, self.regex = exc_type, regex

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            raise AssertionError(f"{self.exc_type.__name__} not raised (wanted {self.regex!r})")
        if not issubclass(et, self.exc_type):
            return False  # the wrong error propagates with its own traceback
        if not re.search(self.regex, str(ev)):
            raise AssertionError(f"{self.regex!r} not found in {str(ev)!r}")
        return True


def check(cond, what=""):
    if not cond:
        raise AssertionError(what)


# ---- functions run remotely (torch's helpers, in numpy) ----
def my_function(a, b, c):
    return a + b + c


def my_sleep_func(seconds=1):
    time.sleep(seconds)
    return np.multiply(1, 1)


def raise_func():
    raise ValueError(expected_err)


expected_err = "Expected error"
expected_err_escape = "\nFirst line of error \n next line of error \n last line of error"


def raise_func_escape():
    raise ValueError(expected_err_escape)


def check_rref_confirmed(rref):
    return rref.confirmed_by_owner()


def fail_on_fut(fut):
    pass


def return_future():
    return rpc.Future()


@functions.async_execution
def async_wrong_type():
    return np.zeros((2, 2))


def rref_forward_chain(dst, world_size, rref, ttl):
    if ttl > 0:
        current_dst = worker_name(dst)
        next_dst = (dst + 1) % world_size
        ret_rref = rpc.remote(current_dst, rref_forward_chain,
                              args=(next_dst, world_size, rref, ttl - 1))
        return [ret_rref]
    return rref.to_here()


class AsyncExecutionClass:
    @staticmethod
    @functions.async_execution
    def static_async_add(to, x, y, z):
        return rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @functions.async_execution
    def class_async_add(cls, to, x, y, z):
        ret_fut = rpc.Future()
        rpc.rpc_async(to, np.add, args=(x, y)).then(
            lambda fut: ret_fut.set_result(fut.wait() + z))
        return ret_fut

    @functions.async_execution
    def bound_async_add(self, to, x, y, z):
        return rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut: fut.wait() + z)


class MyParameterServer:
    def __init__(self, trainers):
        self.lock = threading.Lock()
        self.trainers = trainers
        self.iteration = 0
        self.updates = 0
        self.futures = []
        self.total = None
        self.gradient = None

    @staticmethod
    def get_gradient(rref):
        return rref.local_value().gradient

    @staticmethod
    @functions.async_execution
    def average(rref, riteration, tensor):
        self = rref.local_value()
        fut = rpc.Future()
        with self.lock:
            if riteration > self.iteration:
                self.iteration = riteration
                self.updates = 0
                self.futures.clear()
            self.futures.append(fut)
            if self.total is None:
                self.total = tensor
            else:
                self.total += tensor
            self.updates += 1
            if self.trainers == self.updates:
                self.gradient = self.total / float(self.trainers)
                for f in self.futures:
                    f.set_result(self.total / float(self.trainers))
        return fut


def trainer_func(rref, seed):
    rng = np.random.default_rng(seed)
    for i in range(10):
        gradient = rng.random((10, 10))  # torch: the EmbeddingBag's gradient
        gradient = rref.rpc_async().average(rref, i, gradient).wait()
        ps_gradient = rref.rpc_sync().get_gradient(rref)
        check(np.array_equal(gradient, ps_gradient), f"iteration {i}")
    return True


def _run_func_in_mode(to, fn, mode, args=None, kwargs=None):
    if mode == "sync":
        return rpc.rpc_sync(to, fn, args=args, kwargs=kwargs)
    if mode == "async":
        return rpc.rpc_async(to, fn, args=args, kwargs=kwargs).wait()
    return rpc.remote(to, fn, args=args, kwargs=kwargs).to_here()


MODES = ("sync", "async", "remote")


# ---- the cases ----
class Env:
    def __init__(self, rank, base):
        self.rank, self.base, self.n = rank, base, 0

    def options(self, **kw):
        self.n += 1
        kw.setdefault("rpc_timeout", 30)
        return rpc.RpcBackendOptions(init_method=PrefixStore(f"c{self.n}", self.base), **kw)

    @contextmanager
    def session(self, **kw):
        rpc.init_rpc(worker_name(self.rank), rank=self.rank, world_size=WS,
                     rpc_backend_options=self.options(**kw))
        try:
            yield
        finally:
            rpc.shutdown()


@case
def test_invalid_names(env):
    with Raises(RuntimeError, "Worker name must match"):
        WorkerInfo("abc*", 0)
    with Raises(RuntimeError, "Worker name must match"):
        WorkerInfo(" ", 0)
    with Raises(RuntimeError, "must be non-empty"):
        WorkerInfo("", 0)
    with Raises(RuntimeError, "shorter than 128"):
        WorkerInfo("".join(["a" for _ in range(500)]), 0)
    check(WorkerInfo("worker1", 1) == WorkerInfo(1, "worker1"))  # torch's (name, id) order


@case
def test_wrong_types(env):
    with Raises(TypeError, "Argument backend must be a member of BackendType"):
        rpc.init_rpc(name=worker_name(env.rank), rank=env.rank, world_size=WS,
                     backend="TENSORPIPE")
    with Raises(TypeError,
                "Argument rpc_backend_options must be an instance of RpcBackendOptions"):
        rpc.init_rpc(name=worker_name(env.rank), rank=env.rank, world_size=WS,
                     backend=rpc.BackendType.TENSORPIPE,
                     rpc_backend_options={"init_method": "env://"})


@case
def torch_positional_init_rpc(env):
    """torch's order: init_rpc(name, backend, rank, world_size, rpc_backend_options)."""
    rpc.init_rpc(worker_name(env.rank), rpc.BackendType.TENSORPIPE, env.rank, WS,
                 env.options())
    try:
        check(rpc.get_worker_info() == WorkerInfo(env.rank, worker_name(env.rank)))
    finally:
        rpc.shutdown()


@case
def test_duplicate_name_2(env):
    with Raises(RuntimeError, "is not unique"):
        rpc.init_rpc(name=worker_name(env.rank % (WS - 1)), rank=env.rank, world_size=WS,
                     rpc_backend_options=env.options())


@case
def test_set_and_get_default_rpc_timeout(env):
    # also: a 0.5 s rpc_timeout is not the rendezvous timeout (init_rpc must not fail)
    if env.rank == 1:
        time.sleep(1.0)  # this rank arrives later than rpc_timeout
    with env.session(rpc_timeout=0.5):
        check(rpc.get_rpc_timeout() == 0.5, rpc.get_rpc_timeout())


@case
def test_rref_str(env):
    with env.session():
        rref1 = RRef(env.rank)
        id_class = "GloballyUniqueId"
        check(f"OwnerRRef({id_class}(created_on={env.rank}, local_id=0))" == rref1.__str__(),
              rref1.__str__())
        dst_rank = (env.rank + 1) % WS
        rref2 = rpc.remote(worker_name(dst_rank), np.add, args=(np.ones((2, 2)), 1))
        want = (f"UserRRef(RRefId = {id_class}(created_on={env.rank}, local_id=1), "
                f"ForkId = {id_class}(created_on={env.rank}, local_id=2))")
        check(rref2.__str__() == want, rref2.__str__())


@case
def test_local_value_not_on_owner(env):
    with env.session():
        next_rank = (env.rank + 1) % WS
        rref = rpc.remote(worker_name(next_rank), np.add, args=(np.ones(1), np.ones(1)))
        with Raises(RuntimeError, (
                rf"For UserRRef\(rref_id=GloballyUniqueId\(created_on={env.rank}, local_id=0\), "
                rf"fork_id=GloballyUniqueId\(created_on={env.rank}, local_id=1\)\), "
                r"can't call localValue\(\) on user "
                rf"WorkerInfo\(id={env.rank}, name={worker_name(env.rank)}\). "
                rf"Call it on owner WorkerInfo\(id={next_rank}, name={worker_name(next_rank)}\)")):
            rref.local_value()


@case
def test_reinit(env):
    with env.session():
        with Raises(RuntimeError, "is already initialized"):
            rpc.init_rpc(name=worker_name(env.rank), rank=env.rank, world_size=WS,
                         rpc_backend_options=env.options())


@case
def test_shutdown_followed_by_rpc(env):
    n = env.rank + 1
    dst_rank = n % WS
    with env.session():
        ret = rpc.rpc_sync(worker_name(dst_rank), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        check(np.array_equal(ret, np.ones((n, n)) * 2))
    with Raises(RuntimeError, "^RPC has not been initialized"):
        rpc.rpc_sync(worker_name(dst_rank), np.add, args=(np.ones((n, n)), np.ones((n, n))))


def in_session(fn):
    """A torch ``@dist_init`` case: run inside the shared session."""
    fn._in_session = True
    return case(fn)


@in_session
def test_worker_id(env):
    n = env.rank + 1
    peer_rank = n % WS
    self_worker_info = rpc.get_worker_info()
    peer_worker_info = rpc.get_worker_info(worker_name(peer_rank))
    check(self_worker_info.name == worker_name(env.rank))
    check(peer_worker_info.name == worker_name(peer_rank))
    with Raises(RuntimeError, "could not find destination"):
        rpc.get_worker_info("WorkerUnknown")


@in_session
def test_send_to_rank(env):
    dst_rank = (env.rank + 1) % WS
    for mode in MODES:
        ret = _run_func_in_mode(dst_rank, np.add, mode, args=(np.ones((2, 2)), 1))
        check(np.array_equal(ret, np.ones((2, 2)) + 1))
    for bad, exc in ((WS + 1, RuntimeError), (-1, RuntimeError), (dst_rank + 0.5, ValueError),
                     (dst_rank - 0.5, ValueError)):
        for mode in MODES:
            with Raises(exc):
                _run_func_in_mode(bad, np.add, mode, args=(np.ones((2, 2)), 1))


@in_session
def test_mark_future_twice(env):
    fut = rpc.rpc_async(worker_name((env.rank + 1) % WS), np.add, args=(np.zeros((2, 2)), 1))
    check(np.array_equal(fut.wait(), np.zeros((2, 2)) + 1))
    with Raises(RuntimeError, "Future can only be marked completed once"):
        fut.set_result(1)


@in_session
def test_callback_none(env):
    dst = worker_name((env.rank + 1) % WS)
    with Raises(TypeError, "incompatible function arguments."):
        rpc.rpc_async(dst, raise_func).then(None)


@in_session
def test_callback_wrong_arg_num(env):
    n = env.rank + 1
    fut = rpc.rpc_async(worker_name(n % WS), np.add, args=(np.ones((n, n)), np.ones((n, n))))
    cb_fut = fut.then(my_function)
    check(np.array_equal(fut.wait(), np.ones((n, n)) * 2))
    with Raises(RuntimeError, "my\\_function\\(\\) missing 2 required positional arguments"):
        cb_fut.wait()


@in_session
def test_callback_wrong_arg_type(env):
    dst = worker_name((env.rank + 1) % WS)
    fut0 = rpc.rpc_async(dst, np.add, args=(np.ones((2, 2)), 1))
    fut1 = fut0.then(lambda x: x + 1)
    with Raises(RuntimeError, "unsupported operand type\\(s\\) for \\+"):
        fut1.wait()


@in_session
def test_rref_proxy_non_exist(env):
    dst = worker_name((env.rank + 1) % WS)
    rref = rpc.remote(dst, my_function, args=(np.ones((2, 2)), 1, 3))
    msg = "has no attribute 'non_exist'"
    with Raises(AttributeError, msg):
        rref.rpc_sync().non_exist()
    with Raises(AttributeError, msg):
        rref.rpc_async().non_exist().wait()
    with Raises(AttributeError, msg):
        rref.remote().non_exist()


@in_session
def test_rref_timeout(env):
    if env.rank != 0:
        return
    dst_worker = worker_name((env.rank + 1) % WS)
    rref = rpc.remote(dst_worker, my_sleep_func, args=(2,), timeout=0.01)
    with Raises(RuntimeError, "RPC ran for more than"):
        rref._get_future().wait()
    with Raises(RuntimeError, "RRef creation"):
        rref.to_here()


@in_session
def test_user_rrefs_confirmed(env):
    dst_rank = (env.rank + 1) % WS
    rref = rpc.remote(worker_name((env.rank + 2) % WS), np.add, args=(np.zeros((2, 2)), 1))
    check(rpc.rpc_sync(worker_name(dst_rank), check_rref_confirmed, args=(rref,)) is True)
    ret_rref = rpc.remote(worker_name(dst_rank), check_rref_confirmed, args=(rref,))
    check(ret_rref.to_here() is True)  # test_user_rrefs_confirmed_remote


@in_session
def test_async_function_wrong_return_type(env):  # + _async, _remote
    msg = ("Functions decorated with @rpc\\.async_function must return a "
           "torch\\.futures\\.Future object,")
    for mode in MODES:
        t0 = time.monotonic()
        with Raises(RuntimeError, msg):
            _run_func_in_mode(worker_name((env.rank + 1) % WS), async_wrong_type, mode)
        check(time.monotonic() - t0 < 5, f"{mode}: took {time.monotonic() - t0:.1f} s")


@in_session
def test_return_future(env):  # + _async, _remote
    for mode in MODES:
        with Raises(RuntimeError, "Can not pickle torch.futures.Future"):
            _run_func_in_mode(worker_name((env.rank + 1) % WS), return_future, mode)


@in_session
def test_pickle_future(env):
    fut = rpc.Future()
    err = "Can not pickle torch.futures.Future"
    dst = worker_name((env.rank + 1) % WS)
    with Raises(RuntimeError, err):
        rpc.rpc_sync(dst, fail_on_fut, args=(fut,))
    with Raises(RuntimeError, err):
        rpc.rpc_async(dst, fail_on_fut, args=(fut,))
    with Raises(RuntimeError, err):
        rpc.remote(dst, fail_on_fut, args=(fut,))


def store_barrier(env, key, timeout=30.0):
    env.base.add(key, 1)
    deadline = time.monotonic() + timeout
    while env.base.add(key, 0) < WS:
        check(time.monotonic() < deadline, f"barrier {key} timed out")
        time.sleep(0.01)


@in_session
def test_py_raise_in_user_func(env):
    err, real = io.StringIO(), sys.stderr
    sys.stderr = err  # torch's captured_output(): the callee prints the error
    try:
        store_barrier(env, "raise_in_user_func/1")
        fut = rpc.rpc_async(worker_name((env.rank + 1) % WS), raise_func)
        with Raises(ValueError, expected_err):
            fut.wait()
        store_barrier(env, "raise_in_user_func/2")  # the others' calls to us ran
    finally:
        sys.stderr = real
    check(expected_err in err.getvalue(), err.getvalue())


@in_session
def test_py_raise_in_user_func_escaped_str(env):
    fut = rpc.rpc_async(worker_name((env.rank + 1) % WS), raise_func_escape)
    try:
        fut.wait()
    except ValueError as e:
        msg = str(e)
        check(msg == msg.encode("utf-8").decode("unicode_escape"), msg)
    else:
        raise AssertionError("expected raise_func_escape to raise ValueError.")


@in_session
def test_async_class_rref_proxy(env):  # + _async, _remote
    dst1 = worker_name((env.rank + 1) % WS)
    dst2 = worker_name((env.rank + 2) % WS)
    rref = rpc.remote(dst1, AsyncExecutionClass)
    x = np.ones((2, 2))
    y = np.ones((2, 2)) + 1
    for mode in MODES:
        if mode == "sync":
            ret = rref.rpc_sync().static_async_add(dst2, x, x, y)
            ret += rref.rpc_sync().class_async_add(dst2, x, x, y)
            ret += rref.rpc_sync().bound_async_add(dst2, x, x, y)
        elif mode == "async":
            ret = rref.rpc_async().static_async_add(dst2, x, x, y).wait()
            ret += rref.rpc_async().class_async_add(dst2, x, x, y).wait()
            ret += rref.rpc_async().bound_async_add(dst2, x, x, y).wait()
        else:
            ret = rref.remote().static_async_add(dst2, x, x, y).to_here()
            ret += rref.remote().class_async_add(dst2, x, x, y).to_here()
            ret += rref.remote().bound_async_add(dst2, x, x, y).to_here()
        check(np.array_equal(ret, 3 * 4 * x), (mode, ret))


@in_session
def test_my_parameter_server(env):
    ps_rref = RRef(MyParameterServer(WS - 1))
    futures = [rpc.rpc_async(worker_name((env.rank + i) % WS), trainer_func,
                             args=(ps_rref, 10 * env.rank + i)) for i in range(1, WS)]
    check(rpc.wait_all(futures) == [True] * (WS - 1))


@in_session
def test_rref_forward_chain(env):
    ttl = 8
    n = env.rank + 1
    dst_rank = n % WS
    rref = rpc.remote(worker_name(dst_rank), np.add, args=(np.ones((n, n)), 1))
    ret_rref = rref_forward_chain(dst_rank, WS, rref, ttl)
    for _ in range(ttl):
        check(len(ret_rref) == 1)
        ret_rref = ret_rref[0].to_here()
    check(np.array_equal(ret_rref, np.add(np.ones((n, n)), 1)))


@in_session
def test_backward_invalid_args(env):  # dist_autograd_test.py
    from jdist.rpc import dist_autograd

    with dist_autograd.context() as context_id:
        with Raises(TypeError, "incompatible function arguments"):
            dist_autograd.backward(context_id, None)
        with Raises(TypeError, "incompatible function arguments"):
            dist_autograd.backward(None, None)
        with Raises(RuntimeError, "No tensors provided for gradient computation"):
            dist_autograd.backward(context_id, [])
        with Raises(RuntimeError, "requires_grad not set on"):
            dist_autograd.backward(context_id, [np.random.rand(3, 3)])
        with Raises(RuntimeError, "is not a scalar, all roots need to be scalar"):
            import jax.numpy as jnp

            dist_autograd.backward(context_id, lambda: jnp.ones((3, 3)))


@in_session
def departures_in_dist_autograd(env):
    """Departures (docs/migration.md): remote() to this worker inside a loss function
    raises; rpc_async inside it has completed when it returns."""
    import jax.numpy as jnp

    from jdist.errors import DistAutogradError
    from jdist.rpc import dist_autograd

    with dist_autograd.context() as cid:
        with Raises(DistAutogradError, "to this worker inside a dist_autograd loss"):
            dist_autograd.backward(cid, lambda: jnp.sum(
                rpc.remote(worker_name(env.rank), np.add, (jnp.ones(2), 1)).to_here()))
    seen = []

    def loss(w):
        fut = rpc.rpc_async(worker_name((env.rank + 1) % WS), np.multiply, (w, 3.0))
        seen.append(fut.done())
        return jnp.sum(fut.wait())

    with dist_autograd.context() as cid:
        check(float(dist_autograd.backward(cid, loss, jnp.ones(2))) == 6.0)
    check(seen == [True], seen)


# ---- graceful shutdown: passive workers wait for a master busier than their timeout ----
def slow_echo(x, seconds):
    time.sleep(seconds)
    return x


def shutdown_semantics(env) -> dict:
    out = {}
    rpc.init_rpc(worker_name(env.rank), rank=env.rank, world_size=WS,
                 rpc_backend_options=env.options(shutdown_timeout=1.0))
    t0 = time.monotonic()
    if env.rank == 0:  # the master: 3.5 s of work, longer than the others' shutdown_timeout
        got = []
        for i in range(4):
            got.append(rpc.rpc_sync(worker_name(1 + i % 2), slow_echo, (i, 0.3)))
        time.sleep(1.5)  # local work, no RPC at all
        got.append(rpc.rpc_sync(worker_name(2), slow_echo, (9, 0.5)))
        out["master_calls"] = got
        out["master_worked"] = time.monotonic() - t0
        rpc.shutdown()
    else:  # passive workers call shutdown at once; rank 2 with torch's timeout=0
        rpc.shutdown(timeout=0 if env.rank == 2 else None)
    out["shutdown_took"] = time.monotonic() - t0
    return out


def run() -> dict:
    rank = int(os.environ["RANK"])
    base = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WS, rank == 0)
    env = Env(rank, base)
    results = {}

    def one(fn):
        try:
            fn(env)
            results[fn.__name__] = "ok"
        except BaseException:  # noqa: BLE001 - reported per case
            results[fn.__name__] = traceback.format_exc()

    for fn in [f for f in _CASES if not getattr(f, "_in_session", False)]:
        one(fn)
    with env.session():
        for fn in [f for f in _CASES if getattr(f, "_in_session", False)]:
            one(fn)
    shutdown = shutdown_semantics(env)
    return {"cases": results, "shutdown": shutdown}
