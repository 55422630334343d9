"""Greedy decoding speed: podtrain's batched sampler against transformers' generate on the same
export, and against decoding one prompt at a time with one dispatch per token (what `generate`
did before the batched sampler: a compiled prefill, then a compiled step per token from Python).

A random Llama of ~15M parameters is written as a Hugging Face folder, imported as a run
(`podtrain convert --from-hf`), and each side decodes the same prompts (lengths 8 to 32) for
--new-tokens tokens with no stop token, at batch 1 and 32, float32 on the CPU; each is run once to
compile or warm up, then timed (the median of --repeats). Ratios are the signal; absolute times on
a shared machine are noise.

    .venv/bin/python bench/sampler.py [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from podtrain.cli import main as podtrain
from podtrain.program import sampler
from podtrain.sharding import sharded_jit
from podtrain.train.run import Run

SIZES = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2)


def export(folder: Path) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=False, **SIZES)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def one_at_a_time(fns, params, prompts, new_tokens: int, slots: int) -> list[list[int]]:
    """Each prompt alone: a compiled prefill, then one compiled step per token, each a dispatch from Python."""

    def prefill(params, tokens, length):
        model = fns.module(params)
        logits, cache = model.decode(tokens, model.init_cache(1, slots), jnp.int32(0), length)
        return jnp.argmax(logits[0, length - 1]), cache

    def step(params, token, cache, pos):
        logits, cache = fns.module(params).decode(token.reshape(1, 1), cache, pos)
        return jnp.argmax(logits[0, 0]), cache

    prefill, step = sharded_jit(prefill, fns.mesh), sharded_jit(step, fns.mesh, donate_argnums=2)
    out = []
    for prompt in prompts:
        buf = np.zeros((1, 32), np.int32)
        buf[0, : len(prompt)] = prompt
        token, cache = prefill(params, buf, len(prompt))
        new = [int(token)]
        for i in range(new_tokens - 1):
            token, cache = step(params, token, cache, jnp.int32(len(prompt) + i))
            new.append(int(token))
        out.append(new)
    return out


def theirs(model, prompts, new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate on a left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[:, width:].tolist()


def timed(fn, repeats: int) -> tuple[float, object]:
    result = fn()  # compile, warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    n = args.new_tokens
    folder = Path(tempfile.mkdtemp())
    model = export(folder / "hf")
    assert podtrain(["convert", "--from-hf", str(folder / "hf"), str(folder / "run")]) == 0
    cfg, fns, params = Run.at(folder / "run").language_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 4096, int(rng.integers(8, 33))).tolist() for _ in range(32)]
    print(f"{jax.devices()[0].platform}, {torch.get_num_threads()} torch threads; {n} new tokens per prompt")
    heads = ("batch", "batched tok/s", "transformers", "one at a time", "vs transformers", "vs one at a time")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (5, 14, 13, 14, 16, 17))))
    for batch in (1, 32):
        rows = prompts[:batch]
        ours, got = timed(
            lambda r=rows: sampler.generate(fns, params, r, n, max_len=cfg.model.max_seq_len), args.repeats
        )
        hf, expected = timed(lambda r=rows: theirs(model, r, n), args.repeats)
        alone, each = timed(lambda r=rows: one_at_a_time(fns, params, r, n, 32 + n), args.repeats)
        same = [c.tokens for c in got] == expected == each
        tokens = batch * n
        print(
            f"{batch:>5} {tokens / ours:>14,.0f} {tokens / hf:>13,.0f} {tokens / alone:>14,.0f} "
            f"{hf / ours:>15.2f}x {alone / ours:>16.2f}x{'' if same else '  (tokens differ)'}"
        )


if __name__ == "__main__":
    main()
