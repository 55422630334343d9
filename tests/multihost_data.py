"""Run under `podtrain launch`: records which windows each process reads, and checks the global batches.

Writes OUT_DIR/process_<i>.json with the window ids this process read for each step.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from podtrain.config.parallel import MeshConfig
from podtrain.config.schema import DistributedConfig
from podtrain.data.loader import BatchReader, train_windows
from podtrain.runtime import distributed, peers
from podtrain.runtime.mesh import build_mesh
from podtrain.sharding import batch_sharding

SEQ, ACCUM, MICRO, STEPS = 4, 2, 4, 3

distributed.initialize(DistributedConfig(init_timeout=60))
mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
windows, _ = train_windows(np.arange(1000, dtype=np.int32), SEQ, ACCUM * MICRO, seed=0)
reader = BatchReader(windows, batch_sharding(mesh, leading=1), (ACCUM, MICRO, SEQ + 1), axis=1)
read = {}
for step in range(STEPS):
    read[step] = reader.ids(step).ravel().tolist()
    whole = multihost_utils.process_allgather(reader[step], tiled=True)
    expected = np.stack([windows[step * ACCUM * MICRO + i] for i in range(ACCUM * MICRO)]).reshape(
        ACCUM, MICRO, SEQ + 1
    )
    np.testing.assert_array_equal(whole, expected)
Path(sys.argv[1], f"process_{jax.process_index()}.json").write_text(json.dumps(read))
peers.leave()  # with the others: process 0 hosts the coordination service
