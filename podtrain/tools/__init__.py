"""Tools around training runs."""
