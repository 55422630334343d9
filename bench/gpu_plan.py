"""GPU plans against the GPU's compiler: the 1B recipe's step memory per device as
`plan --target CARD` compiles it here (no GPU), beside what the card's compiler allocated.

    python bench/gpu_plan.py [--target h100|h200]

The measured column is the `step memory` line of `podtrain train configs/llama_1b.yaml ...` on
one H100 80GB HBM3 or one H200 (jax 0.11.2, CUDA 13); the plan must come within 15% of each and
give the same verdict (fits / does not fit).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")  # as `podtrain plan`: no accelerator is started

from podtrain.planning import plan  # noqa: E402
from podtrain.planning import targets as hardware  # noqa: E402
from podtrain.program.load import load_config  # noqa: E402
from podtrain.runtime.chips import GiB  # noqa: E402

RECIPE = Path(__file__).parent.parent / "configs" / "llama_1b.yaml"
# overrides of the recipe, GiB per device the card's compiler allocated. The unrolled rows ran when
# unrolled layers dropped their remat: remat=none is the program they measured.
MEASURED = {
    "h100": [
        (["model.scan_unroll=1"], 29.13),
        (["model.scan_unroll=22", "model.remat=none"], 37.29),
        (["model.scan_unroll=1", "model.remat=full"], 20.70),
        (["model.scan_unroll=1", "train.batch_size=16"], 42.71),
    ],
    "h200": [(["model.scan_unroll=22", "model.remat=none"], 40.98)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100", choices=MEASURED)
    card = parser.parse_args().target
    target = hardware.target(card)
    print(target.label)
    print(f"{'overrides of llama_1b.yaml':<44} {'planned':>8} {'measured':>9} {'ratio':>6}  fits")
    worst = 0.0
    for overrides, measured in MEASURED[card]:
        p = plan.plan(load_config(RECIPE, overrides), target, remedy=False)
        planned = p.memory.total / GiB
        worst = max(worst, abs(planned / measured - 1))
        print(f"{' '.join(overrides):<44} {planned:>8.2f} {measured:>9.2f} {planned / measured:>6.3f}  {p.fits}")
    print(f"largest error: {worst:.1%} (target: within 15%)")


if __name__ == "__main__":
    main()
