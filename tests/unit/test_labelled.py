"""The fine-tuning examples' labelled data: classes 0..K-1, each present; rare classes reported."""

import pytest

from apps.labelled import class_count


def test_classes_are_counted_and_a_rare_one_is_reported(tmp_path):
    rows = [(0, "a")] * 5 + [(1, "b")] * 5 + [(2, "c")]
    classes, notes = class_count(tmp_path, rows)
    assert classes == 3
    assert notes == [f"{tmp_path}: class 2 appears only 1 time(s) in 11 lines"]


def test_a_class_missing_below_the_largest_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"classes \[1\] never appear among \[0, 2\]"):
        class_count(tmp_path, [(0, "a"), (2, "c")])
