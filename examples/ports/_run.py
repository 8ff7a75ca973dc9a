"""Run a ported program and its torch twin, each under its own launcher; read results.

``examples/ports/<name>.py`` runs under ``jdist-run`` and ``<name>_torch.py`` under
``torch.distributed.run`` (torchrun). Both take ``--out DIR`` and write each rank's
results to ``DIR/rank<r>.pkl`` (:func:`examples.ports._common.save`). Used by
``tests/examples/test_ports.py`` and ``benchmarks/ports.py``. Every launch runs in its
own session under a hard timeout; on a timeout the whole session is killed.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class PortRunError(RuntimeError):
    """A launch failed or timed out; the message holds its command and output tail."""


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


_GIVEN: set[int] = set()


def fresh_port() -> int:
    """A free port not handed out before by this process (a port is free again once its
    probe socket closes, so two quick calls of ``free_port`` can return the same one)."""
    from jdist.launch import free_port

    for _ in range(100):
        port = free_port()
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no fresh free port after 100 tries (given: {len(_GIVEN)})")


def command(lib: str, name: str, nproc: int, args: list[str], out: str,
            launcher_args: list[str] = (), spawn: bool = False) -> list[str]:
    """The launch command of ``lib`` ("jdist" or "torch") for program ``name``;
    ``spawn``: a plain ``python script`` that starts its own processes (the originals'
    ``mp.spawn``; ``jdist.launch.spawn`` in the ports)."""
    if lib not in ("jdist", "torch"):
        raise ValueError(f"lib must be 'jdist' or 'torch', got {lib!r}")
    if spawn:
        script = os.path.join(HERE, f"{name}.py" if lib == "jdist" else f"{name}_torch.py")
        return [sys.executable, script, *args, "--out", out]
    if lib == "jdist":
        script = os.path.join(HERE, f"{name}.py")
        launcher = ["-m", "jdist.launch", "--nproc-per-node", str(nproc), "--devices-per-proc", "1",
                    "--master-port", str(fresh_port())]
    else:
        script = os.path.join(HERE, f"{name}_torch.py")
        # the c10d rendezvous: torchrun's default static one could not restart (the
        # restarted gloo ranks met the first attempt's stale addresses)
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{fresh_port()}"]
    return [sys.executable, *launcher, *launcher_args, script, *args, "--out", out]


# torch 2.13's gloo teardown now and then aborts a rank at interpreter exit, after the
# program finished and wrote its results (std::terminate from a thread still joinable);
# a twin launch whose every rank wrote its results is accepted despite that exit code
_TORCH_EXIT_ABORT = "terminate called without an active exception"


class Launch:
    """One launch in its own session, output to a file, killed whole on timeout."""

    def __init__(self, cmd: list[str], out: str, env: dict | None = None, *,
                 nproc: int = 0, torch_exit_abort_ok: bool = False):
        self.cmd, self.out, self.nproc = cmd, out, nproc
        self.torch_exit_abort_ok = torch_exit_abort_ok
        os.makedirs(out, exist_ok=True)
        self.log_path = os.path.join(out, "log.txt")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, env=_env(env), start_new_session=True)

    def log_tail(self, n: int = 6000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGTERM to the launch's session, SIGKILL after a grace period. torchrun starts
        its workers in sessions of their own and ends them when it gets SIGTERM; a
        SIGKILL alone would leave them running."""
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue

    def wait(self, deadline: float) -> dict:
        """Each rank's results ``{rank: obj}``; raises :class:`PortRunError` on failure."""
        try:
            rc = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise PortRunError(f"timed out, killed: {' '.join(self.cmd)}\n"
                               f"{self.log_tail()}") from None
        finally:
            self._log.close()
        names = sorted(f for f in os.listdir(self.out)
                       if f.startswith("rank") and f.endswith(".pkl"))
        log = self.log_tail(20000)
        if rc != 0 and not (self.torch_exit_abort_ok and len(names) == self.nproc
                            and _TORCH_EXIT_ABORT in log):
            raise PortRunError(f"exit code {rc}: {' '.join(self.cmd)}\n{log[-6000:]}")
        results = {}
        for f in names:
            with open(os.path.join(self.out, f), "rb") as fh:
                results[int(f[4:-4])] = pickle.load(fh)
        results["log"] = log
        return results


def _without_restarts(args) -> list:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--max-restarts":
            skip = True
        elif not a.startswith("--max-restarts="):
            out.append(a)
    return out


def run_both(name: str, nproc: int, args, *, timeout: float, launcher_args=(),
             concurrent: bool = True, tmp: str | None = None,
             relaunch_torch: bool = False, spawn: bool = False,
             order: tuple = ("torch", "jdist")) -> tuple[dict, dict]:
    """Run ``name`` with jdist and its torch twin (at the same time if ``concurrent``).

    ``args``: the program's arguments, or ``args(lib, out_dir) -> list`` to give each its
    own (paths). ``launcher_args`` go to both launchers (``--max-restarts 1``);
    ``spawn``: no launcher, the scripts start their processes themselves. ``order``:
    which starts first (with ``concurrent=False``, which runs first).
    ``relaunch_torch``: torchrun gets no ``--max-restarts``, and when its launch fails it
    is started once more, which is what a restart does (torchrun 2.13's own restart
    could not re-form its gloo group on CPU: the restarted ranks' gloo
    ``connectFullMesh`` was refused, or they waited until the test's timeout). Returns
    ``(jdist_results, torch_results)``, each ``{rank: obj, "log": text}``.
    """
    tmp = tmp or tempfile.mkdtemp(prefix=f"port_{name}_")
    deadline = time.monotonic() + timeout
    launches, results = {}, {}

    def start(lib):
        out = os.path.join(tmp, lib)
        a = args(lib, out) if callable(args) else args
        la = launcher_args
        if lib == "torch" and relaunch_torch:
            la = _without_restarts(launcher_args)
        launches[lib] = Launch(command(lib, name, nproc, a, out, la, spawn), out,
                               nproc=nproc, torch_exit_abort_ok=lib == "torch")

    def finish(lib):
        try:
            return launches[lib].wait(deadline)
        except PortRunError:
            if lib != "torch" or not relaunch_torch:
                raise
        first_log = launches[lib].log_tail(20000)
        start(lib)
        res = launches[lib].wait(deadline)
        res["first_log"] = first_log
        return res

    try:
        for lib in order:
            start(lib)
            if not concurrent:
                results[lib] = finish(lib)
        for lib in launches:
            if lib not in results:
                results[lib] = finish(lib)
    finally:
        for la in launches.values():
            la.kill()
    return results["jdist"], results["torch"]


def run_one(lib: str, name: str, nproc: int, args: list[str], *, timeout: float,
            launcher_args=(), spawn: bool = False, tmp: str | None = None) -> dict:
    """Run one side only (``lib`` "jdist" or "torch"); ``{rank: obj, "log": text}``."""
    tmp = tmp or tempfile.mkdtemp(prefix=f"port_{name}_{lib}_")
    launch = Launch(command(lib, name, nproc, args, tmp, launcher_args, spawn), tmp)
    try:
        return launch.wait(time.monotonic() + timeout)
    finally:
        launch.kill()
