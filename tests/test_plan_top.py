"""`plan --top N`: the compiled step's operations that move the most bytes and do the most FLOPs,
each traced back to the model code it was made from."""

import re

from podtrain.config.load import load_config
from podtrain.planning import hlo, plan
from podtrain.planning import targets as hardware
from podtrain.runtime.mesh import build_mesh
from podtrain.train.job import build

from conftest import SMALL


def test_operations_add_up_to_the_step_and_name_their_source():
    cfg = load_config(None, SMALL + ["mesh.data=1", "model.remat=full", "train.grad_accum=2"])
    target = hardware.target("cpu:1")
    p = plan.plan(cfg, target)
    text = build(plan.for_target(cfg, target), build_mesh(cfg.mesh, target.devices), data=False).compile().as_text()
    ops = hlo.operations(text)
    assert sum(o.bytes for o in ops) == hlo.memory_traffic(text) == p.traffic
    assert sum(o.flops for o in ops) == hlo.matmul_flops(text) == p.matmul_flops
    assert p.top_bytes and p.top_flops
    for ranking, key in ((p.top_bytes, "bytes"), (p.top_flops, "flops")):
        amounts = [getattr(o, key) for o in ranking]
        assert amounts == sorted(amounts, reverse=True) and amounts[0] == max(getattr(o, key) for o in ops)
    # Every matmul comes from a model or loss file of podtrain, by its line.
    for o in p.top_flops:
        assert re.fullmatch(r"(attention|layers|llama|language)\.py:\d+", o.source), o
    assert all(o.flops > 0 for o in p.top_flops)

    # What `plan --top 3` prints: three rows of each ranking, with shares and sources.
    out = plan.report(p, top=3)
    bytes_rows = out.split("top bytes")[1].split("top flops")[0].strip().splitlines()[1:]
    flops_rows = out.split("top flops")[1].strip().splitlines()[1:]
    assert len(bytes_rows) == 3 and len(flops_rows) == 3
    for row, o in zip(bytes_rows + flops_rows, p.top_bytes[:3] + p.top_flops[:3]):
        assert row.split()[0].endswith("%") and o.source in row and row.endswith(o.name), row
    assert [op["name"] for op in plan.as_json(p, top=2)["top_flops"]] == [o.name for o in p.top_flops[:2]]
