"""The runtime: where kernels run (interpreter.py), kernel files, launches and their bindings,
workspaces, the plan cache, autotuning's timings and the interpreter process."""
