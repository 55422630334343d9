"""`podtrain doctor`: the smoke test before a long run, on the job's own config and devices, from
every process. One line per check, ✓ or ✗ with its numbers; a ✗ names the fix, and any ✗ makes
the command exit 2.

    devices      what each process found: kind, count, memory
    data         one batch of the configured source: its shape and token range
    train step   a few steps on that one batch at the peak learning rate: the loss finite and falling
    grad sync    the sharded step's update against a one-device step's on the same batch and weights
                 (or, for a model too big for one device, every copy of a replicated shard alike)
    checkpoint   save, restore and compare the bits, in a scratch folder of the checkpoint directory
    all-reduce   a sum over every device of the mesh, with its time

Every process runs each check and the processes agree on its result before the next one, so
that a check failing on one host only fails everywhere, and no process goes on to a collective
the others skip. Process 0 prints the lines; a process where a check failed prints its own.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time
import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podtrain import runtime
from podtrain.config.parallel import MeshConfig
from podtrain.config.schema import Config
from podtrain.errors import ChecksFailed, PodtrainError, first_line
from podtrain.program.job import Job, build
from podtrain.program.memory import global_bytes, size
from podtrain.program.prepare import final
from podtrain.runtime import devices as devices_lib
from podtrain.runtime import mesh as mesh_lib
from podtrain.runtime.chips import device_memory
from podtrain.train.checkpoint import Checkpointer, location
from podtrain.train.digest import checksums

STEPS = 3  # train steps on the repeated batch


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


class Failed(Exception):
    """A check's finding that is not an exception of its own: what was found, and the fix."""

    def __init__(self, detail: str, fix: str):
        super().__init__(detail)
        self.detail, self.fix = detail, fix


def _others_failed(ok: bool) -> list[int]:
    """The processes where a check failed (each process reports its own)."""
    if jax.process_count() == 1:
        return [] if ok else [0]
    oks = np.asarray(multihost_utils.process_allgather(np.int32(ok))).ravel()
    return [i for i, v in enumerate(oks) if not v]


def attempt(name: str, fix: str, fn) -> tuple[Check, object]:
    """Run a check on this process, then agree with the others: (the check, what fn returned)."""
    value = None
    try:
        detail, value = fn()
        check = Check(name, True, detail)
    except Failed as e:
        check = Check(name, False, e.detail, e.fix)
    except PodtrainError as e:  # its message says what to do
        check = Check(name, False, str(e), fix)
    except Exception as e:  # noqa: BLE001 - a smoke test reports whatever breaks
        first = first_line(e, 300)
        check = Check(name, False, f"{type(e).__name__}: {first}", fix)
    failed = _others_failed(check.ok)
    if check.ok and failed:
        check = Check(name, False, f"failed on processes {failed}", f"read those processes' logs; {fix}")
    return check, value if not failed else None


def skip(name: str, needs: str) -> None:
    if jax.process_index() == 0:
        print(f"[doctor] - {name}: not run, as the {needs} check failed", flush=True)


def show(check: Check) -> None:
    if jax.process_index() == 0 or not check.ok:
        mark, fix = ("✓", "") if check.ok else ("✗", f" — fix: {check.fix}" if check.fix else "")
        print(f"[doctor] {mark} {check.name}: {check.detail}{fix}", flush=True)


def devices(rt, cfg: Config) -> tuple[str, None]:
    local = jax.local_devices(backend=rt.platform)
    return (
        f"{devices_lib.describe(rt.devices)} ({len(local)} on process {jax.process_index()} of "
        f"{jax.process_count()}, host {socket.gethostname()}), {size(device_memory(rt.devices[0]))} each; "
        f"{mesh_lib.describe(rt.mesh, cfg.mesh)}"
    ), None


def data(cfg: Config, rt) -> tuple[str, tuple]:
    job = build(cfg, rt.mesh)
    batch = job.task.batches[0]
    tokens = jax.tree.leaves(batch)[0]
    lo, hi = (int(v) for v in jax.device_get(jax.jit(lambda x: (x.min(), x.max()))(tokens)))
    if hi >= cfg.model.vocab_size or lo < 0:
        raise Failed(
            f"token ids {lo}..{hi} outside the vocabulary of {cfg.model.vocab_size}",
            "set model.vocab_size=auto or above the largest id",
        )
    shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in jax.tree.leaves(batch))
    return f"{cfg.data.source}: batch {shapes}, token ids {lo}..{hi} of {cfg.model.vocab_size}", (job, batch)


