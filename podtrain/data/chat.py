"""Conversations for chat fine-tuning (`data.format=chat`): JSONL lines of {"messages": [{"role",
"content"}, ...]}, rendered with the tokenizer's own chat template (its tokenizer_config.json), the
assistant's replies marked for the loss, and packed into rows with segment ids, so that packed
conversations never attend to each other.

A packed row is (3, seq_len + 1) int32: TOKENS, SEGMENTS (1, 2, ... per conversation, 0 for
padding) and TRAINED (1 where the token is part of an assistant reply, its end-of-turn marker
included). Which characters are the assistant's comes from rendering each conversation up to a
reply with and without it (as transformers' templates mean them to be used), never from searching
the text for the reply; the tokens whose first character lies in one are trained.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np

from podtrain import storage
from podtrain.errors import DataError

TOKENS, SEGMENTS, TRAINED = 0, 1, 2  # the channels of a packed row


def chat_template(tokenizer) -> str:
    """The tokenizer's chat template (`template_of`), or an error saying where to get one."""
    template = template_of(tokenizer)
    if not template:
        raise DataError(
            f"data.format=chat and `generate --chat` render conversations with the tokenizer's chat template, and "
            f"the tokenizer {tokenizer.spec} has none (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja); use the tokenizer of an instruction-tuned model, or one fitted with "
            "`podtrain data tokenizer --chat`."
        )
    return template


def template_of(tokenizer) -> str | None:
    """The tokenizer's chat template: tokenizer_config.json's `chat_template` (the default one of
    a list), or a chat_template.jinja beside it; None if it has none."""
    folder = Path(tokenizer.file).parent if getattr(tokenizer, "file", None) else None
    config = folder / "tokenizer_config.json" if folder else None
    template = json.loads(config.read_text()).get("chat_template") if config and config.is_file() else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and folder and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return template or None


