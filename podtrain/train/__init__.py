"""Training: sharded state, the jitted step, checkpoints, metrics and the loop that ties them."""
