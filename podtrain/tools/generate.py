"""`podtrain generate`: text from a run's latest checkpoint, continuing a prompt, or with --chat the
reply to a user message rendered with the run's chat template; either stops at the tokenizer's stop
tokens (`data.chat.stop_ids`)."""

from __future__ import annotations

from podtrain.errors import ConfigError


def add_generate_command(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="sample text from a run's latest checkpoint, or with --chat its reply to a message",
        description=(
            "Continue --prompt TEXT, or with --chat MESSAGE render the message as a user turn with the run's chat "
            "template and print only the reply. Generation stops at the tokenizer's stop tokens (its EOS list, "
            "the template's end of turn) or after --max-new-tokens."
        ),
    )
    g.add_argument("run_dir")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--chat", metavar="MESSAGE", help="a user message: print the model's reply to it")
    g.add_argument("--system", metavar="TEXT", help="with --chat, a system turn before the message")
    for flag, kind, default, text in (
        ("--max-new-tokens", int, 200, "the most tokens generated; a stop token ends it sooner"),
        ("--temperature", float, 0.8, "softmax temperature of the draws"),
        ("--seed", int, 0, "seed of the draws"),
    ):
        g.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    for flag, text in (
        ("--greedy", "always the most likely token (temperature 0)"),
        ("--no-cache", "recompute the whole window for every token instead of keeping a key/value cache (slower)"),
    ):
        g.add_argument(flag, action="store_true", help=text)
    g.set_defaults(func=command)


def chat_prompt(renderer, message: str, system: str | None = None) -> str:
    """The conversation up to the assistant's turn, as the template writes it for generation."""
    messages = [{"role": "system", "content": system}] if system else []
    return renderer([*messages, {"role": "user", "content": message}], generation_prompt=True)


def generate(
    run,
    prompt: str = "",
    chat: str | None = None,
    system: str | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    seed: int = 0,
    cache: bool = True,
    model: tuple | None = None,
) -> str:
    """What `podtrain generate` prints for a `Run`: the prompt and its continuation, or with `chat`
    the reply alone. `model` is the run's `language_model()`, loaded once for many calls."""
    from podtrain.data.chat import Renderer
    from podtrain.program.tasks.sampling import sample

    if chat is not None and prompt:
        raise ConfigError("Give --prompt TEXT (text to continue) or --chat MESSAGE (a message to reply to), not both.")
    if system is not None and chat is None:
        raise ConfigError("--system TEXT is a turn of a conversation; give the user's message with --chat MESSAGE.")
    tokenizer = run.tokenizer()
    # the template is checked before the weights load
    prompt = prompt if chat is None else chat_prompt(Renderer.of(tokenizer), chat, system)
    cfg, fns, params = model or run.language_model()
    window = cfg.model.max_seq_len  # the model's positions
    text = sample(fns, params, tokenizer, prompt, max_new_tokens, temperature, window, seed, cache)
    return text if chat is not None else prompt + text


def command(args) -> None:
    from podtrain.train.run import Run

    temperature = 0.0 if args.greedy else args.temperature
    options = {"max_new_tokens": args.max_new_tokens, "seed": args.seed, "cache": not args.no_cache}
    print(generate(Run.at(args.run_dir), args.prompt, args.chat, args.system, temperature=temperature, **options))
