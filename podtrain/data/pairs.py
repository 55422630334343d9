"""Preference pairs for DPO (`data.format=pairs`): JSONL lines of a conversation (`prompt`, one user
turn, or `messages`, ending before the reply) with a `chosen` and a `rejected` reply (a string, or
an assistant message). Each reply is rendered after the conversation with the tokenizer's chat
template (data/chat.py), and only its tokens are trained: the reply and its end-of-turn text.

A pair is one row (2, 3, seq_len + 1) int32: for CHOSEN then REJECTED, the channels TOKENS,
TRAINED (1 on the reply's tokens) and REFERENCE, whose first element holds the starting model's
summed log-probability of the reply as float32 bits (written in by program/tasks/preference.py before
the first step; NaN until then, so a row read without it gives a loss that is not finite). A row
whose TRAINED channel is all 0 pads an evaluation batch and counts in no mean.
"""

from __future__ import annotations

import json

import numpy as np

from podtrain.data import chat
from podtrain.errors import DataError

CHOSEN, REJECTED = 0, 1  # the replies of a row
TOKENS, TRAINED, REFERENCE = 0, 1, 2  # the channels of a reply
UNSET = np.array(np.nan, np.float32).view(np.int32)  # REFERENCE before the reference model has been run

FORM = (
    '{"prompt": "...", "chosen": "...", "rejected": "..."}, or {"messages": [{"role": "user", "content": "..."}], '
    '"chosen": {"role": "assistant", "content": "..."}, "rejected": {...}}'
)


def _reply(value) -> dict:
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict) and value.get("role") == "assistant" and isinstance(value.get("content"), str):
        return {"role": "assistant", "content": value["content"]}
    raise TypeError


def _pair(line: dict) -> tuple[list[dict], dict, dict]:
    """(conversation, chosen reply, rejected reply) of a line; TypeError or KeyError if it is not one."""
    if ("prompt" in line) == ("messages" in line):
        raise TypeError
    if "prompt" in line:
        if not isinstance(line["prompt"], str):
            raise TypeError
        messages = [{"role": "user", "content": line["prompt"]}]
    else:
        messages = line["messages"]
        if not isinstance(messages, list) or not messages or messages[-1].get("role") == "assistant":
            raise TypeError
        if not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
            raise TypeError
    return messages, _reply(line["chosen"]), _reply(line["rejected"])


def read_pairs(path: str | None) -> list[tuple[list[dict], dict, dict]]:
    """The pairs of a JSONL file, or of every *.jsonl file in a folder, in order."""
    if not path:
        raise DataError(
            "data.format=pairs trains on preference pairs and data.path is not set: give data.path=FILE_OR_DIR, a "
            f"JSONL file (or folder of them) of {FORM} lines."
        )
    found = []
    for where, line in chat.jsonl_lines(path, "preference pairs"):
        try:
            found.append(_pair(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DataError(
                f"{where} is not a preference pair: each line of a pairs file is {FORM}, the conversation ending "
                "before the reply."
            ) from None
    return found


def encode_pair(tokenizer, renderer: chat.Renderer, pair: tuple[list[dict], dict, dict]) -> list[tuple]:
    """The (tokens, trained) of the conversation followed by the chosen, then by the rejected reply."""
    messages, chosen, rejected = pair
    return [chat.encode(tokenizer, renderer, [*messages, reply], turns=slice(-1, None)) for reply in (chosen, rejected)]


def rows(encoded: list[list[tuple]], length: int, pad_id: int) -> np.ndarray:
    """Rows (n, 2, 3, length) of encoded pairs that fit `length` tokens, their references unset."""
    out = np.zeros((len(encoded), 2, 3, length), np.int32)
    out[:, :, TOKENS] = pad_id
    out[:, :, REFERENCE, 0] = UNSET
    for row, pair in zip(out, encoded):
        for reply, (tokens, trained) in zip(row, pair):
            reply[TOKENS, : len(tokens)], reply[TRAINED, : len(tokens)] = tokens, trained
    return out


def pair_rows(path: str | None, tokenizer, length: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray, str]:
    """(train rows, validation rows, a summary line) of the pairs at `path`; the last val_fraction
    of them (at least one) are held out. A pair with a reply that does not fit `length` tokens, or
    with the same reply twice (nothing to prefer), is left out and counted."""
    renderer = chat.Renderer.of(tokenizer)
    found = read_pairs(path)
    if len(found) < 2:
        raise DataError(f"data.path={path} holds {len(found)} preference pairs; training and validation need 2.")
    n_val = max(1, int(len(found) * val_fraction))
    splits, long, same = [], 0, 0
    for part in (found[:-n_val], found[-n_val:]):
        kept = []
        for pair in part:
            if pair[1]["content"] == pair[2]["content"]:
                same += 1
                continue
            encoded = encode_pair(tokenizer, renderer, pair)
            if max(len(tokens) for tokens, _ in encoded) > length:
                long += 1
            else:
                kept.append(encoded)
        splits.append(kept)
    train, val = splits
    if not train or not val:
        raise DataError(
            f"No {'train' if not train else 'held-out'} pair of data.path={path} fits train.seq_len + 1 = {length} "
            "tokens; raise train.seq_len, or give shorter pairs (or more)."
        )
    trained = sum(int(t.sum()) for pair in train for _, t in pair)
    left_out = [
        f"{long} longer than train.seq_len + 1 = {length} tokens" if long else "",
        f"{same} with the same reply twice" if same else "",
    ]
    summary = f"{len(train):,} train / {len(val):,} val preference pairs, {trained:,} reply tokens trained" + (
        f"; left out: {', '.join(filter(None, left_out))}" if long or same else ""
    )
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    return rows(train, length, pad), rows(val, length, pad), summary
