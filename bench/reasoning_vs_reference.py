"""HRM and TRM trained by podtrain and by their reference code, side by side on the same puzzles.

    python bench/reasoning_vs_reference.py --references DIR [--models hrm,trm_att,trm_mlp]
        [--seeds 0,1,2] [--data data/sudoku-easy] [--out runs/reasoning_vs_reference] [key=value ...]
    python bench/reasoning_vs_reference.py --references DIR --tiny [--record FILE]

DIR holds clones of the reference code: DIR/HRM (github.com/sapientinc/HRM) and
DIR/TinyRecursiveModels (github.com/SamsungSAILMontreal/TinyRecursiveModels). Nothing of them is
copied here: their model, loss head (ACTLossHead) and sparse-embedding sign-SGD are imported from
the clones and run on CPU in float32 without torch.compile. Two pieces need CUDA there and are
stood in for: HRM's flash-attention call (by PyTorch's scaled_dot_product_attention, as TRM's own
code does) and the fused `adam_atan2` kernel (by `AdamATan2` below, that package's reference
formula in PyTorch). The reference loop (`reference_step`) is their `train_batch`: one segment per
step, the summed loss over the global batch, both optimizers on the warmup-cosine schedule.

Both sides train each recipe (configs/hrm_sudoku_tiny.yaml, trm_att_sudoku_tiny.yaml,
trm_sudoku_tiny.yaml) with its hyper-parameters, read the same batches in the same order (podtrain's
shuffle for the seed), start from their own initialisation for the seed, and are evaluated every
`--eval-every` steps on the whole test set, all halt_max_steps segments, as the references
evaluate: cell accuracy (all 81 cells, givens included) and exact accuracy. Output: a table of the
final accuracies (mean, min, max over seeds per side), a CSV of the curves and a plot in --out.

--tiny starts the reference from podtrain's initial weights (copied across) and runs a few steps of
each model on the same batches, without exploration, printing both sides' losses: equal to
float32 rounding when the two implement the same training. --record writes the reference's
losses to FILE (tests/data/reference_tiny.json), which tests/test_reference_parity.py holds
podtrain's to.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import jax
import numpy as np
from podtrain.data import sudoku
from podtrain.models.recursive import INIT_KEY
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.tasks.puzzles import split
from podtrain.runtime.mesh import build_mesh

ROOT = Path(__file__).parent.parent
RECIPES = {
    "hrm": ("hrm_sudoku_tiny.yaml", "HRM", "models.hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1"),
    "trm_att": (
        "trm_att_sudoku_tiny.yaml",
        "TinyRecursiveModels",
        "models.recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1",
    ),
    "trm_mlp": (
        "trm_sudoku_tiny.yaml",
        "TinyRecursiveModels",
        "models.recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1",
    ),
}
# The easy generated puzzles of the CPU recipes (their header comment).
EASY = {"n_train": 250, "n_test": 128, "givens": 45, "min_rating": 0, "copies": 7, "seed": 0}
# --tiny: 4 steps at batch 8 on 16 puzzles, exploration off so both sides halt alike.
TINY = ["train.batch_size=8", "model.halt_exploration_prob=0", "train.warmup_steps=2", "train.steps=4"]
TINY_PUZZLES = {"n_train": 16, "n_test": 8, "givens": 45, "min_rating": 0, "copies": 1, "seed": 0}


# ---------------------------------------------------------------- podtrain's side


def podtrain_job(model: str, seed: int, data: Path, overrides: list[str]):
    recipe = RECIPES[model][0]
    cfg = load_config(
        ROOT / "configs" / recipe,
        ["device_type=cpu", "model.compute_dtype=float32", f"data.path={data}", f"seed={seed}", *overrides],
    )
    return cfg, build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))


def batch_rows(job, step: int) -> np.ndarray:
    """The rows (batch, 1 + 81 + 81) podtrain's train step reads at `step`: the shared data."""
    return np.asarray(job.task.batches[step])[0]


def train_podtrain(cfg, job, eval_every: int, on_eval) -> list[float]:
    state, losses = job.init_state(cfg.seed), []
    for step in range(cfg.train.steps):
        state, metrics = job.step(state, job.task.batches[step])
        losses.append(float(metrics["loss"]))
        if on_eval and ((step + 1) % eval_every == 0 or step + 1 == cfg.train.steps):
            evals = job.evaluate(state.get("ema", state["params"]))
            on_eval(step + 1, evals["val_cell_accuracy"], evals["val_exact_accuracy"])
    return losses


# ---------------------------------------------------------------- the reference's side


