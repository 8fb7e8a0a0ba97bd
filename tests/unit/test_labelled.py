"""The fine-tuning examples' labelled data: classes 0..K-1, each present; rare classes reported."""

import pytest

from apps.labelled import class_count, read_labelled


def test_classes_are_counted_and_a_rare_one_is_reported(tmp_path):
    rows = [(0, "a")] * 5 + [(1, "b")] * 5 + [(2, "c")]
    classes, notes = class_count(tmp_path, rows)
    assert classes == 3
    assert notes == [f"{tmp_path}: class 2 appears only 1 time(s) in 11 lines"]


def test_a_class_missing_below_the_largest_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"1 of the classes 0..2 never appear \(1\) among the labels \[0, 2\]"):
        class_count(tmp_path, [(0, "a"), (2, "c")])


def test_a_stray_label_of_many_digits_is_refused_naming_a_few_missing_classes(tmp_path):
    # An id column taken for the label: every class up to it was listed, or a set of them built (MemoryError).
    with pytest.raises(ValueError) as refused:
        class_count(tmp_path, [(0, "a"), (1, "b"), (123456789012, "c")])
    assert str(refused.value) == (
        f"{tmp_path}: the labels must be the classes 0..K-1, each present; 123456789010 of the classes "
        "0..123456789012 never appear (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...) among the labels [0, 1, 123456789012] "
        "(a stray label would add classes)")


def test_a_byte_order_mark_is_not_read_as_part_of_the_first_label(tmp_path):
    data = tmp_path / "bom.txt"
    data.write_bytes("0\tpoor\n1\tfine\n".encode("utf-8-sig"))
    assert read_labelled(data) == [(0, "poor"), (1, "fine")]


@pytest.mark.parametrize(("content", "message"), [
    (None, "--data {path} is not a file"),
    (b"0\tpoor\n1\tfine \xff\n", "{path}:2: not UTF-8 text (byte 0xff)"),
], ids=["a-folder", "not-utf-8"])
def test_a_file_that_cannot_be_read_as_text_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "data"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        read_labelled(path)
    assert str(refused.value) == message.format(path=path)
