"""Tokenizers: `bytes` (the UTF-8 bytes, vocabulary 256), or a Hugging Face `tokenizer.json` from a
local folder or the hub, run by the `tokenizers` library (a file of rules: no code is executed).

A tokenizer's identity is the sha256 of its `tokenizer.json`, so shards and runs can tell whether
they were made with the same one.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from podtrain import storage
from podtrain.errors import DataError

BYTES = "bytes"
EOS = "<|endoftext|>"  # the end-of-document token of fitted tokenizers (as GPT-2's and SmolLM's)
EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
# A fitted tokenizer's chat turns (`podtrain data tokenizer --chat`): ChatML, as Qwen2.5 and SmolLM2 write them.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB_MULTIPLE = 128  # `model.vocab_size=auto` rounds up to this, for even shards and fast matmuls
# Beside tokenizer.json: the token ids of generation (bos, eos: one id or the list of stop tokens, pad) and any
# sampling defaults, as transformers reads them; an imported model's, carried through its runs to the export.
GENERATION = "generation_config.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens: no file, no end-of-document token."""

    spec, identity, vocab_size, eos_id, file, generation = BYTES, BYTES, 256, None, None, {}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (with the `tokenizer_config.json` beside it naming the EOS token, if any)."""

    def __init__(self, spec: str, file: Path):
        from tokenizers import Tokenizer

        self.spec, self.file = spec, file
        self.identity = hashlib.sha256(file.read_bytes()).hexdigest()
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the Rust parser raises a bare Exception
            raise DataError(
                f"{file} is not a tokenizer.json the `tokenizers` library reads ({e}); give a folder "
                "saved by a Hugging Face tokenizer."
            ) from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos_id(file.parent / "tokenizer_config.json")
        generation = file.parent / GENERATION
        self.generation = json.loads(generation.read_text()) if generation.is_file() else {}

    def _eos_id(self, config: Path) -> int | None:
        names = list(EOS_NAMES)
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            names.insert(0, eos.get("content") if isinstance(eos, dict) else eos)
        return next(
            (self.tokenizer.token_to_id(n) for n in names if n and self.tokenizer.token_to_id(n) is not None), None
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encoded in parallel by the library's thread pool (RAYON_NUM_THREADS threads)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str):
    """`bytes`, a folder holding tokenizer.json, a tokenizer.json file, or a hub model's name."""
    if spec == BYTES:
        return ByteTokenizer()
    path = storage.local_copy(spec)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(
                f"The tokenizer folder {spec} has no tokenizer.json; fit one with `podtrain data tokenizer` or give a "
                "Hugging Face model's folder or name."
            )
        return HFTokenizer(spec, path / "tokenizer.json")
    if path.is_file():
        return HFTokenizer(spec, path)
    return HFTokenizer(spec, _from_hub(spec))


def _from_hub(name: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        file = Path(hf_hub_download(name, "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - not found, gated and offline are all "cannot get it"
        raise DataError(
            f"Could not get the tokenizer `{name}`: it is not a local path, and from the Hugging Face hub: "
            f"{type(e).__name__}. Check the name (e.g. HuggingFaceTB/SmolLM-360M), that this machine reaches "
            "huggingface.co (or set HF_TOKEN), or give a local folder with tokenizer.json."
        ) from None
    for optional in ("tokenizer_config.json", GENERATION):  # the EOS token and the chat template; the stop tokens
        with contextlib.suppress(Exception):
            hf_hub_download(name, optional)
    return file


def keep_tokenizer(tokenizer: HFTokenizer, folder) -> None:
    """A copy of a tokenizer's files in `folder` (local or in a bucket), which `load_tokenizer(folder)` loads."""
    if not storage.is_remote(folder) and Path(folder).resolve() == tokenizer.file.parent.resolve():
        return  # a run that trains with the tokenizer it keeps (one `convert` made)
    storage.makedirs(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", GENERATION):
        if (tokenizer.file.parent / name).is_file():
            (storage.path(folder) / name).write_bytes((tokenizer.file.parent / name).read_bytes())


def vocab_for(tokenizer) -> int:
    """`model.vocab_size=auto`: the tokenizer's vocabulary rounded up to a multiple of 128."""
    return math.ceil(tokenizer.vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def fit_bpe(documents: Iterable[str], vocab_size: int, out: str | Path, chat: bool = False) -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte is a token, so any text encodes) fitted on
    `documents`, saved as OUT/tokenizer.json with a tokenizer_config.json that
    `transformers.AutoTokenizer` reads. With `chat`, ChatML's turn tokens and its chat template too,
    and a generation_config.json whose stop tokens are the end of a document and the end of a turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(
            f"--vocab-size {vocab_size} is below the {len(alphabet)} byte tokens plus {EOS}; "
            f"give at least {len(alphabet) + 1}."
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [EOS, *CHAT_TOKENS] if chat else [EOS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    documents = iter(documents)
    first = next(documents, None)
    if first is None:
        raise DataError("The corpus has no documents to fit a tokenizer on; check --input.")
    tokenizer.train_from_iterator(itertools.chain([first], documents), trainer)
    with storage.staged(out) as folder:
        tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(_config(chat), indent=1) + "\n")
        if chat:  # <|endoftext|> stays the EOS that ends documents; a reply ends at <|im_end|>
            ids = [tokenizer.token_to_id(t) for t in (EOS, CHAT_TOKENS[1])]
            (folder / GENERATION).write_text(json.dumps({"bos_token_id": ids[0], "eos_token_id": ids}, indent=1))
    return load_tokenizer(str(out))


def _config(chat: bool) -> dict:
    """tokenizer_config.json of a fitted BPE, as `transformers.AutoTokenizer` reads it."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "model_max_length": 1 << 20,
    }
    if chat:
        config["chat_template"] = CHATML
    return config
