"""The keeper process: kills what a launcher started once that launcher is gone.

Run as a file (``python -I -S _keeper_main.py``: the standard library only, so it starts
in milliseconds and imports nothing of jdist). Its stdin is a pipe whose only writer is
the launcher; lines ``+PID`` (watch the worker PID, the leader of its own session) and
``-PID`` (the launcher stopped and reaped it: forget it) arrive on it.

End of file on stdin means the launcher exited, however it died (even by SIGKILL: the
kernel closes its end). The keeper then SIGKILLs every process of the watched workers'
sessions and process groups, and every process it saw descend from them (found by
scanning ``/proc`` every ``POLL_S`` seconds while workers are watched), matched by pid
*and* start time so that a reused pid is never hit. That covers what the kernel's
parent-death signal does not: a worker's own children (data-loader workers,
subprocesses), which would otherwise live on with PPID 1. A worker that was forgotten
(``-PID``) has had its group stopped by the launcher; the descendants it left outside
its group are killed then.

Without ``/proc`` (not Linux) only the process groups are signalled. The keeper ignores
SIGINT, SIGTERM and SIGHUP: it must outlive the launcher to do its job, and it exits as
soon as its job is done.
"""

import os
import select
import signal
import sys

POLL_S = 0.5


def _stat(pid):
    """``(ppid, pgid, sid, start time)`` of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _table():
    """``{pid: (ppid, pgid, sid, start)}`` of every process, or None without ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    out = {}
    for name in names:
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def _descendants(table, roots):
    """``{pid: start}`` of every process below ``roots`` (roots included)."""
    children = {}
    for pid, (ppid, _, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = table[pid][3]
            todo.extend(children.get(pid, ()))
    return out


def _kill(pid, start=None):
    if pid <= 1 or pid == os.getpid():
        return
    if start is not None:
        st = _stat(pid)
        if st is None or st[3] != start:
            return  # gone, or the pid now names another process
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _finish(roots, seen):
    """Kill the watched sessions and groups and everything seen below the roots."""
    table = _table()
    if table is None:
        for r in roots:
            try:
                os.killpg(r, signal.SIGKILL)
            except OSError:
                pass
        return
    seen.update(_descendants(table, roots))
    for pid, (_, pgid, sid, start) in table.items():
        if pgid in roots or sid in roots:
            _kill(pid, start)
    for pid, start in seen.items():
        _kill(pid, start)


def _forget(pid, roots, seen, below):
    """The launcher reaped ``pid`` and stopped its group: kill what it left elsewhere."""
    roots.discard(pid)
    for d, start in below.pop(pid, {}).items():
        seen.pop(d, None)
        _kill(d, start)


def _alive(table, found):
    return {p: s for p, s in found.items() if p in table and table[p][3] == s}


def _rescan(table, roots, seen, below):
    """Add what now descends from each root; drop what has ended."""
    for r in roots:
        mine = _alive(table, below.get(r, {}))
        mine.update(_descendants(table, [r]))
        below[r] = mine
    seen.clear()
    for mine in below.values():
        seen.update(mine)


def main():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    roots, seen, below, pending = set(), {}, {}, b""
    while True:
        ready, _, _ = select.select([0], [], [], POLL_S if roots else None)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line[:1] == b"+" and line[1:].isdigit():
                    roots.add(int(line[1:]))
                elif line[:1] == b"-" and line[1:].isdigit():
                    _forget(int(line[1:]), roots, seen, below)
        table = _table() if roots else None
        if table is not None:
            _rescan(table, roots, seen, below)
    _finish(roots, seen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
