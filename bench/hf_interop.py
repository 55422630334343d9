"""Hugging Face interop: the import's peak memory against loading the checkpoint whole, and
generation's tokens/s with the key/value cache against recomputing the window.

convert: writes a random bf16 Llama checkpoint of `--preset` (TinyLlama-1.1B's shape by default)
with its config.json, then in fresh processes, one after the other, (a) `podtrain convert
--from-hf` and (b) the naive reference: `safetensors.numpy.load_file` of the whole checkpoint,
then the same params placed on the device from it. Each reports its wall time and peak RSS.

generate: a random model of SmolLM-135M's shape generates `--tokens` tokens greedily with the cache
and `--tokens-no-cache` without it (the window of `--window` positions recomputed per token),
after one warm-up call each that compiles; tokens/s and the ratio.

    .venv/bin/python bench/hf_interop.py convert [--preset 1b]
    .venv/bin/python bench/hf_interop.py generate [--window 512 --tokens 300 --tokens-no-cache 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRESETS = {  # (d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab, tied)
    "1b": (2048, 22, 32, 4, 5632, 32000, False),  # TinyLlama-1.1B
    "360m": (960, 32, 15, 5, 2560, 49152, True),  # SmolLM-360M
    "135m": (576, 30, 9, 3, 1536, 49152, True),  # SmolLM-135M
    "tiny": (64, 2, 4, 2, 128, 256, False),  # for a quick look
}


def model_config(preset: str, max_seq_len: int = 2048):
    from podtrain.program.load import load_config

    d, layers, heads, kv, ff, vocab, tied = PRESETS[preset]
    keys = dict(
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=ff,
        vocab_size=vocab,
        tie_embeddings=tied,
        max_seq_len=max_seq_len,
    )
    return load_config(
        None,
        [f"model.{k}={v}" for k, v in keys.items()]
        + [f"train.seq_len={min(256, max_seq_len)}", "mesh.data=1", "model.compute_dtype=float32"],
    )


def write_checkpoint(preset: str, folder: Path) -> dict:
    """A random bf16 LlamaForCausalLM checkpoint in `folder`, tensor by tensor from podtrain's map."""
    import jax
    import ml_dtypes
    import numpy as np
    from flax import nnx
    from podtrain.interop.hf.checkpoint import _hf_shape, _names, _one
    from podtrain.interop.hf.config_json import hf_config
    from podtrain.interop.hf.families import LLAMA_TENSORS
    from podtrain.models import build_model
    from podtrain.trees import leaf_name
    from safetensors.numpy import save_file

    cfg = model_config(preset).model
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))))
    rng, tensors = np.random.default_rng(0), {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        name = leaf_name(path)
        for hf_name in _names(LLAMA_TENSORS, name, cfg.n_layers):
            tensors[hf_name] = (
                0.02 * rng.standard_normal(_hf_shape(_one(name, leaf.shape), LLAMA_TENSORS[name][1]), np.float32)
            ).astype(ml_dtypes.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, None, "bfloat16")))
    sizes = [t.size for t in tensors.values()]
    return {"params": sum(sizes), "largest_tensor_fp32_bytes": 4 * max(sizes)}


def child(argv: list[str]) -> dict:
    """Run a phase in a fresh process; its wall time and the peaks it reports on its last line."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, *argv], check=True, capture_output=True, text=True).stdout
    return {"seconds": time.perf_counter() - start, **json.loads(out.splitlines()[-1])}


def _status(key: str) -> int:
    """A /proc/self/status size in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


class AnonymousPeak(threading.Thread):
    """Samples the process's anonymous memory (its own arrays, not the pages of memory-mapped
    files, which the kernel can drop) every few milliseconds and keeps the largest."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0

    def run(self):
        while True:
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(0.003)


def naive_load(folder: str) -> None:
    """The reference: every tensor in memory first, then placed as podtrain's params."""
    import jax
    import numpy as np
    from podtrain import runtime
    from podtrain.interop.hf.checkpoint import _names
    from podtrain.interop.hf.config_json import model_keys
    from podtrain.interop.hf.families import LLAMA_TENSORS
    from podtrain.program.checks import resolve_auto
    from podtrain.program.load import load_config
    from podtrain.program.state import model_fns
    from podtrain.trees import leaf_name
    from safetensors.numpy import load_file

    keys = model_keys(json.loads((Path(folder) / "config.json").read_text()), folder)
    cfg = load_config(None, [f"model.{k}={v}" for k, v in keys.items()] + ["train.seq_len=256", "mesh.data=1"])
    rt = runtime.start(cfg, announce=False)
    fns = model_fns(resolve_auto(cfg, rt.platform), rt.mesh)
    everything = load_file(Path(folder) / "model.safetensors")
    flat = {}
    for path in (leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(fns.abstract_params)[0]):
        in_axes = LLAMA_TENSORS[path][1]
        stacked = [everything[name].astype(np.float32) for name in _names(LLAMA_TENSORS, path, cfg.model.n_layers)]
        arrays = [(t.T if in_axes else t) for t in stacked]
        flat[path] = jax.device_put(np.stack(arrays) if path.startswith("layers/") else arrays[0])
    jax.block_until_ready(list(flat.values()))


