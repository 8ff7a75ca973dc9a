"""tests/launch test jdist-run's own default start, a fresh interpreter per worker (the
suite's conftest makes every other test's jdist-run fork its workers from a preloaded
server); ``start_method`` runs a test under both."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _launcher_default(monkeypatch):
    monkeypatch.delenv("JDIST_START_METHOD", raising=False)
    monkeypatch.delenv("JDIST_FORKSERVER_PRELOAD", raising=False)


@pytest.fixture(params=["spawn", "forkserver"])
def start_method(request, monkeypatch):
    """jdist-run's start method for the test's launches (their environment's
    JDIST_START_METHOD); the fork server preloads a light module only, as these
    scripts import nothing heavy."""
    monkeypatch.setenv("JDIST_START_METHOD", request.param)
    monkeypatch.setenv("JDIST_FORKSERVER_PRELOAD", "json")
    return request.param
