"""Recording traces from vLLM's real scheduler: offline from a workload file, or live from a running vLLM.

vLLM is an optional dependency: nothing in kvmap outside this package imports it, and this package imports
it only inside functions (`kvmap.record.engine`), so every other command works without it.
"""