def at_peak_lr(job: Job, cfg: Config) -> dict:
    """A fresh state whose step is at the end of warmup: the first update is the learning rate's full size."""
    state = job.init_state(cfg.seed)
    return {**state, "step": jax.device_put(jnp.int32(cfg.train.warmup_steps), state["step"].sharding)}


def train_step(job: Job, cfg: Config, batch, gather: bool) -> tuple[str, tuple]:
    """STEPS steps on one batch; with `gather`, the weights before and after the first on every host."""
    state = at_peak_lr(job, cfg)
    before = multihost_utils.process_allgather(state["params"], tiled=True) if gather else None
    losses, seconds, after = [], [], None
    for i in range(STEPS):
        clock = time.perf_counter()
        state, metrics = job.step(state, batch)
        losses.append(float(metrics["loss"]))
        seconds.append(time.perf_counter() - clock)
        if i == 0 and gather:
            after = (multihost_utils.process_allgather(state["params"], tiled=True), float(metrics["grad_norm"]))
    shown = " -> ".join(f"{loss:.4f}" for loss in losses)
    if not np.isfinite(losses).all():
        raise Failed(f"loss {shown}", "lower train.lr, or check the data and model.compute_dtype")
    if not losses[-1] < losses[0]:
        raise Failed(f"loss {shown} does not fall on a repeated batch", "raise train.lr or check the loss and data")
    timing = f"first step {seconds[0]:.2f} s (compiling), then {statistics.mean(seconds[1:]) * 1e3:.1f} ms"
    return f"loss {shown} over {STEPS} steps on one batch; {timing}", (state, before, after)


def one_device_update(cfg: Config, batch, before) -> tuple:
    """(params, grad norm) after one step of a one-device copy of the job on the whole batch."""
    one = dataclasses.replace(cfg, mesh=MeshConfig(data=1, fsdp=1, tensor=1))
    mesh = mesh_lib.build_mesh(one.mesh, jax.local_devices()[:1])
    job = build(final(one, mesh.devices.flat[0].platform, mesh, compiles=False), mesh, data=False)
    state = at_peak_lr(job, one)
    whole = np.asarray(multihost_utils.process_allgather(batch, tiled=True))
    state, metrics = job.step(state, jax.device_put(whole, job.task.train_batch.sharding))
    return jax.device_get(state["params"]), float(metrics["grad_norm"])


def _norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))


def fits_one_device(job: Job, rt) -> bool:
    """Whether a one-device copy of the job's state leaves a device half its memory for the step."""
    return global_bytes(job.abstract_state) <= device_memory(rt.devices[0]) / 2


def grad_sync(cfg: Config, rt, batch, trained) -> tuple[str, None]:
    state, before, after = trained
    if after is None:
        return replicas_agree(state["params"]), None
    (sharded, grad_norm), n = after, rt.mesh.devices.size
    alone, alone_norm = one_device_update(cfg, batch, before)
    update = _norm(jax.tree.map(np.subtract, alone, before))
    error = _norm(jax.tree.map(np.subtract, sharded, alone)) / max(update, 1e-30)
    detail = (
        f"the {n}-device step's update equals a 1-device step's to {error:.1e} of its size; "
        f"gradient norm {grad_norm:.6g} vs {alone_norm:.6g}"
    )
    tolerance = 1e-3 if cfg.model.compute_dtype == "float32" else 5e-2
    if not error < tolerance:
        raise Failed(detail, "the sharded step computes other gradients: check the mesh and the sharding rules")
    return detail, None


def replicas_agree(params) -> str:
    """Wherever devices, of any process, hold copies of one shard, the copies have the same bits."""
    digests = [  # (leaf and shard index, digest of the bits) of each shard this process holds
        (zlib.crc32(f"{i}{shard.index}".encode()), zlib.crc32(np.asarray(shard.data).tobytes()))
        for i, x in enumerate(jax.tree.leaves(params))
        for shard in x.addressable_shards
    ]
    table = np.asarray(multihost_utils.process_allgather(np.array(digests, np.int64))).reshape(-1, 2)
    copies: dict[int, list[int]] = {}
    for shard, digest in table.tolist():
        copies.setdefault(shard, []).append(digest)
    held = [d for d in copies.values() if len(d) > 1]
    differ = sum(len(set(d)) > 1 for d in held)
    detail = f"{sum(map(len, held))} copies of {len(held)} replicated shards after {STEPS} steps, {differ} differing"
    if differ:
        raise Failed(detail, "the replicas diverged: check the hosts' devices and interconnect")
    return detail + " (the state is too big for a one-device reference step)"


