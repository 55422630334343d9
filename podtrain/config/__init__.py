"""The config: `schema` (the keys, their types, defaults and valid values; imports nothing of
podtrain but its errors) and `load` (YAML, environment, flags and overrides into a checked config,
with `auto` values resolved; it sits above the models and the data it asks about)."""
