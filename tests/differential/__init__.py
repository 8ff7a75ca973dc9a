"""Differential tests: generated cases run in torch (the oracle) and in jdist, compared.

Shared machinery (``tests/differential/README.md`` has the file | job table):

- ``scaled(n)``: the number of examples a test runs: ``n`` under the default "ci"
  profile (fixed seed, on every submission), 50x under ``--hypothesis-profile=long``.
- ``@replayed("name")``: wraps a hypothesis test whose first argument is a JSON-able
  case dict (applied under ``@given``; pytest fixtures may follow). Every case saved
  under ``regressions/<name>/`` runs first, as an explicit example; a generated case
  that fails is saved there (the last failing case hypothesis runs is its shrunk one;
  ``conftest.py`` writes it when the test fails), so a finding is replayed on every
  later run.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os

from hypothesis import example, settings

HERE = os.path.dirname(os.path.abspath(__file__))
REGRESSIONS = os.path.join(HERE, "regressions")
_DEFAULT_EXAMPLES = 100  # hypothesis' default max_examples; "long" raises it

last_failure: dict[str, dict] = {}  # test name -> the last case that failed


def scaled(n: int) -> int:
    """``n`` examples under the default profile, proportionally more under "long"."""
    return max(1, n * settings.default.max_examples // _DEFAULT_EXAMPLES)


def saved_cases(name: str) -> list[dict]:
    folder = os.path.join(REGRESSIONS, name)
    if not os.path.isdir(folder):
        return []
    out = []
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".json"):
            with open(os.path.join(folder, fname)) as f:
                out.append(json.load(f))
    return out


def save_case(name: str, case: dict) -> str:
    """Write ``case`` to ``regressions/<name>/<digest>.json``; returns the path."""
    text = json.dumps(case, sort_keys=True, indent=1)
    folder = os.path.join(REGRESSIONS, name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, hashlib.sha256(text.encode()).hexdigest()[:12] + ".json")
    with open(path, "w") as f:
        f.write(text + "\n")
    return path


def replayed(name: str):
    """Replay ``regressions/<name>/`` first and record failing cases (see module doc)."""

    def wrap(test):
        arg = next(iter(inspect.signature(test).parameters))  # the case; then fixtures

        @functools.wraps(test)
        def run(**kwargs):
            try:
                test(**kwargs)
            except BaseException:
                last_failure[name] = kwargs[arg]
                raise
            last_failure.pop(name, None)

        run._differential_name = name
        for case in saved_cases(name):
            run = example(**{arg: case})(run)
        return run

    return wrap
