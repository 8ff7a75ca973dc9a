"""examples/data_parallel.py runs (smoke mode) and learns."""

import importlib.util
import pathlib

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "data_parallel.py"


def test_example_smoke_runs_and_reports_progress(capsys):
    spec = importlib.util.spec_from_file_location("dp_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--smoke"])
    out = capsys.readouterr().out
    assert "DataParallel over 8 devices" in out and "epoch 1/1" in out
    (h,) = res["history"]
    assert res["devices"] == 8
    assert 0.0 < h["loss"] < 2.4 and h["test_acc"] > 0.15  # better than chance after 3 steps


def test_example_fused_step_trains_the_same(capsys):
    spec = importlib.util.spec_from_file_location("dp_example_fused", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    eager = mod.main(["--smoke"])["history"][0]
    fused = mod.main(["--smoke", "--fused"])["history"][0]
    assert abs(eager["loss"] - fused["loss"]) < 1e-4
    assert abs(eager["test_acc"] - fused["test_acc"]) < 0.02
