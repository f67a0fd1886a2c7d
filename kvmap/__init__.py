"""kvmap: replay vLLM scheduler-output traces through a paged-KV worker, time it, check it, explain it.

The package is layered along the data flow
``trace file -> Step records -> worker state -> BatchMappings -> KV cache -> ReplayResult -> renderers``.
Nothing here imports torch at import time: only the KV cache and the torch/Triton backends need it.
"""

__version__ = "0.1.0"
