"""The column layout of the line scanner: shared by its kernels (trace/scan_kernels.py, numba) and its Python
side (trace/scan.py), which must not import numba. The kernels' machine code is compiled from this file too
(their AOT_SOURCES), so a change here rebuilds them.
"""

# column rows of `col` ([NUM_COLS, R] int32), one entry per request of the line (one KV cache group)
NEW_NC, NEW_ID_S, NEW_ID_E, NEW_TOK_OFF, NEW_TOK_LEN, NEW_FIELD, NEW_IN_S, NEW_B_OFF, NEW_B_LEN = range(9)
C_ROWS, C_NC, C_NB, C_B_OFF, C_B_LEN = 9, 10, 11, 12, 13  # cached: row, nc, has new blocks, their span
S_ROWS, S_COUNTS = 14, 15  # num_scheduled_tokens in order: a row (>= 0) or new request k as -(k + 1); count
F_ROWS, P_ROWS = 16, 17  # finished / preempted ids: rows, -1 for ids not live
SM_IDX, SM_COUNT = 18, 19  # sampled_token_ids in order: scheduler entry, tokens
MK_SCHED, MK_CACHED, MK_REMOVED = 20, 21, 22  # per row: the epoch of the scan that marked it
C_ID_S, C_ID_E, S_ID_S, S_ID_E = 23, 24, 25, 26  # byte spans of the cached and the scheduled ids in the line
SCRATCH = 27  # values read and checked, not kept (num_output_tokens)
NUM_COLS = 28
# `meta` (its first NUM_META entries): what the line holds, and the scan's cursors
M_NEW, M_CACHED, M_SCHED, M_FINISHED, M_PREEMPTED, M_SAMPLED, M_TOTAL = range(7)
M_HAS_SAMPLED, M_SM_OFF, M_SM_TOKENS, M_SM_SAME, M_REMOVED = 7, 8, 9, 10, 11
M_TPOS, M_BPOS, M_NC_N, M_NB_N, M_OUT_N = 12, 13, 14, 15, 16  # the scan's cursors and list lengths
NUM_META = 17
# then, in the same array, what trace/scan.py sets once (the scan's parameters, and where each part of the arena
# below starts: it cuts the arena, the kernel reads the cuts) and the scans' count (the epoch, which the kernel
# counts): `meta` is [META_LEN] int32 (every value is below 2**31: the one count read from the line,
# total_num_scheduled_tokens, is range-checked), and only its first NUM_META are per line
A_GPU_BLOCKS, A_MAX_MODEL_LEN, A_MAX_TOKENS, A_MAX_BLOCKS, A_V2, A_EPOCH, A_ROWS = range(NUM_META, NUM_META + 7)
A_INTS, A_KEYIDX, A_KEYTAB = range(NUM_META + 7, NUM_META + 10)  # where ints, keyidx, keytab start
META_LEN = NUM_META + 10
# `ints` ([2 * cap] int32): token ids of the line in [0, cap) (prompts, then sampled), block ids in [cap, 2cap)
# `arena` ([META_LEN + NUM_COLS * R + 2 * cap + KEYIDX_LEN + keytab's length] int32): `meta`, `col`, `ints`,
# `keyidx` and `keytab` back to back, one array for the kernel to take, split into views on both sides. Each
# array argument of a compiled call costs 70-120 ns (numba wraps it in a fresh reference-counted struct, about
# 12% of a decode step's scan with six of them); the id table's `slots` and `row_key_len` are one array too.

KEYS = ("step", "scheduler_output", "sampled_token_ids", "draft_token_ids", "kind",
        "spec_draft_token_ids", "num_rejected_tokens", "num_computed_tokens_correction",
        "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
        "scheduled_spec_decode_tokens", "finished_req_ids", "preempted_req_ids",
        "req_id", "prompt_token_ids", "prefill_token_ids", "block_ids", "num_computed_tokens",
        "req_ids", "resumed_req_ids", "new_block_ids", "all_token_ids", "num_output_tokens",
        "resumed_from_preemption", "resumed_req_token_ids")  # the ids below
# key ids: their index in KEYS
STEP, SCHEDULER_OUTPUT, SAMPLED, DRAFTS, KIND = 0, 1, 2, 3, 4
SPEC_DRAFTS, REJECTED, CORRECTION = 5, 6, 7
NEW_REQS, CACHED_REQS, NUM_SCHEDULED, TOTAL, SPEC_TOKENS, FINISHED, PREEMPTED = 8, 9, 10, 11, 12, 13, 14
REQ_ID, PROMPT, PREFILL, BLOCK_IDS, NUM_COMPUTED = 15, 16, 17, 18, 19
REQ_IDS, RESUMED_IDS, NEW_BLOCK_IDS, ALL_TOKEN_IDS, NUM_OUTPUT, LEGACY_RESUMED, LEGACY_TOKENS = (
    20, 21, 22, 23, 24, 25, 26)

# `keytab` ([MEMO_RUNS * MEMO_MAX + the names' bytes] int32, a byte each): the skip memo's slots, then the key
# names back to back. `keyidx` ([KEYIDX_LEN] int32): key_slot() -> key id (-1 empty, linear probing), then each
# key's offset in keytab, then the bytes each memo slot holds (0: none), then the key guesses (below).
KEY_SLOTS = 256
# The skip memo: a run of members the scanner skips (keys it does not read, with their values: on the long
# trace 550 of a decode step's 3 KB in three runs, and about a tenth of its scan when checked as JSON key by
# key) as the previous line had it, byte for byte, one slot per run in the object's order. A line with the
# same bytes there, then a byte that ends a value, skips the run in one compare (trace/scan_kernels.py,
# `_memo_hit`, says why that parses as the long way would).
MEMO_RUNS = 12  # slots: scheduler_output's runs from MEMO_SO, a new request's from MEMO_NEW
MEMO_SO, MEMO_NEW = 0, 8
MEMO_MAX = 1024  # the bytes a slot holds: a longer run is skipped the long way
MEMO_LEN = KEY_SLOTS + len(KEYS) + 1  # keyidx[MEMO_LEN + slot]: the bytes that slot holds
# The key guesses: per kind of object, the key that followed each key in the previous line (-1: none known),
# compared first (trace/scan_kernels.py, `_key`). keyidx[GUESS + kind * GUESS_W + after + 2] is the key that
# came after `after`: -2 the object's start, -1 a key the scanner does not know, a key id, or
# len(KEYS) + slot after a run of memo `slot`.
OBJ_TOP, OBJ_SO, OBJ_NEW, OBJ_CACHED = 0, 1, 2, 3  # the kinds: the step, scheduler_output, a new request, cached
GUESS = MEMO_LEN + MEMO_RUNS
NUM_KEYS = len(KEYS)
GUESS_W = NUM_KEYS + MEMO_RUNS + 2
START = -2  # `after` at an object's start
KEYIDX_LEN = GUESS + 4 * GUESS_W

# reasons (nonzero: the checked path decodes the line)
BAD_JSON, BAD_FORM, UNSUPPORTED, UNKNOWN_ID, OUT_OF_RANGE, FULL, MISMATCH = 1, 2, 3, 4, 5, 6, 7


def key_slot(name: bytes) -> int:
    """The first slot of a key name in `keyidx` (scan_kernels._key_id computes the same from the line)."""
    n = len(name)
    return (n * 131 + name[0] * 31 + name[-1] * 7 + name[n // 2]) & (KEY_SLOTS - 1) if n else 0
