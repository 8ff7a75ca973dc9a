"""Rank processes forked from a preloaded server: ``spawn(start_method="forkserver")``
and ``jdist-run --start-method forkserver``.

A fresh interpreter spends seconds importing JAX, Flax and the program's modules
before it runs a line of the user's function; a job that spawns many short runs (a
test suite, a sweep, a restart after a lost rank) pays that per rank, per run. A fork
server pays it once: a server process (:func:`main`) imports the preload modules
(:func:`set_forkserver_preload` for ``spawn``, ``--forkserver-preload`` for
``jdist-run``) and then forks one child per rank on request. As with
``multiprocessing``'s forkserver, the children are real, separate processes; each gets
the rank's whole environment (``os.environ`` replaced before anything reads it), the
caller's working directory, its own session, ``/dev/null`` as stdin and the caller's
pipes as stdout and stderr, then runs :mod:`jdist.launch._spawn_child` (a spawn rank,
with the caller's ``sys.path``) or :mod:`jdist.launch._run_script` (a ``jdist-run``
worker, with the server's ``sys.path``, which is a fresh interpreter's) exactly as a
fresh interpreter does (``sys.exit(main(argv))``, so threads are joined and ``atexit``
runs).

What makes forking safe here: the server initializes no JAX backend (XLA reads
``XLA_FLAGS``, the rank's device count, when the child first touches a device; a
preloaded module that initializes one is refused by name), runs one thread, and
reseeds numpy's global generator in each child, as a new interpreter would have.

One server per interpreter, preload list and the variables read at import (JAX reads
its ``JAX_*`` variables at import time, so a server is only reused for ranks whose
values are the ones it imported under; for scripts ``PYTHONPATH`` too). Servers end
when the caller exits, and die with it if it is killed (their children die with them:
``PR_SET_PDEATHSIG`` and :func:`_lifeline.die_with_parent`).

Protocol, on a private ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair (no network, no
pickle): the caller sends ``{"argv", "env", "cwd", "path"}`` as JSON with the two pipe
ends attached (``SCM_RIGHTS``; ``path`` null: keep the server's); the server answers
``{"pid"}`` (or ``{"error"}``) and later ``{"exit": pid, "code": c}`` when that child
ends (``Popen.returncode``'s convention).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jdist.launch._env import worker_args, worker_command
from jdist.launch._lifeline import arm_parent_death_signal, exec_command
from jdist.launch._stop import signal_group

__all__ = ["set_forkserver_preload", "forkserver_process", "forkserver_script",
           "ForkedProcess", "DEFAULT_PRELOAD"]

DEFAULT_PRELOAD = ("jax", "jax.numpy", "numpy", "flax.nnx", "optax", "jdist.collectives")
_preload: tuple[str, ...] = DEFAULT_PRELOAD
_MAX_SERVERS = 4
_MSG_BYTES = 1 << 20
_START_TIMEOUT_S = 120.0
_REQUEST_TIMEOUT_S = 30.0
_IMPORT_ENV = ("JAX_", "XLA_", "TF_", "FLAX_", "NPY_", "OMP_", "OPENBLAS_", "MKL_", "PYTHON")
_SERVER_MAIN = "import sys; from jdist.launch._forkserver import main; sys.exit(main(sys.argv[1:]))"
_SCRIPT = "--script"  # first word of a jdist-run worker's request (else a spawn rank's)


def set_forkserver_preload(module_names: Sequence[str]) -> None:
    """The modules a fork server imports before it forks ranks (as
    ``multiprocessing.set_forkserver_preload``); servers started later use them."""
    names = tuple(module_names)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"set_forkserver_preload: module names must be non-empty "
                         f"strings, got {bad!r}")
    global _preload
    _preload = names


class ForkedProcess:
    """A rank forked by a server, with the parts of ``subprocess.Popen`` that
    :func:`jdist.launch.spawn` and :func:`jdist.launch._stop.stop_processes` use."""

    def __init__(self, server: _Server, pid: int, stdout, stderr):
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked rank pid {self.pid}", timeout)
            self._server.wait_for_exit(0.05)
        return self.returncode


class _Server:
    """The caller's side of one fork server."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...]):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = mine
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", _SERVER_MAIN, str(theirs.fileno()),
             str(os.getpid()), *preload],
            env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            start_new_session=True)
        theirs.close()
        self.preload = preload
        self._lock = threading.Lock()  # one request at a time
        self._cond = threading.Condition()
        self._replies: list[dict] = []
        self._exits: dict[int, int] = {}
        self._closed = False
        self.pid = self._ready()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="jdist-forkserver-reader")
        self._reader.start()

    def _ready(self) -> int:
        ready, _, _ = select.select([self.sock], [], [], _START_TIMEOUT_S)
        if not ready:
            self.close()
            raise RuntimeError(f"the fork server (pid {self.proc.pid}) did not finish "
                               f"importing {list(self.preload)} within "
                               f"{_START_TIMEOUT_S:g}s")
        msg = json.loads(self.sock.recv(_MSG_BYTES) or b'{"error": "it exited"}')
        if "error" in msg:
            self.close()
            raise RuntimeError(f"the fork server could not start: {msg['error']}")
        return int(msg["ready"])

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MSG_BYTES)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._closed = True
                    self._cond.notify_all()
                    return
                msg = json.loads(data)
                if "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self._replies.append(msg)
                self._cond.notify_all()

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def start(self, argv: list[str], env: dict[str, str],
              path: list[str] | None) -> ForkedProcess:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(),
                              "path": path}).encode()
        try:
            with self._lock:
                socket.send_fds(self.sock, [request], [out_w, err_w])
                reply = self._reply()
        finally:
            os.close(out_w)
            os.close(err_w)
        if "error" in reply:
            os.close(out_r)
            os.close(err_r)
            raise RuntimeError(f"the fork server could not start a rank: {reply['error']}")
        return ForkedProcess(self, int(reply["pid"]), os.fdopen(out_r, "rb"),
                             os.fdopen(err_r, "rb"))

    def _reply(self) -> dict:
        deadline = time.monotonic() + _REQUEST_TIMEOUT_S
        with self._cond:
            while not self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise RuntimeError(
                        f"the fork server (pid {self.pid}) "
                        f"{'exited' if self._closed else 'did not answer'} while starting "
                        f"a rank (waited {_REQUEST_TIMEOUT_S:g}s)")
                self._cond.wait(left)
            return self._replies.pop(0)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            code = self._exits.get(pid)
            if code is None and self._closed:
                return -signal.SIGKILL  # the server is gone and took its children
            return code

    def wait_for_exit(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait(seconds)

    def close(self) -> None:
        try:
            # shutdown first: a plain close leaves the socket open while the reader
            # thread is blocked in recv on it, and the server would see no EOF
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed, or the server is gone
            self.sock.close()  # the server sees EOF, kills its children and exits
        finally:
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


def _import_env(env: dict[str, str], with_path: bool) -> tuple:
    """The variables the preloaded modules may read as they import (JAX's and XLA's
    configuration, thread counts, Python's own); ``PYTHONPATH`` only ``with_path`` (a
    spawn rank takes the caller's ``sys.path``, a script the server's)."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_IMPORT_ENV) and (with_path or k != "PYTHONPATH")))


def _server_for(env: dict[str, str], preload: tuple[str, ...], with_path: bool) -> _Server:
    key = (sys.executable, preload, _import_env(env, with_path), with_path)
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and not server.alive():
            del _servers[key]
            server = None
        if server is None:
            while len(_servers) >= _MAX_SERVERS:  # the oldest goes
                _servers.pop(next(iter(_servers))).close()
            server = _servers[key] = _Server(env, preload)
        return server


def forkserver_process(argv: list[str], base_env: dict[str, str],
                       rank_env: dict[str, str]) -> ForkedProcess:
    """Start ``_spawn_child`` with ``argv`` (its payload and result paths) in a rank
    forked from the server for ``base_env``, with the caller's ``sys.path``; the rank
    dies with that server (the pid added to ``argv``), which dies with this process."""
    server = _server_for(base_env, _preload, with_path=False)
    return server.start([*argv, str(server.pid)], rank_env, list(sys.path))


def forkserver_script(args: Sequence[str], env: dict[str, str],
                      preload: Sequence[str]) -> ForkedProcess:
    """Start a ``jdist-run`` worker (``args``: ``"script"`` or ``"module"``, the target,
    its arguments; see :mod:`jdist.launch._run_script`) in a process forked from a
    server that imported ``preload`` under ``env``'s variables. The worker gets ``env``
    and the server's ``sys.path`` (a fresh interpreter's for that environment), and dies
    with the server, which dies with this process."""
    server = _server_for(env, tuple(preload), with_path=True)
    return server.start([_SCRIPT, str(server.pid), *args], env, None)


def worker_launch(launcher_pid: int, script: str, args: tuple[str, ...], module: bool,
                  no_python: bool, start_method: str, preload: Sequence[str]):
    """``(argv, start)`` for a worker of a launcher: the command line, and with
    ``start_method="forkserver"`` a ``start(argv, env)`` that forks it from a server
    (None: ``WorkerGroup`` starts ``argv`` itself)."""
    if no_python:
        return exec_command(launcher_pid, script, args), None
    argv = worker_command(launcher_pid, script, args, module)
    if start_method != "forkserver":
        return argv, None
    tail = worker_args(script, args, module)

    def start(_argv, env):
        return forkserver_script(tail, env, preload)

    return argv, start


@atexit.register
def _close_servers() -> None:
    with _servers_lock:
        while _servers:
            _servers.popitem()[1].close()


# ---- the server process -----------------------------------------------------------


def _preload_modules(names: Sequence[str]) -> None:
    for name in names:
        importlib.import_module(name)
    xb = sys.modules.get("jax._src.xla_bridge")
    if xb is not None and getattr(xb, "_backends", None):
        raise RuntimeError(
            f"preloading {list(names)} initialized a JAX backend, so forked ranks would "
            f"share it and ignore their device counts; preload only modules that create "
            f"no arrays at import (set_forkserver_preload)")


def _child(msg: dict, fds: list[int], sock: socket.socket, started: int) -> list[str]:
    """In a freshly forked child: become the rank, return ``_spawn_child``'s argv."""
    sock.close()
    os.setsid()
    os.write(started, b"s")  # in its own session now: the caller may signal the group
    os.close(started)
    out_fd, err_fd = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (devnull, out_fd, err_fd):
        os.close(fd)
    os.environ.clear()
    os.environ.update(msg["env"])
    os.chdir(msg["cwd"])
    if msg["path"] is not None:
        sys.path[:] = msg["path"]
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # a new interpreter's global generator is seeded afresh
    return list(msg["argv"])


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        sock.send(json.dumps({"exit": pid, "code": code}).encode())


