"""What WeightedDDP.backward takes as a rank's weight (each checked on its own rank before any collective)."""

import numpy as np
import pytest
import torch

from hsync.stats import BadInput, as_weight

CPU = torch.device("cpu")


@pytest.mark.parametrize("weight", [3, 3.0, np.int64(3), np.float32(3), np.array(3), np.array([3.0]), torch.tensor(3),
                                    torch.tensor([[3.0]])],
                         ids=["int", "float", "np.int64", "np.float32", "np-0d", "np-one-element", "tensor",
                              "tensor-one-element"])
def test_a_number_in_any_of_its_usual_forms_is_taken(weight):
    value, bad, problem = as_weight(weight, CPU)
    assert (value.dtype, value.shape, float(value), bad, problem) == (torch.float64, (), 3.0, None, None)


@pytest.mark.parametrize(("weight", "bad", "problem"), [
    ("3", BadInput.WEIGHT_NOT_A_NUMBER, "weight must be a real number, got str '3'"),
    (True, BadInput.WEIGHT_NOT_A_NUMBER, "weight must be a real number, got bool True"),
    (np.array([1, 2]), BadInput.WEIGHT_NOT_A_NUMBER, "weight must be a real number, got ndarray"),
    (np.array(1 + 2j), BadInput.WEIGHT_NOT_A_NUMBER, "weight must be a real number, got complex"),
    (torch.ones(2), BadInput.WEIGHT_NOT_A_NUMBER, "weight must be a real scalar"),
    (-1, BadInput.WEIGHT_OUT_OF_RANGE, "weight must be finite, non-negative and at most 2**53, got -1.0"),
    (np.array(float("nan")), BadInput.WEIGHT_OUT_OF_RANGE, "got nan"),
], ids=["str", "bool", "np-two-elements", "np-complex", "tensor-two-elements", "negative", "np-nan"])
def test_anything_else_is_refused_saying_why(weight, bad, problem):
    value, seen, said = as_weight(weight, CPU)
    assert seen is bad and problem in said and float(value) == 0.0, said
