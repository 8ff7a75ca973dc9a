"""torch's ``TestBucketCapacityConfig*`` (distributed_test.py) for jdist's
:class:`jdist.ddp.BucketCapacityConfig`: the byte caps DDP derives from
``bucket_cap_mb`` and ``bucket_cap_mb_list``, with torch's inputs and expected values.
Pure functions: no devices involved. The DDP-level ``test_ddp_bucket_cap_mb_list`` is in
``test_dist_ddp_single.py``."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from jdist.ddp import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_BYTES,
    MB_TO_BYTES,
    BucketCapacityConfig,
)
from jdist.errors import BucketLayoutError

create = BucketCapacityConfig.create


def test_create_with_default_bucket_cap():
    config = create(bucket_cap_mb=None, bucket_cap_mb_list=None)
    assert config.bucket_bytes_cap == DEFAULT_BUCKET_CAP_MB * MB_TO_BYTES
    assert config.per_bucket_bytes_caps == ()
    assert config.first_bucket_bytes_cap == DEFAULT_FIRST_BUCKET_BYTES
    assert config.bucket_cap_mb == DEFAULT_BUCKET_CAP_MB


def test_create_with_custom_bucket_cap_mb():
    config = create(bucket_cap_mb=100, bucket_cap_mb_list=None)
    assert config.bucket_bytes_cap == 100 * MB_TO_BYTES
    assert config.per_bucket_bytes_caps == ()
    assert config.first_bucket_bytes_cap == 100 * MB_TO_BYTES
    assert config.bucket_cap_mb == 100


def test_create_with_bucket_cap_mb_list():
    cap_list = [10, 25, 50]
    config = create(bucket_cap_mb=None, bucket_cap_mb_list=cap_list)
    assert config.per_bucket_bytes_caps == tuple(c * MB_TO_BYTES for c in cap_list)
    assert config.bucket_bytes_cap == 50 * MB_TO_BYTES
    assert config.first_bucket_bytes_cap == 50 * MB_TO_BYTES
    assert config.has_custom_per_bucket_caps


def test_create_with_bucket_cap_mb_list_overrides_bucket_cap_mb():
    config = create(bucket_cap_mb=100, bucket_cap_mb_list=[10, 25, 50])
    assert config.bucket_bytes_cap == 50 * MB_TO_BYTES


def test_has_custom_per_bucket_caps_property():
    assert not create(bucket_cap_mb=25, bucket_cap_mb_list=None).has_custom_per_bucket_caps
    assert create(bucket_cap_mb=None, bucket_cap_mb_list=[10, 25]).has_custom_per_bucket_caps


def test_bucket_cap_mb_property():
    assert create(bucket_cap_mb=100).bucket_cap_mb == 100
    assert create().bucket_cap_mb == DEFAULT_BUCKET_CAP_MB


def test_immutability():
    config = create(bucket_cap_mb=25)
    with pytest.raises(AttributeError):
        config.bucket_bytes_cap = 100
    with pytest.raises(AttributeError):
        config.per_bucket_bytes_caps = (100,)
    assert isinstance(config, BucketCapacityConfig) and dataclasses.is_dataclass(config)


def test_compute_limits_with_custom_per_bucket_caps():
    cap_list = [10, 25, 50]
    limits, rebuild = create(bucket_cap_mb_list=cap_list).compute_bucket_size_limits(
        static_graph=False, find_unused_parameters=True)
    assert limits == [c * MB_TO_BYTES for c in cap_list]
    assert rebuild == [c * MB_TO_BYTES for c in cap_list]


def test_compute_limits_static_graph_uses_maxsize():
    limits, rebuild = create(bucket_cap_mb=25).compute_bucket_size_limits(
        static_graph=True, find_unused_parameters=False)
    assert limits == [sys.maxsize] and rebuild == []


def test_compute_limits_find_unused_false_uses_maxsize():
    limits, rebuild = create(bucket_cap_mb=25).compute_bucket_size_limits(
        static_graph=False, find_unused_parameters=False)
    assert limits == [sys.maxsize] and rebuild == []


def test_compute_limits_default_with_find_unused_true():
    limits, rebuild = create().compute_bucket_size_limits(
        static_graph=False, find_unused_parameters=True)
    assert limits == [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MB_TO_BYTES]
    assert rebuild == []


def test_compute_limits_custom_cap_with_find_unused_true():
    limits, rebuild = create(bucket_cap_mb=100).compute_bucket_size_limits(
        static_graph=False, find_unused_parameters=True)
    assert limits == [100 * MB_TO_BYTES] and rebuild == []


def test_compute_limits_empty_rebuild_for_non_list_config():
    _, rebuild = create(bucket_cap_mb=50).compute_bucket_size_limits(
        static_graph=False, find_unused_parameters=True)
    assert rebuild == []


def test_single_element_bucket_cap_mb_list():
    config = create(bucket_cap_mb_list=[50])
    assert config.per_bucket_bytes_caps == (50 * MB_TO_BYTES,)
    assert config.bucket_bytes_cap == 50 * MB_TO_BYTES
    assert config.has_custom_per_bucket_caps


def test_large_bucket_cap_mb():
    config = create(bucket_cap_mb=1000)
    assert config.bucket_bytes_cap == config.first_bucket_bytes_cap == 1000 * MB_TO_BYTES


def test_small_bucket_cap_mb():
    assert create(bucket_cap_mb=1).bucket_bytes_cap == 1 * MB_TO_BYTES


def test_empty_bucket_cap_mb_list():
    config = create(bucket_cap_mb_list=[])
    assert config.bucket_bytes_cap == DEFAULT_BUCKET_CAP_MB * MB_TO_BYTES
    assert config.per_bucket_bytes_caps == ()
    assert not config.has_custom_per_bucket_caps


def test_bucket_cap_mb_list_with_duplicates():
    config = create(bucket_cap_mb_list=[25, 25, 25])
    assert config.per_bucket_bytes_caps == (25 * MB_TO_BYTES,) * 3
    assert config.bucket_bytes_cap == 25 * MB_TO_BYTES


def test_bucket_cap_mb_list_ascending_order():
    assert create(bucket_cap_mb_list=[5, 10, 15, 20]).bucket_bytes_cap == 20 * MB_TO_BYTES


def test_bucket_cap_mb_list_descending_order():
    assert create(bucket_cap_mb_list=[100, 50, 25, 10]).bucket_bytes_cap == 100 * MB_TO_BYTES


def test_default_bucket_cap_mb_value():
    assert DEFAULT_BUCKET_CAP_MB == 25


def test_mb_to_bytes_value():
    assert MB_TO_BYTES == 1024 * 1024


def test_non_positive_caps_raise_naming_the_value():
    """jdist checks what torch passes on to its C++ reducer unchecked."""
    with pytest.raises(BucketLayoutError, match=r"bucket_cap_mb_list.*got -1"):
        create(bucket_cap_mb_list=[10, -1])
    with pytest.raises(BucketLayoutError, match=r"bucket_cap_mb must .*got 0"):
        create(bucket_cap_mb=0)
