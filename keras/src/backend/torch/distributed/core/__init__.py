"""The job and its values: what every distribution stands on.

`runtime` (process group, torch version, distribution), `layouts` (Keras
layouts as torch meshes and placements), `variables`, `layout_rules` (which
`LayoutMap` rule lays out a variable), `collectives` (over a named mesh axis),
`local_state` (replicated state updated locally), `random_draws` (the same on
any layout), `generator_states`, `summary` (what this process stores).
"""
