"""`podtrain generate`: text from a run's latest checkpoint, continuing a prompt, replying with --chat
to a user message rendered with the run's chat template, or for each row of --prompts FILE.jsonl at
once (the batched sampler, podtrain.program.sampler); each stops at the tokenizer's stop tokens
(`data.chat.stop_ids`)."""

from __future__ import annotations

import json
import sys

from podtrain import storage
from podtrain.errors import ConfigError


def add_generate_command(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="sample text from a run's latest checkpoint, or with --chat its reply to a message",
        description=(
            "Continue --prompt TEXT, or with --chat MESSAGE render the message as a user turn with the run's chat "
            "template and print only the reply, or with --prompts FILE.jsonl continue every row's `prompt` (or reply "
            "to its `messages`) in batches and print one JSON line per row with its `completion`. Generation stops at "
            "the tokenizer's stop tokens (its EOS list, the template's end of turn) or after --max-new-tokens."
        ),
    )
    g.add_argument("run_dir")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--chat", metavar="MESSAGE", help="a user message: print the model's reply to it")
    g.add_argument("--system", metavar="TEXT", help="with --chat, a system turn before the message")
    g.add_argument("--prompts", metavar="FILE.jsonl", help='rows of {"prompt": TEXT} or {"messages": [...]}')
    for flag, kind, default, text in (
        (
            "--max-new-tokens",
            int,
            200,
            "the most new tokens; a stop token or the model's last position ends sooner",
        ),
        ("--temperature", float, 0.8, "softmax temperature of the draws"),
        ("--top-k", int, 0, "draw among the k likeliest tokens (0: all)"),
        ("--top-p", float, 1.0, "draw among the likeliest tokens whose probability reaches p (1: all)"),
        ("--seed", int, 0, "seed of the draws (row i of --prompts: seed + i)"),
        ("--batch-size", int, 32, "rows of --prompts sampled together"),
    ):
        g.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    g.add_argument("--greedy", action="store_true", help="always the most likely token (temperature 0)")
    g.set_defaults(func=command)


def chat_prompt(renderer, message: str, system: str | None = None) -> str:
    """The conversation up to the assistant's turn, as the template writes it for generation."""
    messages = [{"role": "system", "content": system}] if system else []
    return renderer([*messages, {"role": "user", "content": message}], generation_prompt=True)


def read_prompts(path: str) -> list[dict]:
    """--prompts rows (a local file or one in a bucket), each with a `prompt` string or a list of
    `messages`; checked before any weights load."""
    rows, source = [], storage.path(path)
    if not source.is_file():
        raise ConfigError(f"--prompts {path}: no such file; give a JSONL file of prompts, one per line.")
    with source.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--prompts {path}, line {number}, is not JSON ({e.msg}).") from None
            if not isinstance(row, dict) or not (
                isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)
            ):
                raise ConfigError(
                    f'--prompts {path}, line {number}, has no "prompt" (a string) or "messages" (a list of turns): '
                    f'give each row one, e.g. {{"prompt": "The capital of France is"}}.'
                )
            rows.append(row)
    return rows


def generate(
    run,
    prompt: str = "",
    chat: str | None = None,
    system: str | None = None,
    max_new_tokens: int = 200,
    sampling=None,
    seed: int = 0,
    model: tuple | None = None,
) -> str:
    """What `podtrain generate` prints for a `Run`: the prompt and its continuation, or with `chat`
    the reply alone. `model` is the run's `language_model()`, loaded once for many calls."""
    from podtrain.data.chat import Renderer

    if chat is not None and prompt:
        raise ConfigError("Give --prompt TEXT (text to continue) or --chat MESSAGE (a message to reply to), not both.")
    if system is not None and chat is None:
        raise ConfigError("--system TEXT is a turn of a conversation; give the user's message with --chat MESSAGE.")
    tokenizer = run.tokenizer()
    # the template is checked before the weights load
    prompt = prompt if chat is None else chat_prompt(Renderer.of(tokenizer), chat, system)
    (text,) = complete_all(run, tokenizer, [prompt], max_new_tokens, sampling, seed, 1, model)
    return text if chat is not None else prompt + text


def complete_all(run, tokenizer, prompts, max_new_tokens, sampling, seed, batch_size, model=None) -> list[str]:
    """Each prompt's continuation, `batch_size` at a time, prompt i drawn with seed + i."""
    from podtrain.program.sampler import Sampling, complete

    cfg, fns, params = model or run.language_model()
    sampling, texts = sampling or Sampling(), []
    for at in range(0, len(prompts), batch_size):
        batch = prompts[at : at + batch_size]
        seeds = [seed + at + i for i in range(len(batch))]
        texts += complete(
            fns, params, tokenizer, batch, max_new_tokens, sampling, seeds=seeds, max_len=cfg.model.max_seq_len
        )
    return texts


def command(args) -> None:
    from podtrain.data.chat import Renderer
    from podtrain.program.sampler import Sampling
    from podtrain.train.run import Run

    sampling = Sampling(0.0 if args.greedy else args.temperature, args.top_k, args.top_p)
    run = Run.at(args.run_dir)
    if args.prompts is None:
        print(generate(run, args.prompt, args.chat, args.system, args.max_new_tokens, sampling, args.seed))
        return
    if args.prompt or args.chat is not None:
        raise ConfigError("Give --prompts FILE.jsonl or a single --prompt/--chat, not both.")
    rows, tokenizer = read_prompts(args.prompts), run.tokenizer()
    renderer = Renderer.of(tokenizer) if any("messages" in r for r in rows) else None
    prompts = [r["prompt"] if "prompt" in r else renderer(r["messages"], generation_prompt=True) for r in rows]
    texts = complete_all(run, tokenizer, prompts, args.max_new_tokens, sampling, args.seed, args.batch_size)
    for row, text in zip(rows, texts):
        sys.stdout.write(json.dumps({**row, "completion": text}, ensure_ascii=False) + "\n")