class AdamATan2:
    """The `adam-atan2` package's optimizer (HRM and TRM's), in PyTorch for CPU: its reference
    formula with decoupled weight decay, p <- p (1 - lr wd) - lr atan2(m_hat, sqrt(v_hat))."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float):
        import torch

        self.torch = torch
        self.param_groups = [{"params": list(params), "lr": lr, "betas": betas, "weight_decay": weight_decay}]
        self.state: dict = {}

    def step(self) -> None:
        torch = self.torch
        with torch.no_grad():
            for group in self.param_groups:
                (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    s = self.state.setdefault(p, {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
                    s["step"] += 1
                    p.mul_(1 - lr * wd)
                    s["m"].lerp_(p.grad, 1 - b1)
                    s["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    denom = s["v"].sqrt() / math.sqrt(1 - b2 ** s["step"])
                    p.add_(torch.atan2(s["m"] / (1 - b1 ** s["step"]), denom), alpha=-lr)

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def _stand_ins() -> None:
    """flash_attn for HRM's attention call: (batch, seq, heads, head_dim) in and out."""
    import torch.nn.functional as F

    def flash_attn_func(q, k, v, causal=False):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    sys.modules["flash_attn"] = types.SimpleNamespace(flash_attn_func=flash_attn_func)


@contextlib.contextmanager
def reference_code(repo: Path):
    """Import path set to one reference clone; both name their package `models`, so the modules of
    the other are dropped first."""
    if not (repo / "models").is_dir():
        raise SystemExit(f"{repo} is not a clone of the reference code (no models/ folder); see --references")
    _stand_ins()
    for name in [n for n in sys.modules if n == "models" or n.startswith("models.")]:
        del sys.modules[name]
    sys.path.insert(0, str(repo))
    try:
        yield
    finally:
        sys.path.remove(str(repo))


def reference_model(cfg, identifier: str):
    """The reference's ACT model with its loss head, for podtrain's config."""
    import importlib

    from podtrain.models.recursive import _swiglu_width

    m, t = cfg.model, cfg.train
    if m.d_ff != _swiglu_width(m.d_model):
        raise SystemExit(
            f"the references' SwiGLU is {_swiglu_width(m.d_model)} wide at d_model={m.d_model}, not {m.d_ff}"
        )
    module, name = identifier.split("@")
    model_cls = getattr(importlib.import_module(module), name)
    arch = dict(
        batch_size=t.batch_size,
        seq_len=m.max_seq_len,
        puzzle_emb_ndim=m.d_model,
        num_puzzle_identifiers=m.num_puzzle_ids,
        vocab_size=m.vocab_size,
        H_cycles=m.H_cycles,
        L_cycles=m.L_cycles,
        H_layers=getattr(m, "H_layers", 0),
        L_layers=m.L_layers,
        hidden_size=m.d_model,
        expansion=4,
        num_heads=m.n_heads,
        pos_encodings="none" if m.mlp_t else "rope",
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        halt_max_steps=m.halt_max_steps,
        halt_exploration_prob=m.halt_exploration_prob,
        forward_dtype="float32",
        causal=False,
    )
    if m.name == "trm":
        arch.update(mlp_t=m.mlp_t, puzzle_emb_len=m.puzzle_emb_len, no_ACT_continue=m.no_ACT_continue)
    ACTLossHead = importlib.import_module("models.losses").ACTLossHead  # noqa: N806
    return ACTLossHead(model_cls(arch), loss_type="stablemax_cross_entropy")


def reference_optimizers(cfg, model):
    from models.sparse_embedding import CastedSparseEmbeddingSignSGD_Distributed

    t = cfg.train
    main = AdamATan2(model.parameters(), lr=0, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    if t.puzzle_emb_lr == 0:
        raise SystemExit("the references train the puzzle embedding by sign-SGD: set train.puzzle_emb_lr")
    sign_sgd = CastedSparseEmbeddingSignSGD_Distributed(
        model.model.puzzle_emb.buffers(), world_size=1, lr=0, weight_decay=t.puzzle_emb_weight_decay
    )
    return [(sign_sgd, t.puzzle_emb_lr), (main, t.lr)]


def reference_lr(cfg, base_lr: float, step: int) -> float:
    """The references' warmup-cosine schedule at their step count (1 at the first step)."""
    t = cfg.train
    if step < t.warmup_steps:
        return base_lr * step / max(1, t.warmup_steps)
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return base_lr * (t.min_lr_ratio + max(0.0, (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))))


def torch_batch(rows: np.ndarray) -> dict:
    import torch

    ids, inputs, labels = split(rows)
    return {
        "inputs": torch.as_tensor(np.asarray(inputs), dtype=torch.int32),
        "labels": torch.as_tensor(np.asarray(labels), dtype=torch.int64),
        "puzzle_identifiers": torch.as_tensor(np.asarray(ids), dtype=torch.int32),
    }


