"""Sudoku for the recursive reasoning models: a generator, the Sudoku-Extreme CSVs, augmentation.

Grids are (9, 9) int arrays with 0 for a blank. As tokens (the HRM/TRM encoding): PAD 0, blank 1,
digit d -> d + 1, so the vocabulary is 11 and a puzzle is 81 tokens, row-major.

The generator fills a random solved grid, then blanks cells in random order as long as the puzzle
keeps exactly one solution, down to `givens` clues (a puzzle may stop above that when no further
cell can go). Its difficulty is rated like Sudoku-Extreme's: the number of dead ends a
depth-first solver with the fewest-candidates rule meets, so hard puzzles can be selected with
`min_rating`. Everything is deterministic given the seed.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from podtrain import storage
from podtrain.errors import DataError

VOCAB = 11  # PAD, blank, 1..9
HUB_REPO = "sapientinc/sudoku-extreme"
ALL = 0x3FE  # bits 1..9
BOX = [(r // 3) * 3 + c // 3 for r in range(9) for c in range(9)]


class _Search:
    """Depth-first search over 81 cells with bitmask candidates, fewest candidates first."""

    def __init__(self, grid: np.ndarray, rng: np.random.Generator | None = None):
        self.cells = [int(v) for v in np.asarray(grid).ravel()]
        self.rows, self.cols, self.boxes = [0] * 9, [0] * 9, [0] * 9
        self.rng, self.dead_ends, self.solutions = rng, 0, []
        for i, v in enumerate(self.cells):
            if v:
                bit = 1 << v
                if (self.rows[i // 9] | self.cols[i % 9] | self.boxes[BOX[i]]) & bit:
                    raise DataError(
                        f"Sudoku grid repeats the digit {v} in the row, column or box "
                        f"of cell {i}; the puzzle is invalid."
                    )
                self.rows[i // 9] |= bit
                self.cols[i % 9] |= bit
                self.boxes[BOX[i]] |= bit

    def run(self, limit: int) -> _Search:
        self._search(limit)
        return self

    def _search(self, limit: int) -> None:
        best, best_mask, best_count = -1, 0, 10
        for i, v in enumerate(self.cells):
            if v == 0:
                mask = ALL & ~(self.rows[i // 9] | self.cols[i % 9] | self.boxes[BOX[i]])
                count = bin(mask).count("1")
                if count < best_count:
                    best, best_mask, best_count = i, mask, count
                    if count <= 1:
                        break
        if best < 0:
            self.solutions.append(np.array(self.cells, np.int8).reshape(9, 9))
            return
        if best_count == 0:
            self.dead_ends += 1
            return
        digits = [d for d in range(1, 10) if best_mask >> d & 1]
        if self.rng is not None:
            self.rng.shuffle(digits)
        r, c, b = best // 9, best % 9, BOX[best]
        for d in digits:
            bit = 1 << d
            self.cells[best] = d
            self.rows[r] |= bit
            self.cols[c] |= bit
            self.boxes[b] |= bit
            self._search(limit)
            self.cells[best] = 0
            self.rows[r] ^= bit
            self.cols[c] ^= bit
            self.boxes[b] ^= bit
            if len(self.solutions) >= limit:
                return


def solutions(grid: np.ndarray, limit: int = 2) -> list[np.ndarray]:
    """Up to `limit` solutions of a puzzle (a unique puzzle has exactly one)."""
    return _Search(grid).run(limit).solutions


def rating(grid: np.ndarray) -> int:
    """Dead ends the solver meets before it finds the solution: 0 for puzzles solved by singles."""
    return _Search(grid).run(1).dead_ends


def is_valid_solution(puzzle: np.ndarray, solution: np.ndarray) -> bool:
    """A full grid with each digit once per row, column and box, agreeing with the puzzle's clues."""
    s = np.asarray(solution)
    units = [s, s.T, s.reshape(3, 3, 3, 3).transpose(0, 2, 1, 3).reshape(9, 9)]
    full = all((np.sort(u, axis=1) == np.arange(1, 10)).all() for u in units)
    clues = np.asarray(puzzle) != 0
    return bool(full and (s[clues] == np.asarray(puzzle)[clues]).all())


