"""Training throughput of podtrain against a PyTorch reference of the same Llama.

    python bench/throughput.py [--preset cpu|1b] [--repeats 5] [--steps 10] [--tiny] [key=value ...]
    python bench/throughput.py --scaling [--preset cpu] [key=value ...]

Both sides train the same model (dims, batch, sequence, dtype, AdamW with global-norm clipping)
on the same token windows. PyTorch runs eager on CPU and `torch.compile` with SDPA flash attention
on GPU. Each side runs in a process of its own, one after the other (an allocator keeps the memory
it grew to, so two sides in one process do not fit one 80 GB GPU at the 1b preset): `--repeats`
times `--steps` timed steps after a warmup. The script prints tokens/s of each, MFU where the
device's peak is known, and the ratio podtrain / reference of each repeat (repeat i of one side
against repeat i of the other) as min, median and max. `key=value` overrides reach podtrain's
config only (e.g. model.scan_unroll=4), for A/B runs.

`--scaling` runs podtrain alone on eight fake CPU devices: the step time per token on meshes of
all eight on one of sharding.PLAIN_AXES against one device (eight devices on the same cores: the cost of
partitioning, not a speed-up), the compile time of the train step at 4 and 32 layers, scanned and
unrolled, and the host's time per step while the device is idle (dispatching a step, placing a batch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Both frameworks share one GPU: JAX takes its memory as it needs it, not 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "--scaling" in sys.argv:  # set before JAX starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import numpy as np
import torch
import torch.nn.functional as F
from podtrain.axes import AXES, PLAIN_AXES
from podtrain.program import optim
from podtrain.program.checks import resolve_auto
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.prepare import final, prepare
from podtrain.runtime.chips import device_memory, peak_flops
from podtrain.runtime.devices import select_devices
from podtrain.runtime.mesh import build_mesh

PRESETS = {
    # The 3.3M-parameter Llama of the CPU comparison.
    "cpu": [
        "model.d_model=256",
        "model.n_layers=4",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.d_ff=768",
        "model.vocab_size=256",
        "train.batch_size=16",
        "train.seq_len=256",
        "model.compute_dtype=float32",
    ],
    "1b": ["configs/llama_1b.yaml"],
}
TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.batch_size=8",
]


def podtrain_config(preset: str, tiny: bool, overrides: list[str], resolve: bool = True):
    """The preset's config, its `auto` values resolved on this machine's devices (which starts
    them) unless `resolve` is False."""
    recipe = PRESETS[preset][0] if preset == "1b" else None
    keys = (
        [k for k in PRESETS[preset] if "=" in k]
        + (TINY if tiny else [])
        + ["train.sample_tokens=0", "compile_cache=off", *overrides]
    )
    cfg = load_config(recipe, keys)
    return resolve_auto(cfg, select_devices(cfg.device_type)[0].platform) if resolve else cfg


class PodtrainSide:
    def __init__(self, cfg, devices=None):
        self.devices = devices or select_devices(cfg.device_type)
        mesh = build_mesh(cfg.mesh, self.devices)
        ready = prepare(cfg, self.devices[0].platform, mesh, device_memory(self.devices[0]))  # as `train` does
        self.cfg, self.job, self.train_step = ready.cfg, ready.job, ready.step
        self.state = self.job.init_state(cfg.seed)
        self.batch = self.job.task.batches[0]

    def windows(self) -> np.ndarray:
        """The token windows (batch, seq + 1) of the one batch both sides train on."""
        return np.asarray(jax.device_get(self.batch))[0]

    def steps(self, n: int) -> float:
        for _ in range(n):
            self.state, metrics = self.train_step(self.state, self.batch)
        return float(metrics["loss"])


class TorchLlama(torch.nn.Module):
    """The same Llama: RMSNorm without a bias, half-split RoPE, grouped-query attention, SwiGLU."""

    def __init__(self, m):
        super().__init__()
        self.m, head_dim = m, m.d_model // m.n_heads
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.n_layers)

        def weight(*shape, s=std):
            return torch.nn.Parameter(torch.randn(*shape) * s)

        self.embed = weight(m.vocab_size, m.d_model)
        self.head = None if m.tie_embeddings else weight(m.vocab_size, m.d_model)
        self.layers = torch.nn.ModuleList()
        for _ in range(m.n_layers):
            layer = torch.nn.Module()
            layer.attn_norm, layer.mlp_norm = (
                torch.nn.RMSNorm(m.d_model, eps=m.norm_eps),
                torch.nn.RMSNorm(m.d_model, eps=m.norm_eps),
            )
            layer.wqkv = weight((m.n_heads + 2 * m.n_kv_heads) * head_dim, m.d_model)
            layer.wo = weight(m.d_model, m.d_model, s=out_std)
            layer.w_gate_up = weight(2 * m.d_ff, m.d_model)
            layer.w_down = weight(m.d_model, m.d_ff, s=out_std)
            self.layers.append(layer)
        self.norm = torch.nn.RMSNorm(m.d_model, eps=m.norm_eps)
        inv_freq = 1.0 / m.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.arange(m.max_seq_len).float()[:, None] * inv_freq[None]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rope(self, x):  # (B, H, T, hd)
        cos, sin = self.cos[: x.shape[2]], self.sin[: x.shape[2]]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, tokens):
        m, (b, t) = self.m, tokens.shape
        hd = m.d_model // m.n_heads
        x = F.embedding(tokens, self.embed)
        for layer in self.layers:
            q, k, v = F.linear(layer.attn_norm(x), layer.wqkv).split(
                [m.n_heads * hd, m.n_kv_heads * hd, m.n_kv_heads * hd], dim=-1
            )
            q, k, v = (y.view(b, t, -1, hd).transpose(1, 2) for y in (q, k, v))  # (B, H, T, hd)
            out = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True, enable_gqa=True)
            x = x + F.linear(out.transpose(1, 2).reshape(b, t, m.d_model), layer.wo)
            gate, up = F.linear(layer.mlp_norm(x), layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        return F.linear(self.norm(x), self.embed if self.head is None else self.head)


class TorchSide:
    def __init__(self, cfg, windows: np.ndarray, n_steps: int):
        m, t = cfg.model, cfg.train
        self.gpu = torch.cuda.is_available()
        device = "cuda" if self.gpu else "cpu"
        torch.manual_seed(cfg.seed)
        self.model = TorchLlama(m).to(device)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            fused=self.gpu,
        )
        lrs = np.asarray(
            jax.vmap(optim.schedule(t))(np.arange(n_steps))
        )  # podtrain's warmup and decay, looked up per step
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: lrs[min(step, n_steps - 1)] / t.lr)
        self.windows = torch.tensor(windows, dtype=torch.long, device=device)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[m.compute_dtype]
        self.grad_clip = t.grad_clip
        # Compiled on GPU: the forward and loss (their backward with them); the fused optimizer stays eager.
        self.loss = torch.compile(self.loss) if self.gpu else self.loss

    def loss(self):
        with torch.autocast(self.windows.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(self.windows[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), self.windows[:, 1:].flatten())

    def train_step(self):
        loss = self.loss()
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.schedule.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def steps(self, n: int) -> float:
        for _ in range(n):
            loss = self.train_step()
        return float(loss.detach())  # waits for the device


def timed(side, n: int) -> float:
    """Seconds per step over n steps, the last one waited for."""
    clock = time.perf_counter()
    side.steps(n)
    return (time.perf_counter() - clock) / n


def run_side(side: str, cfg, repeats: int, steps: int, warmup: int, folder: Path) -> dict:
    """One side's warmup loss, seconds per step of each repeat and description, in this process:
    podtrain writes the token windows both train on into `folder`, the reference reads them."""
    if side == "podtrain":
        devices = select_devices(cfg.device_type)
        ours = PodtrainSide(cfg, devices)
        cfg = ours.cfg
        np.save(folder / "windows.npy", ours.windows())
        peak = peak_flops(ours.devices[0])
        described = {
            "devices": f"{ours.devices[0].platform}: {len(ours.devices)} x {ours.devices[0].device_kind}",
            "dtype": f"{cfg.model.compute_dtype}, scan_unroll {cfg.model.scan_unroll}",
            "params": ours.job.setup.fns.n_params,
            "flops": ours.job.flops_per_step,
            "peak": peak * len(ours.devices) if peak else None,
        }
    else:
        ours = TorchSide(cfg, np.load(folder / "windows.npy"), warmup + repeats * steps)
        described = {
            "devices": f"PyTorch {torch.__version__} {'torch.compile' if ours.gpu else 'eager'}, "
            f"{torch.get_num_threads()} threads"
        }
    loss = ours.steps(warmup)
    return {"pid": os.getpid(), "loss": loss, "seconds": [timed(ours, steps) for _ in range(repeats)], **described}


def throughput(cfg, repeats: int, steps: int, warmup: int) -> None:
    """Each side in a process of its own (this script again, with --side), then their ratio; this
    process starts no device."""
    sides = {}
    with tempfile.TemporaryDirectory() as folder:
        for side in ("podtrain", "reference"):
            command = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--folder", folder]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"the {side} side failed:\n{done.stderr[-3000:]}")
            sides[side] = json.loads(done.stdout.splitlines()[-1])
    ours, ref = sides["podtrain"], sides["reference"]
    tokens = cfg.train.batch_size * cfg.train.seq_len
    print(
        f"{ours['devices']}; {ours['params'] / 1e6:.2f}M params, batch {cfg.train.batch_size} x "
        f"{cfg.train.seq_len}, {ours['dtype']}; podtrain in process {ours['pid']}, reference "
        f"({ref['devices']}) in process {ref['pid']} (this script: {os.getpid()})"
    )
    print(f"loss after {warmup} warmup steps: podtrain {ours['loss']:.4f}, reference {ref['loss']:.4f}")
    ratios = []
    for r, (a, b) in enumerate(zip(ours["seconds"], ref["seconds"])):
        ratios.append(b / a)
        peak = ours["peak"]
        mfu = f"  mfu {ours['flops'] / a / peak:.1%} / {ours['flops'] / b / peak:.1%}" if peak else ""
        print(
            f"repeat {r + 1}: podtrain {tokens / a:,.0f} tokens/s, "
            f"reference {tokens / b:,.0f} tokens/s{mfu}  ratio {b / a:.3f}"
        )
    print(
        f"ratio podtrain/reference: min {min(ratios):.3f}  "
        f"median {statistics.median(ratios):.3f}  max {max(ratios):.3f}"
    )


def scaling(preset: str, overrides: list[str], steps: int) -> None:
    devices = select_devices("cpu")
    print(f"cpu: {len(devices)} fake devices on {os.cpu_count()} cores; preset {preset}")
    one = None
    one_device = dict.fromkeys(AXES, 1)
    for shape in [one_device, *({**one_device, axis: 8} for axis in PLAIN_AXES)]:
        mesh = [f"mesh.{axis}={size}" for axis, size in shape.items()]
        cfg = podtrain_config(preset, False, [*overrides, *mesh])
        side = PodtrainSide(cfg, devices[: math.prod(shape.values())])
        side.steps(2)
        per_token = min(timed(side, steps) for _ in range(3)) / (cfg.train.batch_size * cfg.train.seq_len)
        one = one or per_token
        print(
            f"mesh {'x'.join(map(str, shape.values()))}: {per_token * 1e6:.1f} us/token, "
            f"{one / per_token:.2f}x one device's speed"
        )
    for unroll in ("1", "n_layers"):
        for layers in (4, 32):
            cfg = podtrain_config(
                preset,
                False,
                [*overrides, f"model.n_layers={layers}", f"model.scan_unroll={layers if unroll == 'n_layers' else 1}"],
            )
            mesh = build_mesh(cfg.mesh, devices[:1])
            job = build(final(cfg, devices[0].platform, mesh), mesh)
            clock = time.perf_counter()
            job.step.lower(job.abstract_state, job.task.batches.abstract).compile()
            print(f"compile, {layers} layers, scan_unroll={unroll}: {time.perf_counter() - clock:.1f} s")
    side = PodtrainSide(podtrain_config(preset, False, overrides), devices[:1])
    side.steps(2)
    dispatch, place = [], []
    for i in range(steps):
        jax.block_until_ready(side.state)
        clock = time.perf_counter()
        side.state, _ = side.train_step(side.state, side.batch)
        dispatch.append(time.perf_counter() - clock)
        clock = time.perf_counter()
        jax.block_until_ready(side.job.task.batches[i])
        place.append(time.perf_counter() - clock)
    print(
        f"host per step, device idle: dispatch {statistics.median(dispatch) * 1e3:.2f} ms, "
        f"reading and placing a batch {statistics.median(place) * 1e3:.2f} ms (medians of {steps})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="small dims, 1 step, 1 repeat: that it runs, not how fast")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="podtrain alone: meshes of 8 fake devices, compile time against depth, host time per step",
    )
    parser.add_argument("--side", choices=("podtrain", "reference"), help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.tiny:
        args.repeats, args.steps, args.warmup = 1, 1, 1
    if args.scaling:
        return scaling(args.preset, args.overrides, args.steps)
    cfg = podtrain_config(args.preset, args.tiny, args.overrides, resolve=bool(args.side))
    if args.side:
        print(json.dumps(run_side(args.side, cfg, args.repeats, args.steps, args.warmup, args.folder)))
    else:
        throughput(cfg, args.repeats, args.steps, args.warmup)


if __name__ == "__main__":
    main()
