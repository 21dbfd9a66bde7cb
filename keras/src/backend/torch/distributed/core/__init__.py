"""The job and its values: what every distribution stands on.

- `runtime`: the process group, world size and torch version, the
  distribution in effect, debug logs.
- `layouts`: Keras meshes and layouts as torch meshes and DTensor
  placements, and the sharding rules shared by the other packages.
- `variables`: variables created, assigned and read under a distribution.
- `layout_rules`: which `LayoutMap` rule lays out each variable.
- `collectives`: `all_reduce` / `all_gather` over a named mesh axis.
- `local_state`: replicated state updated on its local values.
- `random_draws`, `generator_states`: random numbers drawn by position,
  the same on any layout; the global generators' states.
- `summary`: what a distribution stores on this process.
"""