def serve(sock: socket.socket, parent: int, preload: Sequence[str]) -> list[str] | None:
    """The server's loop. Returns ``_spawn_child``'s argv in a forked child, None when
    the server ends (its caller closed the socket or died)."""
    arm_parent_death_signal()
    try:
        _preload_modules(preload)
        # the preloaded modules' objects into the collector's permanent generation: a
        # child's collections then skip them, and leave their pages shared with the
        # server instead of copying them (CPython's advice for forking servers)
        gc.collect()
        gc.freeze()
    except BaseException as e:  # noqa: BLE001 - reported to the caller, then exit
        sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return None
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    server = os.getpid()
    children: set[int] = set()
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([sock], [], [], 0.05)
            _reap(sock, children)
            if not readable:
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MSG_BYTES, 2)
            if not data:
                return None  # the caller closed its end
            try:
                msg = json.loads(data)
                if len(fds) != 2:
                    raise ValueError(f"expected 2 pipe ends, got {len(fds)}")
                started, started_w = os.pipe()
                pid = os.fork()
            except Exception as e:  # noqa: BLE001 - the caller raises it
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                continue
            if pid == 0:
                os.close(started)
                return _child(msg, fds, sock, started_w)
            children.add(pid)
            os.close(started_w)
            os.read(started, 1)  # b"" too if the child died first
            os.close(started)
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"pid": pid}).encode())
        return None
    finally:
        if os.getpid() == server:  # not in a child returning from the loop
            for pid in children:  # each in its own session: its group is its pid
                signal_group(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    fd, parent, *preload = argv
    sock = socket.socket(fileno=int(fd))
    child_argv = serve(sock, int(parent), preload)
    if child_argv is None:
        return 0
    if child_argv[0] == _SCRIPT:
        from jdist.launch import _run_script

        _run_script.main(child_argv[1:])
        return 0
    from jdist.launch import _spawn_child

    return _spawn_child.main(child_argv)