def convert(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        sizes = write_checkpoint(args.preset, folder)
        fp32 = 4 * sizes["params"]
        print(
            f"{args.preset}: {sizes['params'] / 1e9:.2f}B params, {fp32 / 2**30:.2f} GiB in float32, "
            f"largest tensor {sizes['largest_tensor_fp32_bytes'] / 2**20:.0f} MiB in float32"
        )
        baseline = child(["_baseline"])
        ours = child(["_import", str(folder), str(Path(tmp) / "run")])
        naive = child(["_naive", str(folder)])
        print(
            f"{'':38s} {'wall':>9s}   {'peak RSS':>9s}   {'peak anonymous':>14s}   "
            f"{'anonymous above baseline + model':>32s}"
        )
        for name, r in (
            ("jax + podtrain imported (baseline)", baseline),
            ("podtrain convert --from-hf", ours),
            ("load_file whole, then place", naive),
        ):
            above = (r["peak_anonymous"] - baseline["peak_anonymous"] - fp32) / 2**30
            print(
                f"{name:38s} {r['seconds']:7.1f} s   {r['peak_rss'] / 2**30:5.2f} GiB   "
                f"{r['peak_anonymous'] / 2**30:10.2f} GiB   {above:+28.2f} GiB"
            )
        print(
            f"peak anonymous memory ratio, podtrain/naive: {ours['peak_anonymous'] / naive['peak_anonymous']:.2f}; "
            f"peak RSS ratio: {ours['peak_rss'] / naive['peak_rss']:.2f}"
        )


def generate(args) -> None:
    import jax
    from podtrain.program.state import model_fns
    from podtrain.program.tasks.sampling import cached_tokens, window_tokens
    from podtrain.runtime.mesh import build_mesh

    cfg = model_config("135m", args.window)
    fns = model_fns(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    params = fns.init(jax.random.key(0))
    prompt = list(range(1, 17))
    rates = {}
    for name, fn, n in (("KV cache", cached_tokens, args.tokens), ("no cache", window_tokens, args.tokens_no_cache)):
        start = time.perf_counter()
        fn(fns, params, prompt, 2, 0.0, args.window, 0)  # compiles
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        fn(fns, params, prompt, n, 0.0, args.window, 0)
        rates[name] = n / (time.perf_counter() - start)
        print(f"{name:9s} {n:4d} tokens: {rates[name]:8.2f} tokens/s (first call with compile {compile_s:.1f} s)")
    print(
        f"ratio KV cache / no cache: {rates['KV cache'] / rates['no cache']:.1f}x  "
        f"(135M shape, window {args.window}, {jax.devices()[0].platform})"
    )


def phase(name: str, argv: list[str]) -> None:
    sampler = AnonymousPeak()
    sampler.start()
    if name == "_baseline":
        import jax
        import podtrain.interop.hf.checkpoint  # noqa: F401

        jax.devices()
    elif name == "_import":
        from podtrain.cli import main as podtrain

        assert podtrain(["convert", "--from-hf", *argv, "mesh.data=1"]) == 0
    else:
        naive_load(*argv)
    print(json.dumps({"peak_rss": _status("VmHWM"), "peak_anonymous": max(sampler.peak, _status("RssAnon"))}))


def main() -> None:
    if sys.argv[1].startswith("_"):
        return phase(sys.argv[1], sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--preset", default="1b", choices=PRESETS)
    g = sub.add_parser("generate")
    g.add_argument("--window", type=int, default=512)
    g.add_argument("--tokens", type=int, default=300)
    g.add_argument("--tokens-no-cache", type=int, default=20)
    args = p.parse_args()
    convert(args) if args.part == "convert" else generate(args)


if __name__ == "__main__":
    main()
