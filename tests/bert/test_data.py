"""Corpus reading, example building and masking."""

from pathlib import Path

import pytest
import torch

from apps.bert import data
from apps.bert.config import parse_rank_values

SLICE = Path(__file__).parents[1] / "data" / "kjv-genesis.txt"


def test_rank_values_are_parsed_with_clear_errors():
    assert parse_rank_values("1=2.0", 3, "--simulate-slowdown", 1.0) == [1.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="'5=2' is not RANK=VALUE with a rank below 2"):
        parse_rank_values("5=2", 2, "--simulate-slowdown", 1.0)


def test_missing_and_empty_corpora_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.read_documents(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        data.read_documents(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="holds no text"):
        data.read_documents(empty)
    latin = tmp_path / "latin-1.txt"
    latin.write_bytes("Genèse\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin-1.txt is not UTF-8 text \(byte 0xe8 at offset 3\)"):
        data.read_documents(latin)


def test_examples_and_masks_are_well_formed_and_reproducible(tmp_path):
    documents = data.read_documents(SLICE)
    assert len(documents) == 50  # Genesis: one document per chapter
    tokens = data.train_wordpiece_vocab(SLICE, 2000, tmp_path).read_text().splitlines()
    examples = data.build_examples(documents, tokens, max_seq_len=64)
    assert len(examples) > 500
    assert max(map(len, examples.input_ids)) <= 64
    assert 0.3 < sum(examples.is_random_next) / len(examples) < 0.7
    ids = {t: i for i, t in enumerate(tokens)}
    special = {ids[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")}

    def batch(indices, epoch=0):
        return data.collate(examples, indices, len(tokens), special, ids["[MASK]"], ids["[PAD]"], seed=3, epoch=epoch)

    first = batch(list(range(64)))
    again = batch(list(range(63, -1, -1)))  # the same examples in another batch and order
    assert torch.equal(first["labels"], again["labels"].flip(0)[:, : first["labels"].shape[1]])
    assert not torch.equal(first["labels"], batch(list(range(64)), epoch=1)["labels"])
    labelled = first["labels"] != -100
    assert labelled.any(dim=1).all(), "every example predicts at least one token"
    ratio = labelled.sum() / first["attention_mask"].sum()
    assert 0.08 < ratio < 0.25
    assert not torch.isin(first["labels"][labelled], torch.tensor(sorted(special))).any()


def test_held_out_documents_and_cached_examples(tmp_path):
    documents = data.read_documents(SLICE)
    train, held = data.hold_out(documents, 0.02, seed=0)
    assert len(held) == 2 and len(train) + 2 == len(documents), "at least two documents held out"
    assert data.hold_out(documents, 0.02, seed=0) == (train, held), "drawn by the seed alone"
    assert all(doc not in train for doc in held)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "in", "the", "beginning", "god"]
    examples = data.build_examples(held, tokens, max_seq_len=32, seed=0)
    data.save_examples(tmp_path / "examples.pt", examples, None)
    loaded, none = data.load_examples(tmp_path / "examples.pt")
    assert loaded == examples and none is None
    with pytest.raises(ValueError, match="too few to hold 2 out"):
        data.hold_out(documents[:2], 0.1, seed=0)
