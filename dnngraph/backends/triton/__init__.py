"""The Triton backend: heuristics (candidate configs and their ranking), codegen (kernel source)
and lower (a group's launches), for every family."""
