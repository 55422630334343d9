"""The trainer runs each hook every N steps and after the last; the sharding rules report what
they replicate instead of splitting."""

import jax
import pytest
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import replicated
from podtrain.train.trainer import Trainer


def counting_step(state, batch):
    return {"n": state["n"] + batch}, {"batch": batch}


@pytest.mark.parametrize(
    "every,start,last,expected",
    [
        (3, 0, 10, [3, 6, 9, 10]),  # forced at the last step
        (3, 4, 9, [6, 9]),  # a resumed run keeps the global period
        (0, 0, 5, [5]),  # 0: only after the last step
        (1, 2, 5, [3, 4, 5]),
    ],
)
def test_hooks_run_every_n_steps_and_after_the_last(every, start, last, expected):
    seen, trainer = [], Trainer(counting_step)
    trainer.add_hook(lambda end: seen.append((end.done, end.last, end.metrics["batch"])), every)
    state = trainer.run({"n": 0}, iter(range(100, 200)), start, last)
    assert [done for done, _, _ in seen] == expected
    assert all(end == last for _, end, _ in seen)
    assert [batch for _, _, batch in seen] == [100 + done - start - 1 for done in expected]  # batch i for step i
    assert state["n"] == sum(range(100, 100 + last - start))


def test_hooks_run_in_order_and_an_exception_stops_the_run():
    calls, trainer = [], Trainer(counting_step)
    trainer.add_hook(lambda end: calls.append(("a", end.done)))
    trainer.add_hook(lambda end: calls.append(("b", end.done)), 2)

    def stop(end):
        if end.done == 3:
            raise RuntimeError("stop")

    trainer.add_hook(stop)
    with pytest.raises(RuntimeError):
        trainer.run({"n": 0}, iter(range(10)), 0, 10)
    assert calls == [("a", 1), ("a", 2), ("b", 2), ("a", 3)]


def test_replication_report_names_the_dimensions_a_mesh_axis_does_not_divide(small_overrides):
    cfg = load_config(None, small_overrides + ["mesh.data=1", "mesh.tensor=4", "mesh.fsdp=2"])
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:8]), data=False)
    # SMALL has 2 kv heads: tensor=4 cannot split them, so their projections stay whole on each device.
    assert any("wk" in line and "kv_heads of 2 over tensor=4" in line for line in job.replicated), job.replicated
    assert not any("heads of 4" in line for line in job.replicated)  # 4 query heads do split
    even = load_config(None, small_overrides + ["mesh.data=4", "mesh.tensor=2"])
    assert build(even, build_mesh(even.mesh, jax.devices()[:8]), data=False).replicated == []


def test_replicated_lists_each_fallback():
    mesh = build_mesh(load_config(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]).mesh, jax.devices()[:8])
    found = replicated({"w": (("embed", "mlp"), (3, 8)), "b": (("vocab",), (5,)), "ok": (("embed",), (4,))}, mesh)
    assert found == ["w: embed of 3 over fsdp=2", "b: vocab of 5 over tensor=2"]
