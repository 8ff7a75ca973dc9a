"""examples/train_pipeline.py runs (smoke mode) under every schedule and learns."""

import importlib.util
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_pipeline.py"


@pytest.mark.parametrize("args", [["--schedule", "1F1B"],
                                  ["--schedule", "InterleavedZeroBubble", "--pp-size", "2"]])
def test_example_smoke_runs_and_reports_progress(capsys, args):
    spec = importlib.util.spec_from_file_location("pipeline_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--smoke", *args])
    captured = capsys.readouterr()
    assert f"{args[1]}: 4 stages on 4 device(s)" in captured.out
    assert "micro-batches" in captured.err  # the progress bar
    h = res["history"]
    assert len(h) == 5 and h[-1] < h[0]
