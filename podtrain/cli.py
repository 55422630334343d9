"""The `podtrain` command: train, plan, generate, eval, convert, checkpoints, plot, doctor, profile, launch, data."""

from __future__ import annotations

import argparse
import sys

from podtrain import storage
from podtrain.data.commands import add_data_commands
from podtrain.errors import ConfigError, PodtrainError, Preempted
from podtrain.interop.hf.families import known_as
from podtrain.tools.generate import add_generate_command
from podtrain.tools.launch import add_launch_command

# Flags from the setup guides, each an alias of one config key.
FLAG_ALIASES = {
    "--batch-size": "train.batch_size",
    "--total-steps": "train.steps",
    "--mesh-data": "mesh.data",
    "--mesh-fsdp": "mesh.fsdp",
    "--mesh-tp": "mesh.tensor",
    "--checkpoint-dir": "checkpoint.dir",
    "--checkpoint-interval": "checkpoint.every",
    "--log-interval": "train.log_every",
    "--learning-rate": "train.lr",
    "--dataset": "data.path",
    "--dataset-name": "data.dataset_name",
    "--tokenizer": "data.tokenizer",
    "--worker-buffer-size": "data.prefetch",
}


def _config(args):
    """The config of a train or doctor command line: file, setup-guide flags, then overrides."""
    from podtrain.program.load import load_config

    overrides = [f"{FLAG_ALIASES[flag]}={value}" for flag, value in getattr(args, "flags", {}).items()]
    return load_config(args.config, overrides + args.overrides, small_model=getattr(args, "use_small_model", False))


def _train(args) -> None:
    from podtrain.train.loop import train

    train(_config(args))


def _doctor(args) -> None:
    from podtrain.tools.doctor import doctor

    doctor(_config(args))


def _launch(args) -> int:
    from podtrain.tools.launch import Launch

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        raise ConfigError(
            "Give the command to launch after `--`, e.g. `podtrain launch --nproc 2 -- train configs/tiny.yaml`."
        )
    cfg = _config(_parse(command)) if command[0] == "train" else None
    if command[0] in args.commands:  # a podtrain command
        command = [sys.executable, "-m", "podtrain", *command]
    options = ("nproc", "devices_per_proc", "nnodes", "node_rank", "coordinator", "max_restarts", "min_nproc")
    options += ("slot_check", "rejoin_timeout")
    where = {"run_dir": cfg.run_dir, "checkpoint_dir": cfg.checkpoint_dir} if cfg else {}
    where |= {"survivors_save": cfg.checkpoint.replica_every > 0} if cfg else {}
    return Launch(command, args.log_dir, **where, **{name: getattr(args, name) for name in options}).run()


def _eval(args) -> None:
    from podtrain.tools.evaluate import command

    command(args)


def _convert(args) -> None:
    from podtrain.tools.convert import command

    command(args)


def _profile(args) -> None:
    from podtrain.tools.profile import profile

    profile(_config(args), args.steps, args.top)


def _plan(args) -> int:
    """Exit 0 when the job fits the target, 3 when it does not (with the remedy), 2 on bad input."""
    import json

    import jax

    from podtrain.planning import targets as hardware

    # A plan compiles for a TPU or GPU that is not here (or this machine's CPU): it starts no accelerator.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", hardware.cpu_count(args.target.strip().lower()) or 1)
    from podtrain.planning import plan, report
    from podtrain.runtime import use_compile_cache

    cfg, target = _config(args), hardware.target(args.target)
    if target.platform == "cpu":  # a TPU or GPU program compiled with no client cannot be read back from the cache
        use_compile_cache(cfg.compile_cache)  # a plan run twice, or a remedy's compile, is read back
    if args.sweep:
        print(target.label)
        print(report.sweep_table(plan.sweep(cfg, target)))
        return 0
    result = plan.plan(cfg, target)
    print(json.dumps(report.as_json(result, args.top), indent=2) if args.json else report.report(result, args.top))
    return 0 if result.fits else 3