def reference_step(cfg, model, optimizers, carry, batch: dict, step: int):
    """One step of the references' train_batch: (carry, loss as podtrain reports it)."""
    if carry is None:
        carry = model.initial_carry(batch)
    carry, loss, _, _, _ = model(carry=carry, batch=batch, return_keys=[])
    batch_size = len(batch["inputs"])
    ((1 / batch_size) * loss).backward()
    for optimizer, base_lr in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(cfg, base_lr, step + 1)
        optimizer.step()
        optimizer.zero_grad()
    return carry, float(loss) / batch_size


def reference_evaluate(model, test_rows: np.ndarray, batch_size: int) -> tuple[float, float]:
    """(cell, exact accuracy) over the test rows, all halt_max_steps segments, as their evaluate()."""
    import torch

    model.eval()
    cells, exact = [], []
    with torch.inference_mode():
        for start in range(0, len(test_rows), batch_size):
            batch = torch_batch(test_rows[start : start + batch_size])
            carry = model.initial_carry(batch)
            while True:
                carry, _, _, outputs, finished = model(carry=carry, batch=batch, return_keys=["logits"])
                if finished:
                    break
            correct = outputs["logits"].argmax(-1) == carry.current_data["labels"]
            cells += correct.float().mean(-1).tolist()
            exact += correct.all(-1).float().tolist()
    model.train()
    return float(np.mean(cells)), float(np.mean(exact))


def train_reference(cfg, job, identifier: str, eval_every: int, on_eval, test_rows, params=None) -> list[float]:
    import torch

    torch.manual_seed(cfg.seed)
    model = reference_model(cfg, identifier)
    if params is not None:
        load_podtrain_weights(model.model.inner, params, cfg.model)
    optimizers, carry, losses = reference_optimizers(cfg, model), None, []
    for step in range(cfg.train.steps):
        carry, loss = reference_step(cfg, model, optimizers, carry, torch_batch(batch_rows(job, step)), step)
        losses.append(loss)
        if on_eval and ((step + 1) % eval_every == 0 or step + 1 == cfg.train.steps):
            on_eval(step + 1, *reference_evaluate(model, test_rows, cfg.train.batch_size))
    return losses


def load_podtrain_weights(inner, params, m) -> None:
    """podtrain's params into the reference's modules (its Linear weights are (out, in))."""
    import torch

    def put(target, value):
        with torch.no_grad():
            target.copy_(torch.as_tensor(np.asarray(value, np.float32)))

    def mlp(module, p, i):
        put(module.gate_up_proj.weight, np.concatenate([p["w_gate"][i], p["w_up"][i]], axis=1).T)
        put(module.down_proj.weight, p["w_down"][i].T)

    def stack(level, p):
        for i, block in enumerate(level.layers):
            mlp(block.mlp, p["mlp"], i)
            if "token_mlp" in p:
                mlp(block.mlp_t, p["token_mlp"], i)
                continue
            a = p["attn"]
            d = a["wq"].shape[1]
            qkv = [a[w][i].reshape(d, -1) for w in ("wq", "wk", "wv")]
            put(block.self_attn.qkv_proj.weight, np.concatenate(qkv, axis=1).T)
            put(block.self_attn.o_proj.weight, a["wo"][i].reshape(-1, d).T)

    put(inner.embed_tokens.embedding_weight, params["embed"])
    put(inner.lm_head.weight, params["head"].T)
    put(inner.q_head.weight, params["q_head"].T)
    put(inner.q_head.bias, params["q_bias"])
    put(inner.puzzle_emb.weights, params["puzzle_emb"])
    starts = jax.random.truncated_normal(jax.random.key(INIT_KEY), -2.0, 2.0, (2, m.d_model)) / 0.8796
    put(inner.H_init, starts[0])
    put(inner.L_init, starts[1])
    if m.name == "hrm":
        stack(inner.H_level, params["high"]["layers"])
        stack(inner.L_level, params["low"]["layers"])
    else:
        stack(inner.L_level, params["net"]["layers"])


# ---------------------------------------------------------------- the comparisons


def podtrain_tiny(model: str, data: Path) -> tuple:
    """(config, job, initial params, losses) of podtrain's side of --tiny."""
    cfg, job = podtrain_job(model, 0, data, TINY)
    params = jax.device_get(job.init_state(cfg.seed)["params"])
    return cfg, job, params, train_podtrain(cfg, job, 0, None)


def tiny(references: Path, data: Path, record: Path | None) -> dict:
    """A few steps of each model from the same weights on both sides; returns the losses."""
    import torch

    torch.set_num_threads(2)
    result = {"overrides": TINY, "puzzles": TINY_PUZZLES, "references": {}, "losses": {}}
    for model, (_, repo, identifier) in RECIPES.items():
        cfg, job, params, ours = podtrain_tiny(model, data)
        with reference_code(references / repo):
            theirs = train_reference(cfg, job, identifier, 0, None, None, params)
        result["references"][repo] = _commit(references / repo)
        result["losses"][model] = {"podtrain": ours, "reference": theirs}
        print(f"{model:8} podtrain  " + " ".join(f"{x:.6f}" for x in ours))
        print(f"{'':8} reference " + " ".join(f"{x:.6f}" for x in theirs))
    if record:
        kept = {**result, "losses": {k: v["reference"] for k, v in result["losses"].items()}}
        record.write_text(json.dumps(kept, indent=1) + "\n")
    return result