def checkpoint(cfg: Config, state: dict) -> tuple[str, None]:
    folder = epath.Path(location(cfg.checkpoint_dir))
    existed, made = folder.exists(), folder  # made: the outermost folder the check creates, removed after it
    while not made.parent.exists() and made.parent != made:
        made = made.parent
    scratch = folder / "doctor"
    checkpointer = Checkpointer(scratch, 1, cfg.checkpoint.async_save)
    try:
        clock = time.perf_counter()
        checkpointer.save(state)
        checkpointer.wait()
        saved = time.perf_counter() - clock
        abstract = {
            k: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), v)
            for k, v in state.items()
            if k != "step"
        }
        clock = time.perf_counter()
        restored = checkpointer.restore(abstract)
        loaded = time.perf_counter() - clock
    finally:
        checkpointer.close()
        multihost_utils.sync_global_devices("podtrain doctor: checkpoint read") if jax.process_count() > 1 else None
        if jax.process_index() == 0:
            (scratch if existed else made).rmtree(missing_ok=True)
    items = [k for k in state if k != "step"]
    if checksums({k: state[k] for k in items}) != checksums({k: restored[k] for k in items}):
        raise Failed("the restored arrays differ from the saved ones", "check the storage of checkpoint.dir")
    return (
        f"{size(global_bytes(abstract))} saved in {saved:.2f} s and restored in {loaded:.2f} s under {scratch}, "
        "bits equal"
    ), None


def all_reduce(mesh: Mesh, repeats: int = 10) -> tuple[str, None]:
    """Sum over all devices of (owning process index + 1), against the expected sum, and its median time."""
    devices = mesh.devices.ravel()
    x = jax.make_array_from_callback(
        (devices.size,),  # one element per device
        NamedSharding(mesh, PartitionSpec(mesh.axis_names)),
        lambda _: np.full((1,), jax.process_index() + 1.0, np.float32),
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    result = float(total(x))  # also compiles
    times = []
    for _ in range(repeats):
        clock = time.perf_counter()
        jax.block_until_ready(total(x))
        times.append(time.perf_counter() - clock)
    expected = float(sum(d.process_index + 1 for d in devices))
    median = statistics.median(times)
    detail = f"sum over {devices.size} devices = {result:g} (expected {expected:g}) in {median * 1e3:.2f} ms"
    if result != expected:
        raise Failed(detail, "check the hosts' devices and interconnect")
    return detail, None


def doctor(cfg: Config) -> None:
    rt = runtime.start(cfg, announce=False)
    cfg = final(cfg, rt.platform, rt.mesh, compiles=False)
    results = []

    def run(name, fix, fn, *args):
        check, value = attempt(name, fix, lambda: fn(*args))
        show(check)
        results.append(check)
        return value

    run("devices", "check device_type and the hosts' drivers", devices, rt, cfg)
    found = run("data", "check data.source and data.path", data, cfg, rt)
    job, batch = found if found else (build(cfg, rt.mesh, data=False), None)
    trained = None
    if batch is not None:
        trained = run(
            "train step", "check the model and train keys", train_step, job, cfg, batch, fits_one_device(job, rt)
        )
    else:
        skip("train step", "data")
    if trained is not None:
        run("grad sync", "check the mesh", grad_sync, cfg, rt, batch, trained)
    else:
        skip("grad sync", "train step")
    state = trained[0] if trained else job.init_state(cfg.seed)
    run(
        "checkpoint",
        "make checkpoint.dir writable from every process (a shared filesystem or bucket on a pod)",
        checkpoint,
        cfg,
        state,
    )
    run("all-reduce", "check the hosts' devices and interconnect", all_reduce, rt.mesh)
    failed = [c.name for c in results if not c.ok]
    if failed:
        raise ChecksFailed(
            f"{len(failed)} of {len(results)} checks failed ({', '.join(failed)}); fix them as their lines say, "
            "then run `podtrain doctor` again."
        )
    if rt.is_main:
        count = jax.process_count()
        print(f"[doctor] all {len(results)} checks passed, {count} process{'es' * (count > 1)}", flush=True)
