"""The program each :func:`jdist.launch.spawn` child runs (``python -m`` this module).

1. Die with the parent: ``PR_SET_PDEATHSIG`` (Linux), plus a thread that polls the
   parent's pid and kills this process group when the parent is gone (other systems,
   and the processes this child started, which the kernel signal does not reach).
2. Take the parent's ``sys.argv``; when the function (or an argument) lives in the
   parent's ``__main__`` script, run that script as ``__mp_main__`` first (its
   ``if __name__ == "__main__":`` block does not run) and alias it as ``__main__``,
   so that pickle finds the function, as ``torch.multiprocessing.spawn`` does.
3. Size XLA's CPU client as ``JDIST_XLA_CPU_THREADS`` says (:mod:`jdist._xla_threads`).
4. Load ``(fn, args)``, run it, write the pickled result next to the payload.
"""

from __future__ import annotations

import os
import pickle
import sys
import types

from jdist._xla_threads import limit_from_env
from jdist.launch._lifeline import die_with_parent


def _load_main(kind: str, target: str) -> None:
    import runpy

    if kind == "path":
        directory = os.path.dirname(os.path.abspath(target))
        if directory not in sys.path:
            sys.path.insert(0, directory)
        namespace = runpy.run_path(target, run_name="__mp_main__")
    else:
        namespace = runpy.run_module(target, run_name="__mp_main__", alter_sys=False)
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def main(argv: list[str]) -> int:
    payload, result_path, parent = argv
    die_with_parent(int(parent))
    limit_from_env()
    with open(payload, "rb") as f:
        header = pickle.load(f)
        sys.argv = list(header["argv"])
        if header["main"] is not None:
            _load_main(*header["main"])
        fn, args = pickle.load(f)
    result = fn(*args)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
