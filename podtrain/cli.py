"""The `podtrain` command: train, generate, plot."""

from __future__ import annotations

import argparse
import sys

from podtrain.errors import PodtrainError


def _train(args) -> None:
    from podtrain.config import FLAG_ALIASES, load_config, tiny_model_overrides
    from podtrain.train.loop import train

    overrides = tiny_model_overrides() if args.use_small_model else []
    overrides += [f"{FLAG_ALIASES[flag]}={value}" for flag, value in args.flags.items()]
    train(load_config(args.config, overrides + args.overrides))


def _generate(args) -> None:
    from podtrain.train.sample import generate_from_run

    print(args.prompt + generate_from_run(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.seed))


def _plot(args) -> None:
    from podtrain.tools.plot import plot_runs

    print(f"[podtrain] wrote {plot_runs(args.run_dirs, args.out)}")


class _Alias(argparse.Action):
    """Collects setup-guide flags such as --batch-size into args.flags."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.flags[option_string] = value


def parser() -> argparse.ArgumentParser:
    from podtrain.config import FLAG_ALIASES

    p = argparse.ArgumentParser(prog="podtrain", description="One config, any device: JAX training from a laptop CPU to a TPU pod.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or resume) a model", description="Train from CONFIG.yaml (default: the embedded tiny job) with key=value overrides, e.g. train.steps=100 mesh.fsdp=2.")
    t.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.set_defaults(func=_train, flags={})
    for flag, key in FLAG_ALIASES.items():
        t.add_argument(flag, action=_Alias, metavar="VALUE", help=f"same as {key}=VALUE")
    t.add_argument("--use-small-model", action="store_true", help="use the model dimensions of the tiny default job")

    g = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    g.add_argument("run_dir")
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)

    pl = sub.add_parser("plot", help="PNG curves of loss, val_loss, lr and tokens/s for one or more runs")
    pl.add_argument("run_dirs", nargs="+")
    pl.add_argument("--out", help="PNG path (default: FIRST_RUN_DIR/curves.png)")
    pl.set_defaults(func=_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "train" and args.config and "=" in args.config:
        args.overrides.insert(0, args.config)  # `podtrain train key=value` without a file
        args.config = None
    try:
        args.func(args)
    except PodtrainError as e:
        print(f"podtrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("podtrain: interrupted", file=sys.stderr)
        return 130
    return 0
