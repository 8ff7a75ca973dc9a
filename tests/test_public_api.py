"""The public names that DESIGN.md fixes exist where it says."""

import jdist


def test_top_level_names():
    for name in ["ReduceOp", "ProcessGroup", "NON_GROUP_MEMBER", "errors", "__version__"]:
        assert hasattr(jdist, name), name


def test_reduce_ops():
    assert [op.name for op in jdist.ReduceOp] == [
        "SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def test_subpackages_load_lazily():
    assert jdist.launch.spawn is not None
