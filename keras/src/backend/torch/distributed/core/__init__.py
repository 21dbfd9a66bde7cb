"""What every distribution stands on: the job, layouts as torch meshes and
placements, variables, collectives, and random draws alike on any layout."""
