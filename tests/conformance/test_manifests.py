"""The conformance manifests are true: every listed jdist test exists, every in-scope
torch test (read from the installed torch's source) is listed, and the docs sections are
the current rendering (regenerate with ``python -m tests.conformance.report --write``)."""

from __future__ import annotations

import textwrap

import pytest

from tests.conformance import report


def test_manifests_match_code_and_torch():
    manifests = report.load()
    assert report.check(manifests) == []


@pytest.mark.parametrize("kind", ["table", "departures"])
def test_docs_sections_are_current(kind):
    manifests = report.load()
    body = (report.render_table if kind == "table" else report.render_departures)(manifests)
    assert report.current_section(kind) == report.section(kind, body), (
        "run: python -m tests.conformance.report --write")


def _write(tmp_path, text):
    (tmp_path / "m.toml").write_text(textwrap.dedent(text))
    return report.load(tmp_path)


def test_checker_finds_missing_and_unknown_tests(tmp_path):
    ms = _write(tmp_path, """
        torch_file = "torch/testing/_internal/distributed/rpc/dist_optimizer_test.py"
        wheel_module = "torch.testing._internal.distributed.rpc.dist_optimizer_test"
        [tests]
        "DistOptimizerTest.test_no_such_test" = { departure = "x" }
        "DistOptimizerTest.test_dist_optim" = "tests/conformance/report.py::nothing_here"
        """)
    errors = "\n".join(report.check(ms))
    assert "test_no_such_test is not a test" in errors
    assert "'nothing_here' is not defined" in errors
    assert "in scope but not listed" in errors and "test_dist_optim_exception" in errors


def test_checker_rejects_bad_values_and_overlaps(tmp_path):
    ms = _write(tmp_path, """
        torch_file = "x.py"
        [tests]
        "T.test_a" = { departure = "" }
        "T.test_b" = "no-separator"
        "not a test" = "tests/conformance/report.py::check"
        """)
    errors = "\n".join(report.check(ms))
    assert "a departure is" in errors and "path::function" in errors
    assert "key must be" in errors
    m2 = report.Manifest(tmp_path / "n.toml", "x.py", {"T.test_b": {"departure": "y"}})
    assert any("listed in both" in e for e in report.check(ms + [m2]))


def test_departures_grouped_by_reason(tmp_path):
    ms = _write(tmp_path, """
        torch_file = "x.py"
        [tests]
        "T.test_b" = { departure = "needs CUDA" }
        "T.test_a" = { departure = "needs CUDA" }
        "T.test_c" = "tests/conformance/report.py::check"
        """)
    assert report.render_departures(ms) == "**`x.py`**\n\n- `T.test_a`, `T.test_b`: needs CUDA"
    assert "| `x.py` | 3 | 1 | 1 | 2 |" in report.render_table(ms)


def test_departure_may_name_its_test(tmp_path):
    ms = _write(tmp_path, """
        torch_file = "x.py"
        [tests]
        "T.test_a" = { departure = "raises", test = "tests/conformance/report.py::check" }
        "T.test_b" = { departure = "raises", test = "tests/conformance/report.py::gone" }
        """)
    want = ["m.toml: T.test_b: 'gone' is not defined in tests/conformance/report.py"]
    assert report.check(ms) == want
    assert "(checked by `tests/conformance/report.py::check`)" in report.render_departures(ms)