def _commit(repo: Path) -> str:
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def compare(references, data: Path, models: list[str], seeds: list[int], eval_every: int, out: Path, overrides, sides):
    import torch

    torch.set_num_threads(2)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    test_rows = sudoku.load(data, "test").rows()
    for model in models:
        _, repo, identifier = RECIPES[model]
        for seed in seeds:
            for side in sides:
                cfg, job = podtrain_job(model, seed, data, overrides)
                if len(job.task.eval_batches) * cfg.train.batch_size != len(test_rows):
                    raise SystemExit(f"set train.eval_batches to cover the {len(test_rows)} test puzzles once")

                def on_eval(step, cell, exact, side=side, seed=seed, model=model):
                    rows.append(
                        {"model": model, "side": side, "seed": seed, "step": step, "cell": cell, "exact": exact}
                    )
                    print(
                        f"{model:8} {side:9} seed {seed}  step {step:4}  cell {cell:.3f}  exact {exact:.3f}", flush=True
                    )

                start = time.perf_counter()
                if side == "podtrain":
                    train_podtrain(cfg, job, eval_every, on_eval)
                else:
                    with reference_code(references / repo):
                        train_reference(cfg, job, identifier, eval_every, on_eval, test_rows)
                print(f"{model:8} {side:9} seed {seed}  {time.perf_counter() - start:.0f} s", flush=True)
    with open(out / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(table(rows))
    plot(rows, out / "curves.png")


def table(rows: list[dict]) -> str:
    """Final cell and exact accuracy per model and side: mean [min, max] over seeds."""
    lines = [
        "| model | side | seeds | cell accuracy: mean [min, max] | exact accuracy: mean [min, max] |",
        "|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        for side in dict.fromkeys(r["side"] for r in rows):
            mine = [r for r in rows if r["model"] == model and r["side"] == side]
            last = max(r["step"] for r in mine)
            final = [r for r in mine if r["step"] == last]
            cell, exact = ([r[k] for r in final] for k in ("cell", "exact"))
            lines.append(
                f"| {model} | {side} | {len(final)} | {np.mean(cell):.3f} [{min(cell):.3f}, {max(cell):.3f}] "
                f"| {np.mean(exact):.3f} [{min(exact):.3f}, {max(exact):.3f}] |"
            )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        for row, key in enumerate(("cell", "exact")):
            ax = axes[row][col]
            for side, color in (("podtrain", "tab:blue"), ("reference", "tab:orange")):
                for seed in dict.fromkeys(r["seed"] for r in rows):
                    run = [r for r in rows if r["model"] == model and r["side"] == side and r["seed"] == seed]
                    label = side if seed == rows[0]["seed"] else None
                    ax.plot([r["step"] for r in run], [r[key] for r in run], color=color, alpha=0.7, label=label)
            ax.set_title(f"{model}: held-out {key} accuracy")
            ax.set_xlabel("step")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def easy_puzzles(path: Path) -> Path:
    if not (path / "train").exists():
        sudoku.build(path, "generate", **EASY)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--references", type=Path, help="DIR with HRM/ and TinyRecursiveModels/")
    parser.add_argument("--sides", default="podtrain,reference", help="podtrain alone: key=value changes its recipe")
    parser.add_argument("--models", default=",".join(RECIPES))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "sudoku-easy")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "reasoning_vs_reference")
    parser.add_argument("--tiny", action="store_true", help="a few steps from the same weights, losses side by side")
    parser.add_argument("--record", type=Path, help="with --tiny: write the reference's losses here")
    parser.add_argument("overrides", nargs="*", help="key=value for every recipe, on both sides")
    args = parser.parse_args()
    if args.tiny:
        if args.references is None:
            parser.error("--tiny runs the reference code: give --references DIR")
        with tempfile.TemporaryDirectory() as tmp:
            sudoku.build(Path(tmp), "generate", **TINY_PUZZLES)
            tiny(args.references, Path(tmp), args.record)
        return
    data = easy_puzzles(args.data)
    models, seeds = args.models.split(","), [int(s) for s in args.seeds.split(",")]
    sides = args.sides.split(",")
    if "reference" in sides and args.references is None:
        parser.error("--references DIR is needed to run the reference code")
    compare(args.references, data, models, seeds, args.eval_every, args.out, args.overrides, sides)


if __name__ == "__main__":
    main()
