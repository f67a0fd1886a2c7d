"""Defaults defined once: the CLI, `replay()`, `explain()`, the benchmark and the docs all read them here.

Rules: plain constants, no imports; a default that appears in help text is formatted from these names.
"""

BACKEND = "numba"  # the compiled host worker; the registry falls back to "numpy" when numba is missing
WARMUP = 2  # measured steps excluded from statistics at the start of the window
KV_HEADS = 1  # tiny default KV geometry: 1 head x 8, bfloat16 (--kv-heads 8 --head-size 128 is realistic)
KV_HEAD_SIZE = 8
KV_DTYPE = "bfloat16"
MAX_KV_EXAMPLES = 20  # located KV mismatches kept per run
STANDIN_TOKEN_ID = 0  # input id used where the trace did not record what the model sampled (counted, reported)
NSYS_TIMEOUT_S = 600.0  # seconds for `kvmap profile`'s replay under nsys, and again for `nsys stats`
