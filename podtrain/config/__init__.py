"""The config: `schema` (the sections and their keys; `keys` their machinery, `parallel` the mesh,
pipeline and context sections, the mesh's keys made from `axes.MESH_AXES`) and `load` (YAML,
environment, flags and overrides into a checked config, with `auto` values resolved; it sits above
the models and the data it asks about)."""
