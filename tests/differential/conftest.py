"""Session pools of the differential tests, and the saving of failing cases."""

from __future__ import annotations

import json

import pytest

from tests.differential import HERE, last_failure, save_case, scaled
from tests.differential.pool import pools


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    pools.close_all()


def pytest_collection_modifyitems(config, items):
    """The suite's per-test timeout (300 s) grows with the profile's examples (the long
    campaign runs 50 times as many)."""
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(pytest.mark.timeout(scaled(300)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    name = getattr(getattr(item, "obj", None), "_differential_name", None)
    if name is None:
        inner = getattr(getattr(item, "obj", None), "hypothesis", None)
        name = getattr(getattr(inner, "inner_test", None), "_differential_name", None)
    if report.when == "call" and report.failed and name in last_failure:
        path = save_case(name, last_failure.pop(name))
        report.sections.append(("differential", f"failing case saved to {path}:\n"
                                                 f"{json.dumps(json.load(open(path)))}"))
    return report
