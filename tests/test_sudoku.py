"""Sudoku data: unique generated puzzles, valid augmentations, the Sudoku-Extreme CSV format, the CLI."""

import csv
import os
import subprocess
import sys

import numpy as np
import pytest
from podtrain.cli import main
from podtrain.data import sudoku
from podtrain.errors import DataError


def is_sudoku(grid) -> bool:
    """Every row, column and box holds the digits 1 to 9 once (checked here, not by the module)."""
    g = np.asarray(grid)
    boxes = [g[r : r + 3, c : c + 3].ravel() for r in (0, 3, 6) for c in (0, 3, 6)]
    return all(sorted(unit.tolist()) == list(range(1, 10)) for unit in [*g, *g.T, *boxes])


@pytest.mark.parametrize("givens,n", [(45, 10), (26, 4), (17, 2)])
def test_generated_puzzles_have_exactly_one_solution(givens, n):
    """Each puzzle has one solution, the one returned, which keeps its clues; it has `givens` clues,
    or more only when it is minimal: blanking any one of its clues gives a second solution (17 clues
    is below what the generator reaches, so those puzzles stop above it, minimal)."""
    puzzles, solutions = sudoku.generate_set(n, seed=givens, givens=givens)
    assert puzzles.shape == solutions.shape == (n, 9, 9)
    for puzzle, solution in zip(puzzles, solutions):
        found = sudoku.solutions(puzzle, limit=2)
        assert len(found) == 1 and (found[0] == solution).all()
        assert is_sudoku(solution) and sudoku.is_valid_solution(puzzle, solution)
        clues = puzzle != 0
        assert (solution[clues] == puzzle[clues]).all() and puzzle.min() >= 0 and puzzle.max() <= 9
        count = int(clues.sum())
        assert count >= givens
        if count > givens:
            for r, c in zip(*np.nonzero(clues)):
                fewer = puzzle.copy()
                fewer[r, c] = 0
                assert len(sudoku.solutions(fewer, limit=2)) == 2, (count, r, c)
    counts = np.count_nonzero(puzzles, axis=(1, 2))
    if givens >= 26:
        np.testing.assert_array_equal(counts, givens)  # reachable targets are met exactly
    else:
        assert (counts > givens).all() and (counts < 30).all()
    again, _ = sudoku.generate_set(n, seed=givens, givens=givens)
    assert (again == puzzles).all()  # deterministic from the seed


def test_min_rating_selects_harder_puzzles():
    puzzles, _ = sudoku.generate_set(3, seed=1, givens=24, min_rating=5)
    assert all(sudoku.rating(p) >= 5 for p in puzzles)
    easy, _ = sudoku.generate_set(3, seed=1, givens=50)
    assert all(sudoku.rating(p) == 0 for p in easy)  # filled by singles alone


def test_invalid_grids_are_rejected():
    grid = np.zeros((9, 9), np.int8)
    grid[0, :2] = 5
    with pytest.raises(DataError, match="repeats the digit 5"):
        sudoku.solutions(grid)
    solution = sudoku.generate_set(1, seed=0, givens=40)[1][0]
    broken = solution.copy()
    broken[[0, 1], 0] = broken[[1, 0], 0]
    assert not sudoku.is_valid_solution(np.zeros((9, 9), np.int8), broken)


def test_augmentation_preserves_validity():
    puzzles, solutions = sudoku.generate_set(5, seed=3, givens=35)
    rng = np.random.default_rng(0)
    changed = 0
    for puzzle, solution in zip(puzzles, solutions):
        for _ in range(10):
            p, s = sudoku.augment(puzzle, solution, rng)
            assert sudoku.is_valid_solution(p, s)
            found = sudoku.solutions(p, limit=2)
            assert len(found) == 1 and (found[0] == s).all()
            assert np.count_nonzero(p) == np.count_nonzero(puzzle)
            changed += not (p == puzzle).all()
    assert changed == 50


def write_csv(path, puzzles, solutions, ratings):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "question", "answer", "rating"])
        for p, s, r in zip(puzzles, solutions, ratings):
            w.writerow(["gen", "".join(str(d) if d else "." for d in p.ravel()), "".join(map(str, s.ravel())), r])


def test_sudoku_extreme_csv(tmp_path):
    puzzles, solutions = sudoku.generate_set(6, seed=4, givens=30)
    write_csv(tmp_path / "train.csv", puzzles, solutions, [0, 1, 2, 3, 4, 5])
    p, s = sudoku.read_csv(tmp_path / "train.csv")
    assert (p == puzzles).all() and (s == solutions).all()
    p, s = sudoku.read_csv(tmp_path / "train.csv", n=2, min_rating=3)
    assert len(p) == 2 and all(any((q == r).all() for r in puzzles[3:]) for q in p)
    (tmp_path / "bad.csv").write_text("source,question,answer,rating\nx,123,456,0\n")
    with pytest.raises(DataError, match="bad.csv:2"):
        sudoku.read_csv(tmp_path / "bad.csv")


def test_data_command_builds_train_and_test(tmp_path):
    puzzles, solutions = sudoku.generate_set(8, seed=5, givens=32)
    write_csv(tmp_path / "train.csv", puzzles[:6], solutions[:6], [1] * 6)
    write_csv(tmp_path / "test.csv", puzzles[6:], solutions[6:], [1] * 2)
    assert (
        main(
            [
                "data",
                "sudoku",
                "--out",
                str(tmp_path / "csv"),
                "--source",
                "csv",
                "--csv",
                str(tmp_path),
                "--train",
                "4",
                "--augment",
                "2",
            ]
        )
        == 0
    )
    train, test = sudoku.load(tmp_path / "csv", "train"), sudoku.load(tmp_path / "csv", "test")
    assert train.inputs.shape == (12, 81) and test.inputs.shape == (2, 81)  # 4 puzzles x (1 + 2 augmentations)
    assert train.inputs.min() >= 1 and train.labels.min() >= 2 and train.labels.max() <= 10
    for x, y in zip(train.inputs, train.labels):
        assert sudoku.is_valid_solution((x.astype(int) - 1).reshape(9, 9), (y.astype(int) - 1).reshape(9, 9))

    assert (
        main(["data", "sudoku", "--out", str(tmp_path / "gen"), "--train", "3", "--test", "2", "--givens", "45"]) == 0
    )
    assert sudoku.load(tmp_path / "gen", "train").inputs.shape == (3, 81)


def test_hub_source_offline_is_a_clear_error(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, "-m", "podtrain", "data", "sudoku", "--out", str(tmp_path), "--source", "hub"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "sapientinc/sudoku-extreme" in done.stderr and "--source generate" in done.stderr, (
        done.stderr
    )
