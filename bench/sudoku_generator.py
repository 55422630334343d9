"""Puzzles per second of the Sudoku generator at each difficulty, relative to the easiest.

    python bench/sudoku_generator.py [--n 40]

Difficulty is the number of givens (fewer is harder) and, for the hardest level, a minimum
solver rating (backtracks). Also prints the mean givens and rating of what came out.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from podtrain.data import sudoku

LEVELS = [("easy", 45, 0), ("medium", 35, 0), ("hard", 28, 0), ("harder", 24, 0), ("rated >= 20", 24, 20)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=40)
    n = p.parse_args().n
    base = None
    print(
        f"{'level':<13}{'givens':>7}{'min rating':>11}{'puzzles/s':>11}{'vs easy':>9}"
        f"{'mean givens':>13}{'mean rating':>13}"
    )
    for name, givens, min_rating in LEVELS:
        clock = time.perf_counter()
        puzzles, _ = sudoku.generate_set(n, seed=0, givens=givens, min_rating=min_rating)
        rate = n / (time.perf_counter() - clock)
        base = base or rate
        ratings = [sudoku.rating(x) for x in puzzles]
        mean_givens = np.count_nonzero(puzzles.reshape(n, -1), axis=1).mean()
        print(
            f"{name:<13}{givens:>7}{min_rating:>11}{rate:>11.1f}{rate / base:>9.3f}"
            f"{mean_givens:>13.1f}{np.mean(ratings):>13.1f}"
        )


if __name__ == "__main__":
    main()
