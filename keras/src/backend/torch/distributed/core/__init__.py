"""What every distribution stands on: the job and its process group, layouts
as torch meshes and placements, variables, collectives over a mesh axis, and
random draws that are the same on any layout."""
