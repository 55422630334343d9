"""podtrain: one config, any device — JAX training from a laptop CPU to a multi-host TPU pod."""

__version__ = "0.1.0"
