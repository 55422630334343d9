"""HRM and TRM train as their reference code trains them: from the same weights, on the same
batches, with the references' optimizers (AdamATan2, sign-SGD on the puzzle embedding), podtrain's
losses over the first steps equal the losses the reference code gave, recorded in
tests/data/reference_tiny.json by

    python bench/reasoning_vs_reference.py --references DIR --tiny --record tests/data/reference_tiny.json

with clones of sapientinc/HRM and SamsungSAILMontreal/TinyRecursiveModels in DIR (their commits are
in the record). The first step's loss is the forward pass and the loss on equal weights; the second
shows the first update equal. From the third on, float rounding has grown into whole steps: a
gradient that is zero in exact arithmetic (q_continue's at the start, where its target equals its
prediction) is 1e-10 of either sign in float32, and Adam-like updates move such a weight by the full
rate either way; podtrain also leaves the Q head's bias out of weight decay. Hence the looser bound."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from podtrain.data import sudoku

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import reasoning_vs_reference as bench  # noqa: E402

RECORD = json.loads((Path(__file__).parent / "data" / "reference_tiny.json").read_text())


@pytest.fixture(scope="module")
def puzzles(tmp_path_factory):
    out = tmp_path_factory.mktemp("sudoku")
    sudoku.build(out, "generate", **bench.TINY_PUZZLES)
    return out


def test_the_record_is_of_this_comparison():
    assert RECORD["overrides"] == bench.TINY and RECORD["puzzles"] == bench.TINY_PUZZLES
    assert set(RECORD["losses"]) == set(bench.RECIPES)


@pytest.mark.parametrize("model", list(bench.RECIPES))
def test_first_steps_equal_the_reference(puzzles, model):
    *_, losses = bench.podtrain_tiny(model, puzzles)
    reference = RECORD["losses"][model]
    np.testing.assert_allclose(losses[0], reference[0], rtol=2e-6)
    np.testing.assert_allclose(losses[1], reference[1], rtol=2e-5)
    np.testing.assert_allclose(losses[2:], reference[2:], rtol=1e-2)
