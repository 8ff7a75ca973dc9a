"""jdist.dp exports the names DESIGN.md fixes, with torch's signatures."""

import inspect

import jdist
import jdist.dp


def test_dp_names_and_signatures():
    for name in ["DataParallel", "scatter", "scatter_kwargs", "replicate", "parallel_apply",
                 "gather", "data_parallel"]:
        assert name in jdist.dp.__all__ and hasattr(jdist.dp, name), name
    assert jdist.dp is jdist.dp  # lazy subpackage import through jdist works
    sig = inspect.signature(jdist.dp.DataParallel.__init__)
    assert list(sig.parameters)[1:] == ["module", "device_ids", "output_device", "dim"]
    assert sig.parameters["dim"].default == 0
    sig = inspect.signature(jdist.dp.data_parallel)
    assert list(sig.parameters) == ["module", "inputs", "device_ids", "output_device", "dim",
                                    "module_kwargs"]
    assert list(inspect.signature(jdist.dp.gather).parameters) == [
        "outputs", "target_device", "dim"]
