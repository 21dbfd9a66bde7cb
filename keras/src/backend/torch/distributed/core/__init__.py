"""The job and its values: what every distribution stands on.

- `runtime`: process group, world size, torch version, distribution, debug logs.
- `layouts`: Keras layouts as torch meshes and placements; shared shard rules.
- `variables`: variables created, assigned and read under a distribution.
- `layout_rules`: which `LayoutMap` rule lays out each variable.
- `collectives`: `all_reduce` / `all_gather` over a named mesh axis.
- `local_state`: replicated state updated on its local values.
- `random_draws`: random numbers drawn by position, the same on any layout.
- `generator_states`: the global generators' states.
- `summary`: what a distribution stores on this process.
"""
