"""`podtrain data`: build datasets (Sudoku sets, a fitted tokenizer, prepared token shards)."""

from __future__ import annotations

import itertools
import json
import os

from podtrain.data import chat, sudoku
from podtrain.data.prepare import prepare
from podtrain.data.sources import Corpus
from podtrain.data.tokenizer import fit_bpe, load_tokenizer
from podtrain.errors import ConfigError


def _sudoku(args) -> None:
    meta = sudoku.build(
        args.out, args.source, args.train, args.test, args.givens, args.min_rating, args.augment, args.seed, args.csv
    )
    print(f"[podtrain] wrote {meta['train']:,} train and {meta['test']:,} test puzzles ({args.source}) to {args.out}")


def _corpus(args):
    return [Corpus(path, args.text_field, args.dataset_name, args.split) for path in args.input]


def _tokenizer(args) -> None:
    documents = itertools.chain.from_iterable(corpus.documents() for corpus in _corpus(args))
    tokenizer = fit_bpe(itertools.islice(documents, args.max_documents), args.vocab_size, args.out, args.chat)
    print(
        f"[podtrain] wrote {args.out}/tokenizer.json: byte-level BPE, {tokenizer.vocab_size:,} tokens, EOS "
        f"{tokenizer.eos_id}"
    )


def _chat(args) -> None:
    tokenizer = load_tokenizer(args.tokenizer)
    renderer = chat.Renderer.of(tokenizer)
    for number, messages in enumerate(chat.read_conversations(args.path), 1):
        tokens, trained = chat.encode(tokenizer, renderer, messages)
        pieces = chat.trained_pieces(tokenizer, tokens, trained)
        if args.json:
            print(json.dumps({"conversation": number, "tokens": len(tokens), "trained": pieces}, ensure_ascii=False))
            continue
        print(f"conversation {number}: {len(tokens)} tokens, {int(trained.sum())} trained")
        if args.show:
            print(chat.marked(tokenizer, tokens, trained))


def _prepare(args) -> None:
    if args.workers:  # the batch encoder's thread pool, sized before `tokenizers` is first imported
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    if len(args.input) != 1:
        raise ConfigError(
            "data prepare reads one --input (a file, a folder or a hub dataset); put several files in one folder."
        )
    m = prepare(_corpus(args)[0], load_tokenizer(args.tokenizer), args.out, args.val_fraction, args.shard_docs)
    rate = f", {m['tokens_per_sec']:,.0f} tokens/s" if m.get("tokens_per_sec") else ""
    print(
        f"[podtrain] {args.out}: {m['documents']:,} documents, {m['train_tokens']:,} train and {m['val_tokens']:,} "
        f"val tokens in {len(m['shards'])} shards{rate}. "
        f"Train with data.source=tokens data.path={args.out} model.vocab_size=auto"
    )


def add_data_commands(sub) -> None:
    """The `data` subcommand and its kinds, on the CLI's subparsers."""
    da = sub.add_parser("data", help="build datasets")
    kinds = da.add_subparsers(dest="dataset", required=True)
    for add in (_add_sudoku, _add_tokenizer, _add_prepare, _add_chat):
        add(kinds)


def _add_sudoku(kinds) -> None:
    su = kinds.add_parser(
        "sudoku", help="Sudoku train/test sets: generated offline, or Sudoku-Extreme from the HF hub or local CSVs"
    )
    su.add_argument("--out", required=True, help="output folder (train.npz, test.npz, meta.json)")
    su.add_argument(
        "--source",
        choices=("generate", "hub", "csv"),
        default="generate",
        help="generate puzzles here (default), download sapientinc/sudoku-extreme, or read --csv",
    )
    su.add_argument("--csv", help="folder with train.csv and test.csv in the Sudoku-Extreme format (for --source csv)")
    su.add_argument("--train", type=int, default=1000, help="training puzzles before augmentation")
    su.add_argument("--test", type=int, default=200, help="test puzzles")
    su.add_argument(
        "--givens", type=int, default=30, help="clues per generated puzzle (more is easier; unique puzzles need >= 17)"
    )
    su.add_argument(
        "--min-rating", type=int, default=0, help="keep puzzles whose solver backtracks at least this often (harder)"
    )
    su.add_argument("--augment", type=int, default=0, help="augmented copies of each training puzzle")
    su.add_argument("--seed", type=int, default=0)
    su.set_defaults(func=_sudoku)


