"""Is loading ever the bottleneck? The loader's tokens/s alone next to the train step's, and prepare's.

Fits a byte-level BPE on the pydoc corpus, prepares `--copies` copies of it into shards (timing
prepare), then for the tiny recipe (16 x 256 tokens) and the 1B recipe's batch (8 x 2048) reads
batches through the loader alone (grain threads, then worker processes, each batch placed on the
devices as the loop does), and times the tiny recipe's train step on batches already on the device.
A 1.1B-parameter step does not fit this machine's memory with AdamW, so next to its loader rate
stands the rate one H100 would consume at 50% MFU (6N FLOPs per token at 989 TFLOP/s).

    .venv/bin/python bench/data_throughput.py [--copies 40] [--batches 40]

With `--path gs://BUCKET/DIR` (or s3://), the same shards are also copied into a bucket on a
fake-gcs-server (or moto) started on 127.0.0.1 behind a proxy that adds `--delay-ms` (20) to every
request, and the loader reads them from there at the tiny and smollm recipes' batch shapes: its
tokens/s against the local shards', side by side in this process, and the requests per batch; then
the smollm batch from a corpus larger than the block cache (a cache of one 64 KiB block), where
every row waits on a request.

    .venv/bin/python bench/data_throughput.py --path gs://bench/shards [--delay-ms 20]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from podtrain.data import tokens
from podtrain.data.prepare import prepare
from podtrain.data.sources import Corpus, pydoc_documents
from podtrain.data.tokenizer import fit_bpe
from podtrain.program.checks import resolve_auto
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.tasks.language import LanguageTask
from podtrain.runtime.devices import hide_absent_tpu
from podtrain.runtime.mesh import build_mesh

CONFIGS = Path(__file__).parent.parent / "configs"
H100_STEP_TOKENS = 0.5 * 989e12 / (6 * 1.1e9)  # tokens/s of a 1.1B step at 50% MFU


@dataclass(frozen=True)
class Repeated(Corpus):
    """The pydoc documents `copies` times: a corpus big enough to time."""

    copies: int = 1

    def documents(self):
        for _ in range(self.copies):
            yield from pydoc_documents()


def loader_rate(task, batches: int, workers: int, prefetch: int) -> float:
    """Tokens/s of reading `batches` global batches (after the first) onto the devices."""
    stream = task.batches.stream(0, batches + 1, workers, prefetch)
    jax.block_until_ready(next(stream))  # leave thread and worker start-up out
    start = time.perf_counter()
    for batch in stream:
        jax.block_until_ready(batch)
    batch_tokens = task.batches.shape[0] * task.batches.shape[1] * (task.batches.shape[2] - 1)
    return batches * batch_tokens / (time.perf_counter() - start)


def step_rate(cfg, mesh, steps: int) -> float:
    """Tokens/s of the train step alone, its batches read beforehand."""
    job = build(cfg, mesh)
    batches = [job.task.batches[i] for i in range(steps + 1)]
    state = job.init_state(cfg.seed)
    state, _ = job.step(state, batches[0])
    jax.block_until_ready(state)
    start = time.perf_counter()
    for batch in batches[1:]:
        state, _ = job.step(state, batch)
    jax.block_until_ready(state)
    return steps * job.tokens_per_step / (time.perf_counter() - start)


def bucket_against_local(work: Path, path: str, delay_ms: float, batches: int, prefetch: int, repeats: int) -> None:
    """The loader's tokens/s on shards in a bucket behind a slow proxy, against the same shards on disk."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from podtrain import storage

    from buckets import FaultyProxy, GCSServer, S3Server, point_at

    server = (GCSServer if storage.scheme(path) == "gs" else S3Server)()
    with server, FaultyProxy(server, delay=delay_ms / 1e3) as proxy:
        point_at(proxy.env)
        server.make_bucket(storage.key(path).split("/")[0])
        storage.upload(work / "tokens", path, last=("manifest.json",))
        for recipe, extra in (
            ("tiny.yaml", ["model.vocab_size=4096"]),
            ("smollm_360m.yaml", ["model.vocab_size=4096", "data.dataset_name=null"]),
        ):
            ratios, requests = [], 0.0
            for _ in range(repeats):  # local and bucket in turn: the machine's drift falls on both
                rates = {}
                for where in (str(work / "tokens"), path):
                    overrides = ["data.source=tokens", f"data.path={where}", "device_type=cpu", *extra]
                    cfg = resolve_auto(load_config(CONFIGS / recipe, overrides), "cpu")
                    task = LanguageTask(cfg, build_mesh(cfg.mesh, jax.devices()))
                    proxy.reset()
                    rates[where] = loader_rate(task, batches, workers=0, prefetch=prefetch)
                    requests = proxy.requests / (batches + 1)
                ratios.append(rates[path] / rates[str(work / "tokens")])
            print(
                f"{recipe:17} batch {cfg.train.batch_size} x {cfg.train.seq_len}: {path} (+{delay_ms:g} ms a request) "
                f"against local shards: {min(ratios):.2f}x min, {statistics.median(ratios):.2f}x median, "
                f"{max(ratios):.2f}x max of {repeats}; last local {rates[str(work / 'tokens')]:,.0f} tokens/s; "
                f"{requests:.2f} requests a batch once cached"
            )
        # A corpus larger than the block cache, as a cache of one 64 KiB block makes this one: every row
        # waits on a request; rows are read REMOTE_READERS at a time, `prefetch` batches at once.
        tokens._block = functools.lru_cache(maxsize=1)(tokens._block.__wrapped__)
        tokens.BLOCK, tokens.CACHE_BLOCKS = 1 << 16, 1
        for prefetch in (2, 8):
            overrides = ["data.source=tokens", f"data.path={path}", "device_type=cpu", "model.vocab_size=4096"]
            cfg = load_config(CONFIGS / "smollm_360m.yaml", [*overrides, "data.dataset_name=null"])
            task = LanguageTask(resolve_auto(cfg, "cpu"), build_mesh(cfg.mesh, jax.devices()))
            proxy.reset()
            rate = loader_rate(task, max(4, batches // 30), workers=0, prefetch=prefetch)
            print(
                f"smollm_360m.yaml  beyond the block cache, data.prefetch={prefetch}: {rate:,.0f} tokens/s, "
                f"{proxy.requests / (max(4, batches // 30) + 1):.0f} requests a batch"
            )


def main() -> None:
    hide_absent_tpu()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=40, help="copies of the pydoc corpus to prepare (40: about 6M tokens)")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--path", help="gs://BUCKET/DIR or s3://BUCKET/DIR: also read the shards from a loopback bucket")
    p.add_argument("--delay-ms", type=float, default=20.0, help="added to every request to the bucket")
    p.add_argument("--repeats", type=int, default=5, help="bucket against local, measured in turn")
    p.add_argument("--prefetch", type=int, default=2, help="batches read ahead, each by a thread")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="podtrain-data-bench-"))
    tokenizer = fit_bpe(pydoc_documents(), 4096, work / "tok")
    manifest = prepare(
        Repeated("pydoc", copies=args.copies), tokenizer, work / "tokens", 0.05, shard_docs=500, quiet=True
    )
    print(
        f"prepare: {manifest['documents']:,} documents, "
        f"{manifest['train_tokens'] + manifest['val_tokens']:,} tokens at {manifest['tokens_per_sec']:,.0f} tokens/s"
    )
    if args.path:
        bucket_against_local(work, args.path, args.delay_ms, args.batches, args.prefetch, args.repeats)
        return

    data = ["data.source=tokens", f"data.path={work / 'tokens'}"]
    for recipe, extra in (("tiny.yaml", ["model.vocab_size=4096"]), ("llama_1b.yaml", [])):
        cfg = resolve_auto(load_config(CONFIGS / recipe, data + extra + ["device_type=cpu"]), "cpu")
        mesh = build_mesh(cfg.mesh, jax.devices())
        task = LanguageTask(cfg, mesh)
        rates = {f"workers={w}": loader_rate(task, args.batches, w, prefetch=2) for w in (0, 2)}
        if recipe == "tiny.yaml":
            step, label = step_rate(cfg, mesh, args.steps), "train step (measured)"
        else:
            step, label = H100_STEP_TOKENS, "H100 step at 50% MFU (computed)"
        loader = "  ".join(f"{k}: {v:,.0f} tokens/s" for k, v in rates.items())
        print(
            f"{recipe:14} batch {cfg.train.batch_size} x {cfg.train.seq_len}: loader {loader}  |  "
            f"{label}: {step:,.0f} tokens/s  |  loader/step {max(rates.values()) / step:.1f}x"
        )


if __name__ == "__main__":
    main()