def generate(rng: np.random.Generator, givens: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """One puzzle with a unique solution and about `givens` clues, and its solution."""
    solution = _Search(np.zeros((9, 9), np.int8), rng).run(1).solutions[0]
    puzzle = solution.copy().ravel()
    for cell in rng.permutation(81):
        if np.count_nonzero(puzzle) <= givens:
            break
        digit, puzzle[cell] = puzzle[cell], 0
        if len(solutions(puzzle.reshape(9, 9))) != 1:
            puzzle[cell] = digit
    return puzzle.reshape(9, 9), solution


def generate_set(n: int, seed: int, givens: int = 30, min_rating: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n puzzles rated at least min_rating: (puzzles, solutions), each (n, 9, 9) int8."""
    rng = np.random.default_rng(seed)
    puzzles, sols = [], []
    while len(puzzles) < n:
        puzzle, solution = generate(rng, givens)
        if rating(puzzle) >= min_rating:
            puzzles.append(puzzle)
            sols.append(solution)
    return np.stack(puzzles).astype(np.int8), np.stack(sols).astype(np.int8)


def augment(puzzle: np.ndarray, solution: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The same random validity-preserving transform of both grids, as the references do it:
    relabel the digits, transpose with probability 1/2, permute the bands and the rows within each
    band, the stacks and the columns within each stack."""
    digits = np.concatenate([[0], rng.permutation(9) + 1])
    transpose = rng.random() < 0.5
    rows = np.concatenate([3 * band + rng.permutation(3) for band in rng.permutation(3)])
    cols = np.concatenate([3 * stack + rng.permutation(3) for stack in rng.permutation(3)])

    def transform(grid):
        grid = grid.T if transpose else grid
        return digits[grid[rows][:, cols]].astype(np.int8)

    return transform(np.asarray(puzzle)), transform(np.asarray(solution))


def read_csv(
    path: str | Path, n: int | None = None, min_rating: int = 0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Puzzles and solutions from a Sudoku-Extreme CSV: a header, then source, question (81 chars,
    '.' for a blank), answer (81 digits), rating. With n, a random sample of n of the puzzles
    rated >= min_rating, chosen in a first pass so that the file's millions of rows stay on disk."""

    def rows():
        with storage.path(path).open("rb") as f:  # local or in a bucket, streamed
            reader = csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline=""))
            next(reader, None)
            for line, row in enumerate(reader, start=2):
                if len(row) != 4 or len(row[1]) != 81 or len(row[2]) != 81 or not row[3].isdigit():
                    raise DataError(
                        f"{path}:{line} is not `source,question,answer,rating` with 81-character "
                        "grids; is it a Sudoku-Extreme CSV?"
                    )
                yield row

    eligible = np.array([i for i, row in enumerate(rows()) if int(row[3]) >= min_rating], dtype=np.int64)
    if not len(eligible):
        raise DataError(f"{path} has no puzzles rated >= {min_rating}.")
    keep = set(
        (
            np.random.default_rng(seed).choice(eligible, n, replace=False) if n and n < len(eligible) else eligible
        ).tolist()
    )
    chosen = [row for i, row in enumerate(rows()) if i in keep]
    puzzles = np.array([[0 if ch in ".0" else int(ch) for ch in row[1]] for row in chosen], np.int8)
    sols = np.array([[int(ch) for ch in row[2]] for row in chosen], np.int8)
    return puzzles.reshape(-1, 9, 9), sols.reshape(-1, 9, 9)


def download_csv(split: str) -> Path:
    """The Sudoku-Extreme `train` or `test` CSV from the Hugging Face hub (cached locally)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(HUB_REPO, f"{split}.csv", repo_type="dataset"))
    except Exception as e:  # network, authentication or a missing file: all mean "no data here"
        raise DataError(
            f"Could not download {split}.csv of {HUB_REPO} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}). Without network, build puzzles locally with "
            "`podtrain data sudoku --source generate`, or pass a local CSV with --csv."
        ) from None


def tokens(grids: np.ndarray) -> np.ndarray:
    """(n, 9, 9) grids -> (n, 81) uint8 tokens: blank 1, digit d -> d + 1."""
    return (np.asarray(grids).reshape(len(grids), 81) + 1).astype(np.uint8)


@dataclass
class SudokuSet:
    inputs: np.ndarray  # (n, 81) tokens of the puzzles
    labels: np.ndarray  # (n, 81) tokens of the solutions

    def rows(self) -> np.ndarray:
        """(n, 163) int32 examples: puzzle id (0: Sudoku shares one puzzle embedding), inputs, labels."""
        return np.concatenate([np.zeros((len(self.inputs), 1), np.int32), self.inputs, self.labels], axis=1).astype(
            np.int32
        )

    def copy_baseline(self) -> float:
        """Cell accuracy of copying the puzzle: the givens are right, every blank is wrong."""
        return float(np.mean(self.inputs == self.labels))


def augmented(puzzles: np.ndarray, sols: np.ndarray, copies: int, seed: int) -> SudokuSet:
    """Each puzzle as given plus `copies` random transforms of it."""
    rng = np.random.default_rng(seed)
    out_p, out_s = [puzzles], [sols]
    for _ in range(copies):
        pairs = [augment(p, s, rng) for p, s in zip(puzzles, sols)]
        out_p.append(np.stack([p for p, _ in pairs]))
        out_s.append(np.stack([s for _, s in pairs]))
    return SudokuSet(tokens(np.concatenate(out_p)), tokens(np.concatenate(out_s)))


def save(directory: str | Path, train: SudokuSet, test: SudokuSet, meta: dict) -> dict:
    """Write the two splits and meta.json; returns the metadata written."""
    storage.makedirs(directory)
    for name, split in (("train", train), ("test", test)):
        buffer = io.BytesIO()
        np.savez_compressed(buffer, inputs=split.inputs, labels=split.labels)
        storage.write_bytes(storage.join(directory, f"{name}.npz"), buffer.getvalue())
    meta = {**meta, "train": len(train.inputs), "test": len(test.inputs), "vocab_size": VOCAB, "seq_len": 81}
    storage.write_text(storage.join(directory, "meta.json"), json.dumps(meta, indent=1))
    return meta


def load(directory: str | Path, split: str) -> SudokuSet:
    path = storage.path(directory) / f"{split}.npz"
    if not path.is_file():
        raise DataError(
            f"{path} does not exist; build the Sudoku data first: `podtrain data sudoku --out {directory}`."
        )
    with np.load(io.BytesIO(path.read_bytes())) as data:
        return SudokuSet(data["inputs"], data["labels"])


def build(
    out: str | Path,
    source: str,
    n_train: int,
    n_test: int,
    givens: int,
    min_rating: int,
    copies: int,
    seed: int,
    csv_dir: str | None = None,
) -> dict:
    """Write OUT/train.npz (with `copies` augmentations of each puzzle), OUT/test.npz (not
    augmented) and OUT/meta.json. source: generate (offline), hub (Sudoku-Extreme) or csv (csv_dir
    holding train.csv and test.csv in the hub's format)."""
    if source == "generate":
        if not 17 <= givens <= 80:
            raise DataError(
                f"--givens={givens}: a Sudoku with a unique solution has 17 to 80 clues; pick a number in "
                "that range (40+ is easy, 25 is hard)."
            )
        train = generate_set(n_train, seed, givens, min_rating)
        test = generate_set(n_test, seed + 1, givens, min_rating)
    else:
        if source == "csv" and not csv_dir:
            raise DataError(
                "--source csv needs --csv DIR, a folder with train.csv and test.csv in the Sudoku-Extreme format."
            )
        files = {
            split: download_csv(split) if source == "hub" else storage.join(csv_dir, f"{split}.csv")
            for split in ("train", "test")
        }
        train = read_csv(files["train"], n_train, min_rating, seed)
        test = read_csv(files["test"], n_test, min_rating, seed + 1)
    meta = {
        "source": source,
        "givens": givens if source == "generate" else None,
        "min_rating": min_rating,
        "augmentations": copies,
        "seed": seed,
    }
    return save(out, augmented(*train, copies, seed), augmented(*test, 0, seed), meta)