class Renderer:
    """A chat template compiled as transformers runs it: a sandboxed Jinja environment with
    trim_blocks, lstrip_blocks, loop controls, `raise_exception` and `strftime_now`."""

    def __init__(self, template: str, special: dict[str, str]):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise DataError(f"The chat template refused a conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals |= {"raise_exception": raise_exception, "strftime_now": lambda f: datetime.now().strftime(f)}
        self.template, self.special = env.from_string(template), special

    @classmethod
    def of(cls, tokenizer) -> Renderer:
        """The tokenizer's own chat template, with its special tokens."""
        return cls(chat_template(tokenizer), special_tokens(tokenizer))

    def __call__(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=generation_prompt, **self.special)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the (start, end) characters of each assistant turn in it, taken
        from the template's own renderings, never by searching the text: a turn is what the conversation
        rendered up to it adds to the conversation rendered up to its generation prompt (the reply and
        its end-of-turn text). Where the whole conversation renders an earlier turn otherwise (Qwen3
        drops the reasoning of turns before the last question), the turn's place is found by rendering
        the conversation with its content replaced by a marker no conversation holds."""
        text, spans = self(messages), []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, upto = self(messages[:i], generation_prompt=True), self(messages[: i + 1])
            if not upto.startswith(before):
                raise _unwritable(i, message)
            spans.append((len(before), len(upto)) if text.startswith(upto) else self._rewritten(messages, i, text))
        return text, spans

    def _rewritten(self, messages: list[dict], i: int, text: str) -> tuple[int, int]:
        """Turn i of a conversation whose full rendering writes it otherwise than the rendering up to it."""
        marked = [*messages[:i], {**messages[i], "content": MARK}]
        alone, whole = self(marked), self([*marked, *messages[i + 1 :]])
        start, closing = whole.find(MARK), alone[alone.find(MARK) + len(MARK) :]  # the turn's end-of-turn text
        rest = whole[start + len(MARK) :]
        if MARK not in alone or start < 0 or text[:start] != whole[:start] or not text.endswith(rest):
            raise _unwritable(i, messages[i])
        end = len(text) - len(rest)
        return start, end + len(closing) if text.startswith(closing, end) else end


# Private-use characters: in no conversation, and written as they are by any template that writes content.
MARK = "\ue000podtrain-turn\ue001"


def end_of_turn(tokenizer) -> int | None:
    """The token that closes an assistant turn in the tokenizer's chat template (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>, Gemma's <end_of_turn>): the first special token of the text the template
    writes after a reply. None without a template, or where a turn ends in plain text."""
    template = template_of(tokenizer)
    if template is None:
        return None
    reply = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": MARK}]
    try:
        text = Renderer(template, special_tokens(tokenizer))(reply)
    except DataError:  # a template that wants other turns: no end of turn to stop at, not a failed sample
        return None
    if MARK not in text:
        return None
    special = {i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}
    closing = tokenizer.tokenizer.encode(text[text.find(MARK) + len(MARK) :], add_special_tokens=False).ids
    return next((i for i in closing if i in special), None)


def stop_ids(tokenizer) -> list[int]:
    """The tokens at which generation stops: the tokenizer's generation_config.json's eos list (an
    imported model's, kept as it was) or else its EOS, and the chat template's end of turn."""
    eos = tokenizer.generation.get("eos_token_id")
    eos = tokenizer.eos_id if eos is None else eos
    stops = [i for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    turn = end_of_turn(tokenizer)
    return stops + [turn] if turn is not None and turn not in stops else stops


def _unwritable(i: int, message: dict) -> DataError:
    return DataError(
        f"The chat template does not write assistant turn {i} ({str(message.get('content'))[:40]!r}) as a piece of "
        "the conversation of its own; data.format=chat cannot tell which tokens to train."
    )


def read_conversations(path: str) -> list[list[dict]]:
    """The conversations of a JSONL file, or of every *.jsonl file in a folder, in order."""
    if not path:
        raise DataError(
            "data.format=chat trains on conversations and data.path is not set: give data.path=FILE_OR_DIR, a "
            'JSONL file (or folder of them) of {"messages": [{"role": ..., "content": ...}, ...]} lines.'
        )
    conversations = []
    for where, line in jsonl_lines(path, "conversations"):
        try:
            messages = json.loads(line)["messages"]
            if not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise DataError(
                f"{where} is not a conversation: each line of a chat file is "
                '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}.'
            ) from None
        conversations.append(messages)
    return conversations


def jsonl_lines(path: str, what: str) -> Iterator[tuple[str, str]]:
    """("FILE:LINE", line) for each line with text of a JSONL file, or of every *.jsonl file in a
    folder, in order; an error if `path` is neither (a file or folder of `what`)."""
    folder = storage.path(path)
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else [folder]
    if not files or not files[0].is_file():
        raise DataError(f"data.path={path} is not a JSONL file of {what} or a folder of them.")
    for file in files:
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip():
                yield f"{file}:{number}", line


def encode(
    tokenizer, renderer: Renderer, messages: list[dict], turns: slice = slice(None)
) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's tokens and which of them are trained: the assistant's (`turns` of them; a
    preference pair's reply is the last)."""
    text, spans = renderer.assistant_spans(messages)
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
    trained = np.zeros(len(starts), bool)
    for start, end in spans[turns]:
        trained |= (starts >= start) & (starts < end)
    return np.asarray(encoding.ids, np.int32), trained


def _runs(trained: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trained.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def trained_pieces(tokenizer, tokens: np.ndarray, trained: np.ndarray) -> list[str]:
    """The text of each run of trained tokens, in order."""
    return [tokenizer.decode(tokens[start:end]) for start, end in _runs(trained)]


def marked(tokenizer, tokens: np.ndarray, trained: np.ndarray) -> str:
    """The conversation's text with each trained run between « and »."""
    out, at = [], 0
    for start, end in _runs(trained):
        out += [tokenizer.decode(tokens[at:start]), "«", tokenizer.decode(tokens[start:end]), "»"]
        at = end
    return "".join([*out, tokenizer.decode(tokens[at:])])


def pack(examples: list[tuple[np.ndarray, np.ndarray]], length: int, pad_id: int) -> tuple[np.ndarray, int]:
    """Conversations packed in order into rows of `length` tokens, a conversation starting a new row
    when it does not fit the current one: (rows (n, 3, length), conversations cut to `length`)."""
    rows, row, used, cut = [], None, length, 0
    for tokens, trained in examples:
        if len(tokens) > length:
            tokens, trained, cut = tokens[:length], trained[:length], cut + 1
        if used + len(tokens) > length:
            row, used = np.zeros((3, length), np.int32), 0
            row[TOKENS] = pad_id
            rows.append(row)
        segment = row[SEGMENTS, :used].max(initial=0) + 1
        row[TOKENS, used : used + len(tokens)] = tokens
        row[SEGMENTS, used : used + len(tokens)] = segment
        row[TRAINED, used : used + len(tokens)] = trained
        used += len(tokens)
    return np.stack(rows) if rows else np.zeros((0, 3, length), np.int32), cut


def special_tokens(tokenizer) -> dict[str, str]:
    """The special tokens a template may name (bos_token, eos_token, ...), from tokenizer_config.json."""
    config = Path(tokenizer.file).parent / "tokenizer_config.json"
    values = json.loads(config.read_text()) if config.is_file() else {}
    found = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = values.get(name)
        found[name] = value.get("content") if isinstance(value, dict) else (value or "")
    return found


def chat_rows(path: str, tokenizer, length: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray, str]:
    """(train rows, validation rows, a summary line) of the conversations at `path`; the last
    val_fraction of them (at least one) are held out."""
    renderer = Renderer.of(tokenizer)
    conversations = read_conversations(path)
    if len(conversations) < 2:
        raise DataError(f"data.path={path} holds {len(conversations)} conversations; training and validation need 2.")
    examples = [encode(tokenizer, renderer, messages) for messages in conversations]
    n_val = max(1, int(len(examples) * val_fraction))
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    (train, cut), (val, val_cut) = pack(examples[:-n_val], length, pad), pack(examples[-n_val:], length, pad)
    trained = sum(int(t.sum()) for _, t in examples)
    summary = (
        f"{len(conversations) - n_val:,} train / {n_val:,} val conversations in {len(train):,} / {len(val):,} rows, "
        f"{trained:,} assistant tokens trained"
        + (f"; {cut + val_cut} conversations cut to train.seq_len + 1 = {length} tokens" if cut + val_cut else "")
    )
    return train, val, summary