def _corpus_options(command, many: bool) -> None:
    """--input and where its text is."""
    command.add_argument(
        "--input",
        required=True,
        nargs="+" if many else 1,
        help=(
            "corpus: .txt/.md/.jsonl/.json/.parquet files or folders, a `datasets.save_to_disk` folder, or a hub "
            "dataset name"
        ),
    )
    command.add_argument(
        "--text-field", default="text", help="the field (JSON) or column (Parquet, datasets) holding the text"
    )
    command.add_argument(
        "--dataset-name",
        help=(
            "the config of a hub dataset (e.g. cosmopedia-v2); with a local folder, read it as a hub dataset's layout"
        ),
    )
    command.add_argument("--split", default="train", help="the split of a hub or saved dataset")


def _add_tokenizer(kinds) -> None:
    to = kinds.add_parser(
        "tokenizer",
        help="fit a byte-level BPE tokenizer on a local corpus",
        description=(
            "Writes OUT/tokenizer.json and tokenizer_config.json, which `data.tokenizer=OUT` and "
            "transformers.AutoTokenizer load."
        ),
    )
    _corpus_options(to, many=True)
    to.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="tokens in the vocabulary, including the 256 bytes and <|endoftext|>",
    )
    to.add_argument("--max-documents", type=int, help="fit on at most this many documents (the first ones)")
    to.add_argument(
        "--chat",
        action="store_true",
        help="add ChatML's <|im_start|> and <|im_end|> and its chat template (data.format=chat)",
    )
    to.add_argument("--out", required=True, help="output folder")
    to.set_defaults(func=_tokenizer)


def _add_prepare(kinds) -> None:
    pr = kinds.add_parser(
        "prepare",
        help="tokenize a corpus once into shards for data.source=tokens",
        description=(
            "Tokenize a corpus into memory-mapped token shards and a manifest.json; an interrupted prepare continues "
            "where it stopped when rerun."
        ),
    )
    _corpus_options(pr, many=False)
    pr.add_argument(
        "--tokenizer",
        required=True,
        help=(
            "a folder with tokenizer.json (from `podtrain data tokenizer`) or a hub model's name (e.g. "
            "HuggingFaceTB/SmolLM-360M)"
        ),
    )
    pr.add_argument("--out", required=True, help="output folder")
    pr.add_argument(
        "--val-fraction", type=float, default=0.01, help="fraction of documents for validation (default 0.01)"
    )
    pr.add_argument("--workers", type=int, default=0, help="threads of the batch encoder (default: one per core)")
    pr.add_argument(
        "--shard-docs", type=int, default=20_000, help="documents per shard: the unit an interrupted prepare keeps"
    )
    pr.set_defaults(func=_prepare)


def _add_chat(kinds) -> None:
    ch = kinds.add_parser(
        "chat",
        help="show which tokens of chat conversations data.format=chat trains",
        description=(
            "Renders each conversation of a JSONL file (or folder) with the tokenizer's chat template and marks the "
            "tokens the loss is taken on: the assistant's turns, their end-of-turn text included."
        ),
    )
    ch.add_argument("path", help='a JSONL file of {"messages": [...]} conversations, or a folder of them')
    ch.add_argument(
        "--tokenizer", required=True, help="a folder with tokenizer.json and a chat template, or a hub name"
    )
    ch.add_argument("--json", action="store_true", help="one JSON object a conversation: its text and trained pieces")
    ch.add_argument("--show", action="store_true", help="each conversation with its trained text between « and »")
    ch.set_defaults(func=_chat)