def _checkpoints(args) -> None:
    import json

    from podtrain.train.checkpoint import describe
    from podtrain.train.run import Run

    rows = describe(Run.at(args.run_dir).checkpoint_dir)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        if row.get("set_aside"):
            print(f"{row['step']:>12}  set aside as damaged")
        else:
            state = "verified" if row["verified"] else f"DAMAGED: {row['problem']}"
            print(
                f"{row['step']:>12}  {row['time']}  {row['bytes'] / 2**20:9.2f} MiB  {row['digest'] or '-':16}  {state}"
            )


def _plot(args) -> None:
    from podtrain.tools.plot import plot_runs

    print(f"[podtrain] wrote {plot_runs(args.run_dirs, args.out)}")


class _Alias(argparse.Action):
    """Collects setup-guide flags such as --batch-size into args.flags."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.flags[option_string] = value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="podtrain", description="One config, any device: JAX training from a laptop CPU to a TPU pod."
    )
    sub = p.add_subparsers(dest="command", required=True)
    _add_job_commands(sub)
    add_data_commands(sub)
    add_launch_command(sub, _launch)
    add_generate_command(sub)
    _add_convert_command(sub)
    _add_plan_command(sub)
    _add_run_commands(sub)
    p.set_defaults(commands=tuple(sub.choices))
    return p


def _add_job_commands(sub) -> None:
    """train, doctor and profile: a config and its overrides."""
    t = sub.add_parser(
        "train",
        help="train (or resume) a model",
        description=(
            "Train from CONFIG.yaml (default: the embedded tiny job) with key=value overrides, e.g. train.steps=100 "
            "mesh.fsdp=2."
        ),
    )
    t.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.set_defaults(func=_train, flags={})
    for flag, key in FLAG_ALIASES.items():
        t.add_argument(flag, action=_Alias, metavar="VALUE", help=f"same as {key}=VALUE")
    t.add_argument("--use-small-model", action="store_true", help="use the model dimensions of the tiny default job")

    d = sub.add_parser("doctor", help="check that every process and device of the job can take part in an all-reduce")
    d.add_argument("config", nargs="?", help="YAML config file (its mesh and device_type are used)")
    d.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    d.set_defaults(func=_doctor)

    pr = sub.add_parser(
        "profile", help="trace a few train steps with jax.profiler and list the ops that took the longest"
    )
    pr.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    pr.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    pr.add_argument("--steps", type=int, default=3, help="steps traced, after one that compiles (default 3)")
    pr.add_argument("--top", type=int, default=10, help="ops listed (default 10)")
    pr.set_defaults(func=_profile)


def _add_convert_command(sub) -> None:
    cv = sub.add_parser(
        "convert",
        help=f"import a Hugging Face checkpoint ({known_as()}) as a run directory, or export one",
        description=(
            "--from-hf SRC RUN_DIR [key=value ...]: SRC is a folder with config.json and *.safetensors or a hub name; "
            "RUN_DIR gets config.yaml, the tokenizer and a step-0 checkpoint of the weights. --to-hf RUN_DIR OUT_DIR: "
            "what transformers' from_pretrained loads."
        ),
    )
    way = cv.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", nargs=2, metavar=("SRC", "RUN_DIR"))
    way.add_argument("--to-hf", nargs=2, metavar=("RUN_DIR", "OUT_DIR"))
    cv.add_argument(
        "--dtype",
        help="dtype of the exported weights: bfloat16, float16 or float32 (default: the dtype the run was "
        "imported in, else bfloat16)",
    )
    cv.add_argument("--adapter", action="store_true", help="--to-hf a LoRA run's adapters alone, in PEFT's format")
    cv.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides of the imported run's config (e.g. train.seq_len=1024)"
    )
    cv.set_defaults(func=_convert)


def _add_plan_command(sub) -> None:
    pn = sub.add_parser(
        "plan",
        help=(
            "compile the train step for the target hardware: memory per device, FLOPs, collectives, predicted step "
            "time; exit 3 if it does not fit"
        ),
        description=(
            "Compile CONFIG's train step ahead of time for --target (no weights, no data, no accelerator needed) and "
            "report whether it fits, "
            "its collectives and a roofline step time. A job that does not fit gets the smallest change that does "
            "(exit 3)."
        ),
    )
    pn.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    pn.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    pn.add_argument(
        "--target",
        required=True,
        help=(
            "v4-32, v5e-8, v5p-8, v6e-8 ... (compiled for the TPU via libtpu), h100, h100x8, a100x8, h200 "
            "(compiled for the GPU via JAX's CUDA plugin), cpu:N"
        ),
    )
    pn.add_argument(
        "--top",
        type=int,
        default=0,
        metavar="N",
        help="list the N operations of the compiled step that move the most bytes and do the most FLOPs",
    )
    pn.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    pn.add_argument(
        "--sweep",
        action="store_true",
        help="every mesh shape for the device count under each remat policy, fastest first",
    )
    pn.set_defaults(func=_plan)


def _add_run_commands(sub) -> None:
    """eval, checkpoints and plot: what runs left behind."""
    ev = sub.add_parser(
        "eval",
        help="score language-model runs on lm-evaluation-harness tasks (--tasks), or HRM/TRM runs on their test set",
        description=(
            "With --tasks: each language model's RUN on lm-eval's tasks (or your YAML tasks under --include-path), "
            "a table printed and RUN/eval/STEP/results.json written (docs/evaluation.md). Without: the test accuracy "
            "of HRM/TRM runs at each halt_max_steps, pooled over seeds."
        ),
    )
    ev.add_argument("runs", nargs="+", metavar="RUN", help="a run_dir; with --seeds, one containing {seed}")
    ev.add_argument("--tasks", metavar="T,T,...", help="lm-eval tasks, groups or tags (e.g. hellaswag,arc_easy)")
    ev.add_argument("--limit", type=int, metavar="N", help="--tasks: the first N documents of each task (default: all)")
    ev.add_argument("--num-fewshot", type=int, metavar="K", help="--tasks: K examples before each (default: task's)")
    ev.add_argument("--batch-size", type=int, default=8, metavar="B", help="--tasks: requests per batch (default 8)")
    ev.add_argument("--include-path", metavar="DIR", help="--tasks: a folder of lm-eval task YAML files of your own")
    ev.add_argument("--halt-max-steps", metavar="H,H,...", help="segments to run (default: the run's own)")
    ev.add_argument("--seeds", metavar="S,S,...", help="one run per seed, {seed} in RUN replaced by it")
    ev.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    ev.add_argument("--out", help="PNG of the pooled plot (default: FIRST_RUN_DIR/eval_recursion_pooled.png)")
    ev.set_defaults(func=_eval)

    c = sub.add_parser(
        "checkpoints", help="list a run's checkpoints: step, time, size, digest, and whether each verifies"
    )
    c.add_argument("run_dir")
    c.add_argument("--json", action="store_true", help="one JSON list, for scripts")
    c.set_defaults(func=_checkpoints)

    pl = sub.add_parser("plot", help="PNG curves of loss, val_loss, lr and tokens/s for one or more runs")
    pl.add_argument("run_dirs", nargs="+")
    pl.add_argument("--out", help="PNG path (default: FIRST_RUN_DIR/curves.png)")
    pl.set_defaults(func=_plot)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with `key=value` overrides wherever they stand among the flags."""
    p = parser()
    args, rest = p.parse_known_args(argv)
    overrides = [item for item in rest if "=" in item and not item.startswith("-")]
    if rest != overrides or (overrides and not hasattr(args, "overrides")):
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if overrides:
        args.overrides += overrides
    if getattr(args, "config", None) and "=" in args.config:
        args.overrides.insert(0, args.config)  # `podtrain train key=value` without a file
        args.config = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command not in ("plan", "launch"):  # a plan compiles for TPUs it has not; nothing else wakes libtpu
        from podtrain.runtime.devices import hide_absent_tpu

        hide_absent_tpu()
    try:
        code = args.func(args) or 0
    except Preempted as e:
        print(f"podtrain: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:
        print("podtrain: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the user's to fix: podtrain's errors, and a bucket's, whatever raised them
        if (error := e if isinstance(e, PodtrainError) else storage.explain(e)) is None:
            raise
        print(f"podtrain: error: {error}", file=sys.stderr)
        return error.exit_code
    if peers := sys.modules.get("podtrain.runtime.peers"):  # a command that joined other processes
        peers.leave()  # every one of them got this far: they leave together
    return code
