"""Compiled kernels of the line scanner (numba): one step line's JSON bytes straight into flat int32 columns,
and the request-id table the scanner resolves ids through.

Rules:
- `scan_line` only reads: the line (a `bytes` object, read in place: its trailing zero byte is the sentinel),
  the id table and the rows' block counts. It writes its own columns and scratch, nothing of the worker's
  state, so a line it refuses can be decoded again by the checked path.
- What it carries from one line to the next is only ever a guess, checked against the line before it is
  taken, so a line means the same whatever came before it: the skip memo (a run of skipped members as the
  previous line had it, `_memo_hit`), the key guesses (the key that followed each key, `_key`) and the row
  guesses (the previous line's cached requests, `_id_list`). Each says why a guess it takes is what the long
  way finds. On the long trace's decode steps they make the scan about a fifth cheaper.
- It accepts a line only in the one form it knows through and through (trace/scan.py states it) and returns a
  nonzero reason for anything else: an escape or a non-ASCII byte in a string, a float where an int goes, a
  key given twice, keys out of the recorder's order, drafts, async or legacy keys, resumed requests,
  all_token_ids, an unknown id, a value out of range, a full buffer. Reasons are for tests and counters;
  the checked path names the problem.
- Every value a skipped key holds is checked to be JSON (grammar, nesting), so a line the checked path would
  refuse as "not valid JSON" is never accepted here.
- The id table: open addressing with linear probing over `slots` (a power of two, at least twice the rows),
  each slot a row or -1; a row's id bytes in `row_key[row, :row_key_len[row]]`; FNV-1a hashes; deletion by
  backward shift, so a probe stops at the first empty slot.
- Nothing allocates: the kernels run without numba's reference counting (`_nrt=False`), which cost half of
  a scan's time in refcount updates on every call that passed an array (perf). How the loops are written, and
  why, is stated above `_ws`.
- Importing this module imports numba: import it lazily (kvmap.aot.load).
"""

from __future__ import annotations

import numba as nb
import numpy as np

# the column layout: constants to numba
from kvmap.trace.scan_layout import (ALL_TOKEN_IDS, A_EPOCH, A_GPU_BLOCKS, A_INTS, A_KEYIDX, A_KEYTAB, A_MAX_BLOCKS,
    A_MAX_MODEL_LEN, A_MAX_TOKENS, A_ROWS, A_V2, BAD_FORM, BAD_JSON, BLOCK_IDS, CACHED_REQS, C_B_LEN, C_B_OFF,
    C_ID_E, C_ID_S, C_NB, C_NC, C_ROWS, DRAFTS, FINISHED, FULL, F_ROWS, GUESS, GUESS_W, KEY_SLOTS, LEGACY_RESUMED,
    LEGACY_TOKENS, MEMO_LEN, MEMO_MAX, MEMO_NEW, MEMO_RUNS, MEMO_SO, META_LEN, MISMATCH, MK_CACHED, MK_REMOVED,
    MK_SCHED, M_BPOS, M_CACHED, M_FINISHED, M_HAS_SAMPLED, M_NB_N, M_NC_N, M_NEW, M_OUT_N, M_PREEMPTED, M_REMOVED,
    M_SAMPLED, M_SCHED, M_SM_OFF, M_SM_SAME, M_SM_TOKENS, M_TOTAL, M_TPOS, NEW_BLOCK_IDS, NEW_B_LEN, NEW_B_OFF,
    NEW_FIELD, NEW_ID_E, NEW_ID_S, NEW_IN_S, NEW_NC, NEW_REQS, NEW_TOK_LEN, NEW_TOK_OFF, NUM_COLS, NUM_COMPUTED,
    NUM_KEYS, NUM_META, NUM_OUTPUT, NUM_SCHEDULED, OBJ_CACHED, OBJ_NEW, OBJ_SO, OBJ_TOP, OUT_OF_RANGE, PREEMPTED,
    PREFILL, PROMPT, P_ROWS, REQ_ID, REQ_IDS, RESUMED_IDS, SAMPLED, SCHEDULER_OUTPUT, SCRATCH, SM_COUNT, SM_IDX,
    SPEC_TOKENS, START, STEP, S_COUNTS, S_ID_E, S_ID_S, S_ROWS, TOTAL, UNKNOWN_ID, UNSUPPORTED)

_jit = nb.njit(cache=True, nogil=True, boundscheck=False, _nrt=False)  # no refcounts: nothing here allocates
_u = np.uint64  # a variable index cast to unsigned: numba adds no negative-index wraparound (see the rules)

_FNV_OFFSET = np.uint64(14695981039346656037)
_FNV_PRIME = np.uint64(1099511628211)


# ------------------------------------------------------------------------------------------- the id table

@_jit
def _hash(b, s, e):
    h = _FNV_OFFSET
    for t in range(s, e):
        h = (h ^ np.uint64(b[_u(t)])) * _FNV_PRIME
    return h


@_jit
def _same_span(b, s, e, t, f):
    """b[s:e] == b[t:f] (a leaf)."""
    n = e - s
    if f - t != n:
        return False
    u = 0
    while u < n and b[_u(s + u)] == b[_u(t + u)]:
        u += 1
    return u == n


@_jit
def _quoted_as(b, i, s, e):
    """Whether the string that starts after its quote at i is b[s:e], an id already read and checked, closed
    by its quote: one pass where reading the string and comparing it are two. Reads at most up to the
    sentinel (no id byte is 0). A leaf."""
    n = e - s
    u = 0
    while u < n and b[_u(i + u)] == b[_u(s + u)]:
        u += 1
    return u == n and b[_u(i + n)] == 34


@_jit
def _quoted_row(b, i, row_key, row_key_len, r):
    """Whether the string that starts after its quote at i is the id the table holds for row r (tracked,
    not empty), closed by its quote: a guessed row checked in one pass, where a lookup hashes the id, probes
    and compares. Reads at most up to the sentinel. A leaf."""
    n = row_key_len[_u(r)]
    if n == 0:
        return False
    u = 0
    while u < n and b[_u(i + u)] == row_key[_u(r), _u(u)]:
        u += 1
    return u == n and b[_u(i + n)] == 34


@_jit
def _lookup(buf, s, e, slots, row_key, row_key_len):
    """The row whose id is buf[s:e], or -1. (A leaf: no calls, see the note on loops.)"""
    n = e - s
    if n > row_key.shape[1]:
        return -1
    h = _FNV_OFFSET
    for t in range(s, e):
        h = (h ^ np.uint64(buf[_u(t)])) * _FNV_PRIME
    mask = np.uint64(slots.shape[0] - 1)
    j = np.int64(h & mask)
    while True:
        r = slots[_u(j)]
        if r < 0:
            return -1
        if row_key_len[_u(r)] == n:
            u = 0
            while u < n and row_key[_u(r), _u(u)] == buf[_u(s + u)]:
                u += 1
            if u == n:
                return r
        j = np.int64((np.uint64(j) + np.uint64(1)) & mask)


@_jit
def table_insert(slots, row_key, row_key_len, key, row):
    """Give `row` the id `key` (bytes); returns 0, or -1 when the id is too long for the table."""
    n = key.shape[0]
    if n > row_key.shape[1]:
        return -1
    for t in range(n):
        row_key[_u(row), _u(t)] = key[t]
    row_key_len[_u(row)] = n
    mask = np.uint64(slots.shape[0] - 1)
    j = np.int64(_hash(key, 0, n) & mask)
    while slots[_u(j)] >= 0:
        j = np.int64((np.uint64(j) + np.uint64(1)) & mask)
    slots[_u(j)] = row
    return 0


@_jit
def table_find(slots, row_key, row_key_len, key):
    """The row holding the id `key` (bytes), or -1."""
    return _lookup(key, 0, key.shape[0], slots, row_key, row_key_len)


@_jit
def table_remove(slots, row_key, row_key_len, row):
    """Take `row`'s id out of the table (backward-shift deletion); returns 0, or -1 when it is not there."""
    mask = np.uint64(slots.shape[0] - 1)
    size = slots.shape[0]
    j = np.int64(_hash(row_key[_u(row)], 0, row_key_len[_u(row)]) & mask)
    for _ in range(size):
        if slots[_u(j)] == row:
            break
        if slots[_u(j)] < 0:
            return -1
        j = np.int64((np.uint64(j) + np.uint64(1)) & mask)
    else:
        return -1
    slots[_u(j)] = -1
    k = j
    for _ in range(size):
        k = np.int64((np.uint64(k) + np.uint64(1)) & mask)
        r = slots[_u(k)]
        if r < 0:
            break
        home = np.int64(_hash(row_key[_u(r)], 0, row_key_len[_u(r)]) & mask)
        # move r back into the hole unless its home lies cyclically in (j, k]
        if (j <= k and (home <= j or home > k)) or (j > k and home <= j and home > k):
            slots[_u(j)] = r
            slots[_u(k)] = -1
            j = k
    row_key_len[_u(row)] = 0
    return 0


# ------------------------------------------------------------------------------------------- JSON pieces

@_jit
def _ws(b, i, n):
    """The first index at or after i that is not JSON whitespace (the sentinel b[n] = 0 stops it)."""
    c = b[_u(i)]
    while c == 32 or c == 10 or c == 13 or c == 9:
        i += 1
        c = b[_u(i)]
    return i


@_jit
def _string_end(b, i, n):
    """b[i] is '"': the index of the closing quote, or -1 (an escape, a control or non-ASCII byte, no end)."""
    j = i + 1
    while j < n:
        c = b[_u(j)]
        if c == 34:
            return j
        if c == 92 or c < 32 or c >= 128:
            return -1
        j += 1
    return -1


# How these loops are written (each measured on this machine; numba's code for the other forms was 3-15x
# slower): the line's bytes end in a zero sentinel (b[n] == 0, which no loop accepts), so the inner loops
# read the next byte without a bounds check; the per-byte helpers are leaves (no calls: numba returns through
# memory, a call per int cost 3-6x), and no helper is `inline="always"` (numba's IR inlining made the code
# slower and the build 4.5 minutes; LLVM's, `forceinline=True`, changed nothing). Every variable index is cast
# to unsigned (`_u`): numba wraps a signed index that could be negative on every read, two or three
# instructions in each byte loop (one 3 KB line: 18.5 -> 15 us). So no index here may ever be negative: every
# helper returns before it would read at one.

@_jit
def _int(b, i, n):
    """A JSON integer at b[i]: (next index, value), or (-1, 0) for anything else (a float, 18 digits or more).
    A leaf, reading up to the sentinel."""
    neg = False
    if b[_u(i)] == 45:
        neg = True
        i += 1
    v = np.int64(b[_u(i)]) - 48
    if v < 0 or v > 9:
        return -1, 0
    i += 1
    d = np.int64(b[_u(i)]) - 48
    if v == 0:
        if d >= 0 and d <= 9:
            return -1, 0  # a leading zero
    else:
        while d >= 0 and d <= 9:
            v = v * 10 + d
            if v >= 100000000000000000:
                return -1, 0
            i += 1
            d = np.int64(b[_u(i)]) - 48
    c = b[_u(i)]
    if c == 46 or c == 101 or c == 69:
        return -1, 0
    return i, (-v if neg else v)


@_jit
def _number_end(b, i, n):
    """The end of a JSON number at b[i] (grammar checked), or -1. A leaf, reading up to the sentinel."""
    if b[_u(i)] == 45:
        i += 1
    d = np.int64(b[_u(i)]) - 48
    if d == 0:
        i += 1
    elif d >= 1 and d <= 9:
        i += 1
        d = np.int64(b[_u(i)]) - 48
        while d >= 0 and d <= 9:
            i += 1
            d = np.int64(b[_u(i)]) - 48
    else:
        return -1
    if b[_u(i)] == 46:
        i += 1
        d = np.int64(b[_u(i)]) - 48
        if d < 0 or d > 9:
            return -1
        while d >= 0 and d <= 9:
            i += 1
            d = np.int64(b[_u(i)]) - 48
    c = b[_u(i)]
    if c == 101 or c == 69:
        i += 1
        c = b[_u(i)]
        if c == 43 or c == 45:
            i += 1
        d = np.int64(b[_u(i)]) - 48
        if d < 0 or d > 9:
            return -1
        while d >= 0 and d <= 9:
            i += 1
            d = np.int64(b[_u(i)]) - 48
    return i


@_jit
def _literal(b, i, n):
    """true / false / null at b[i]: the index after it, or -1."""
    c = b[_u(i)]
    if c == 116 and i + 4 <= n and b[_u(i + 1)] == 114 and b[_u(i + 2)] == 117 and b[_u(i + 3)] == 101:
        return i + 4
    if c == 110 and i + 4 <= n and b[_u(i + 1)] == 117 and b[_u(i + 2)] == 108 and b[_u(i + 3)] == 108:
        return i + 4
    if c == 102 and i + 5 <= n and b[_u(i + 1)] == 97 and b[_u(i + 2)] == 108 and b[_u(i + 3)] == 115 and \
            b[_u(i + 4)] == 101:
        return i + 5
    return -1


@_jit
def _is_null(b, i, n):
    return i + 4 <= n and b[_u(i)] == 110 and b[_u(i + 1)] == 117 and b[_u(i + 2)] == 108 and b[_u(i + 3)] == 108


@_jit
def _skip(b, i, n):
    """Skip one JSON value at b[i] (after whitespace), checking its grammar: the index after it, or -1."""
    depth = 0
    kinds = np.int64(0)  # a bit per open container: 1 object, 0 array
    while True:
        i = _ws(b, i, n)
        if i >= n:
            return -1
        c = b[_u(i)]
        opened = False
        if c == 123 or c == 91:
            if depth >= 60:
                return -1
            depth += 1
            kinds = (kinds << 1) | (1 if c == 123 else 0)
            i = _ws(b, i + 1, n)
            if i >= n:
                return -1
            if b[_u(i)] == (125 if c == 123 else 93):
                i += 1
                depth -= 1
                kinds >>= 1
            else:
                opened = True
                if c == 123:
                    if b[_u(i)] != 34:
                        return -1
                    e = _string_end(b, i, n)
                    if e < 0:
                        return -1
                    i = _ws(b, e + 1, n)
                    if i >= n or b[_u(i)] != 58:
                        return -1
                    i += 1
        elif c == 34:
            e = _string_end(b, i, n)
            if e < 0:
                return -1
            i = e + 1
        elif c == 116 or c == 102 or c == 110:
            i = _literal(b, i, n)
            if i < 0:
                return -1
        else:
            i = _number_end(b, i, n)
            if i < 0:
                return -1
        if opened:
            continue
        # after a value: a comma (then the next member), or closing brackets
        while True:
            if depth == 0:
                return i
            i = _ws(b, i, n)
            if i >= n:
                return -1
            c = b[_u(i)]
            obj = (kinds & 1) == 1
            if c == 44:
                i = _ws(b, i + 1, n)
                if obj:
                    if i >= n or b[_u(i)] != 34:
                        return -1
                    e = _string_end(b, i, n)
                    if e < 0:
                        return -1
                    i = _ws(b, e + 1, n)
                    if i >= n or b[_u(i)] != 58:
                        return -1
                    i += 1
                break
            if c == (125 if obj else 93):
                i += 1
                depth -= 1
                kinds >>= 1
                continue
            return -1


@_jit
def _key_id(b, s, e, keytab, keyidx):
    """The id of the key b[s:e] (its index in KEYS), or -1: a probe of the key slots (linear probing, built by
    trace/scan.py), then one compare. A leaf."""
    n = e - s
    j = 0
    if n:  # scan_layout.key_slot: four bytes and the length (a hash over every byte cost 8% of a scan)
        j = (n * 131 + np.int64(b[_u(s)]) * 31 + np.int64(b[_u(e - 1)]) * 7 +
             np.int64(b[_u(s + n // 2)])) & (KEY_SLOTS - 1)
    while True:
        k = keyidx[_u(j)]
        if k < 0:
            return -1
        a = keyidx[_u(KEY_SLOTS + k)]
        if keyidx[_u(KEY_SLOTS + k + 1)] - a == n:
            u = 0
            while u < n and b[_u(s + u)] == keytab[_u(a + u)]:
                u += 1
            if u == n:
                return k
        j = (j + 1) & (KEY_SLOTS - 1)


@_jit
def _member(b, i, n, close):
    """At the start of an object member or the object's end: the index of the key's quote, -2 at the end, or
    -1 on bad JSON. A leaf."""
    c = b[_u(i)]
    while c == 32 or c == 10 or c == 13 or c == 9:
        i += 1
        c = b[_u(i)]
    if c == close:
        return -2
    if c != 34:
        return -1
    return i


@_jit
def _after_key(b, e, n):
    """After a key's closing quote at e: the index of its value (past ':'), or -1. A leaf."""
    i = e + 1
    c = b[_u(i)]
    while c == 32 or c == 10 or c == 13 or c == 9:
        i += 1
        c = b[_u(i)]
    if c != 58:
        return -1
    i += 1
    c = b[_u(i)]
    while c == 32 or c == 10 or c == 13 or c == 9:
        i += 1
        c = b[_u(i)]
    return i if i < n else -1


@_jit
def _next(b, i, n, close):
    """After a member or element: (index of the next one, True) after a comma, (index past the close,
    False) at the end, or (-1, False). A leaf."""
    c = b[_u(i)]
    while c == 32 or c == 10 or c == 13 or c == 9:
        i += 1
        c = b[_u(i)]
    if c == 44:
        i += 1
        c = b[_u(i)]
        while c == 32 or c == 10 or c == 13 or c == 9:
            i += 1
            c = b[_u(i)]
        return i, True
    if c == close:
        return i + 1, False
    return -1, False


@_jit
def _int_list(b, i, n, out, pos, end, lo, hi):
    """A list of ints in [lo, hi) at b[i] into out[pos:end]: (next index, count), or (-reason, 0). A leaf: a
    tight digit loop per element, reading up to the sentinel. A sign, a fraction or an exponent declines (no
    list the scanner reads holds one)."""
    if b[_u(i)] != 91:
        return -BAD_FORM, 0
    i += 1
    cnt = 0
    while True:
        c = b[_u(i)]
        while c == 32 or c == 10 or c == 13 or c == 9:
            i += 1
            c = b[_u(i)]
        if c == 93 and cnt == 0:
            return i + 1, 0
        v = np.int64(c) - 48
        if v < 0 or v > 9:
            return -BAD_FORM, 0
        i += 1
        d = np.int64(b[_u(i)]) - 48
        if v == 0:
            if d >= 0 and d <= 9:
                return -BAD_FORM, 0  # a leading zero
        else:
            while d >= 0 and d <= 9:
                v = v * 10 + d
                if v >= 100000000000000000:
                    return -BAD_FORM, 0
                i += 1
                d = np.int64(b[_u(i)]) - 48
        if v < lo or v >= hi:
            return -OUT_OF_RANGE, 0
        if pos + cnt >= end:
            return -FULL, 0
        out[_u(pos + cnt)] = v
        cnt += 1
        c = b[_u(i)]
        while c == 32 or c == 10 or c == 13 or c == 9:
            i += 1
            c = b[_u(i)]
        if c == 44:
            i += 1
        elif c == 93:
            return i + 1, cnt
        elif c == 46 or c == 101 or c == 69:
            return -BAD_FORM, 0
        else:
            return -BAD_JSON, 0


@_jit
def _one_group(b, i, n, ints, meta, num_gpu_blocks):
    """One KV cache group's block ids, `[[...]]`, into the block region of `ints`: (next index, offset,
    count), or (-reason, 0, 0)."""
    if b[_u(i)] != 91:
        return -BAD_FORM, 0, 0
    i = _ws(b, i + 1, n)
    pos = meta[M_BPOS]
    i, cnt = _int_list(b, i, n, ints, pos, ints.shape[0], 0, num_gpu_blocks)
    if i < 0:
        return i, 0, 0
    i = _ws(b, i, n)
    if i >= n or b[_u(i)] != 93:
        return -BAD_FORM, 0, 0  # not one list per group
    meta[M_BPOS] = pos + cnt
    return i + 1, pos, cnt


@_jit
def _resolve(b, s, e, num_new, col, slots, row_key, row_key_len):
    """An id in a scheduled position: new request k as -(k + 1), a live row, or a large sentinel (unknown)."""
    for k in range(num_new):
        if _same_span(b, s, e, col[NEW_ID_S, _u(k)], col[NEW_ID_E, _u(k)]):
            return -(k + 1)
    r = _lookup(b, s, e, slots, row_key, row_key_len)
    return r if r >= 0 else 1 << 30


@_jit
def _empty(b, i, n, close):
    """null, or an empty list / object (`close` is its closing bracket) at b[i]: the index after it, else -1."""
    if _is_null(b, i, n):
        return i + 4
    if i < n and b[_u(i)] == (91 if close == 93 else 123):
        j = _ws(b, i + 1, n)
        if j < n and b[_u(j)] == close:
            return j + 1
    return -1


END = -2  # the key id `_key` gives at the object's end


@_jit
def _key(b, i, n, keytab, keyidx, kind, after):
    """At a member of an object of `kind` (OBJ_*) that follows key `after` (scan_layout: START, -1, a key id,
    or a memo run), or at the object's end: (key id or -1, index of its value), (END, index past the '}'), or
    (0, -reason).

    The key that followed `after` in the previous line is compared first, in one pass; only when the line
    has another key here is the key read, hashed and looked up. A guess is taken only when the bytes after
    the quote are its name and then a quote: a name holds no escape, quote or control byte, so the key read
    the long way ends at that quote and is that name. What the line has is kept as the next line's guess."""
    q = _member(b, i, n, 125)
    if q == -2:
        return END, _ws(b, i, n) + 1
    if q < 0:
        return 0, -BAD_JSON
    at = _u(GUESS + kind * GUESS_W + after + 2)
    key = keyidx[at]
    e = -1
    if key >= 0:
        a = keyidx[_u(KEY_SLOTS + key)]
        ln = keyidx[_u(KEY_SLOTS + key + 1)] - a
        u = 0
        while u < ln and b[_u(q + 1 + u)] == keytab[_u(a + u)]:
            u += 1
        if u == ln and b[_u(q + 1 + ln)] == 34:
            e = q + 1 + ln
    if e < 0:
        e = _string_end(b, q, n)
        if e < 0:
            return 0, -UNSUPPORTED
        key = _key_id(b, q + 1, e, keytab, keyidx)
        keyidx[at] = key
    j = _after_key(b, e, n)
    if j < 0 or j >= n:
        return 0, -BAD_JSON
    return key, j


@_jit
def _memo_hit(b, i, n, keytab, keyidx, slot):
    """The length of the run of skipped members that memo `slot` holds when the line has those bytes at i and
    then a byte that ends a value (a comma, a brace or whitespace), else 0. A leaf.

    Why a hit parses as the long way would: the slot holds bytes that were parsed, from the start of a member of
    this same kind of object, as members the scanner skips (each key and value checked, nothing kept), and
    ended at a value's end. The same bytes from the same place parse the same way; a value's end is decided by
    its own bytes, except a number's, which the byte after it decides: hence the ending byte. Skipped keys are
    not in the key-twice check, so nothing else depends on them."""
    ln = keyidx[_u(MEMO_LEN + slot)]
    if ln == 0 or i + ln > n:
        return 0
    c = b[_u(i + ln)]
    if c != 44 and c != 125 and c != 32 and c != 10 and c != 13 and c != 9:
        return 0
    a = slot * MEMO_MAX
    if b[_u(i + 1)] != keytab[_u(a + 1)] or b[_u(i + ln - 1)] != keytab[_u(a + ln - 1)]:
        return 0  # most members that are not the run differ in their key's first byte
    d = np.int32(0)
    for u in range(ln):  # no early exit, 32-bit lanes: LLVM vectorizes it (3x the byte-at-a-time compare)
        d |= np.int32(b[_u(i + u)]) ^ keytab[_u(a + u)]
    return ln if d == 0 else 0


@_jit
def _memo_keep(b, s, e, keytab, keyidx, slot):
    """Keep b[s:e], a run of skipped members that ends at a value's end, in memo `slot` (a run longer than
    MEMO_MAX empties the slot). A leaf."""
    ln = e - s
    if ln > MEMO_MAX:
        ln = 0
    a = slot * MEMO_MAX
    for u in range(ln):
        keytab[_u(a + u)] = b[_u(s + u)]
    keyidx[_u(MEMO_LEN + slot)] = ln


@_jit
def _seen(got, key, lo, hi, base):
    """`got` (a bit per key id, bit key - base) with `key` added when lo <= key < hi; -1 if it was there: a key
    given twice."""
    if key < lo or key >= hi:
        return got
    bit = 1 << (key - base)
    return -1 if got & bit else got | bit


@_jit
def _end_member(b, i, n):
    """After a member's value: (next member's index, True), (index past '}', False), or (-reason, False)."""
    i, more = _next(b, i, n, 125)
    if i < 0:
        return -BAD_JSON, False
    if more and _member(b, i, n, 125) < 0:
        return -BAD_JSON, False
    return i, more


RUN = -3  # the key id `_member_key` gives for a run of skipped members the memo skipped in one compare


@_jit
def _member_key(b, i, n, keytab, keyidx, kind, after, run, limit, open_run):
    """At a member of an object (or its end), in an object loop that keeps memo slots [.., limit): the run the
    previous line had here, (RUN, the index after it), unless a run is open or the slots are used up; else
    `_key`'s (key, index)."""
    if not open_run and run < limit:
        ln = _memo_hit(b, i, n, keytab, keyidx, run)
        if ln:
            return RUN, i + ln
    return _key(b, i, n, keytab, keyidx, kind, after)


@_jit
def _skip_member(b, at, i, n, rs):
    """A member the scanner skips (its key at `at`), its value at b[i] checked as JSON: (the index after the
    value or -BAD_JSON, the open run's start: `at` when none was open)."""
    j = _skip(b, i, n)
    if j < 0:
        return -BAD_JSON, rs
    return j, (at if rs < 0 else rs)


@_jit
def _close_run(b, rs, re, keytab, keyidx, run, limit):
    """At a member the scanner reads, or the object's end: the open run b[rs:re] (if any) kept in memo slot
    `run` when it is below `limit`. Returns (the next run's slot, -1: no run open)."""
    if rs < 0:
        return run, rs
    if run < limit:
        _memo_keep(b, rs, re, keytab, keyidx, run)
    return run + 1, -1


# --------------------------------------------------------------------------- sections (one call each)

@_jit
def _id_list(b, i, n, col, which, spans, slots, row_key, row_key_len):
    """A list of ids at b[i] (or null: empty) resolved to rows (-1: not live) into col[which], and their byte
    spans into col[spans], col[spans + 1] (spans >= 0): (next index, count) or (-reason, 0).

    With spans (the cached requests' ids), the rows col[which] still holds from the previous line are the
    guesses: a decode step lists the previous step's requests in the same order, less the finished ones and
    with the new ones at the end. An id is first compared with the guessed row's id (entry p of the previous
    list, then p + 1), and looked up only when neither is it. A guess is only ever taken when the table holds
    exactly that id for that row, which is the row the lookup finds, so the rows are the lookup's either way.
    Entries of the previous list that this list has overwritten make wrong guesses, which cost one compare."""
    if _is_null(b, i, n):
        return i + 4, 0
    if b[_u(i)] != 91:
        return -BAD_FORM, 0
    i = _ws(b, i + 1, n)
    if i < n and b[_u(i)] == 93:
        return i + 1, 0
    cnt = 0
    cap = col.shape[1]
    p = 0  # the previous line's entry the next id most likely is
    while True:
        if i >= n or b[_u(i)] != 34:
            return -BAD_FORM, 0
        if cnt >= cap:
            return -FULL, 0
        r = -1
        if spans >= 0:
            for d in range(2):
                if p + d < cap:
                    g = col[_u(which), _u(p + d)]
                    if g >= 0 and _quoted_row(b, i + 1, row_key, row_key_len, g):
                        r = g
                        p += d + 1
                        break
        if r >= 0:
            e = i + 1 + row_key_len[_u(r)]
        else:
            e = _string_end(b, i, n)
            if e < 0:
                return -UNSUPPORTED, 0
            r = _lookup(b, i + 1, e, slots, row_key, row_key_len)
        col[_u(which), _u(cnt)] = r
        if spans >= 0:
            col[_u(spans), _u(cnt)] = i + 1
            col[_u(spans + 1), _u(cnt)] = e
        cnt += 1
        i, more = _next(b, e + 1, n, 93)
        if i < 0:
            return -BAD_JSON, 0
        if not more:
            return i, cnt


@_jit
def _new_reqs(b, i, n, num_gpu_blocks, max_model_len, key_max, max_blocks, meta, col, ints, keytab, keyidx):
    """`scheduled_new_reqs` at b[i]: the next index, or -reason."""
    if b[_u(i)] != 91:
        return -BAD_FORM
    i = _ws(b, i + 1, n)
    if i < n and b[_u(i)] == 93:
        return i + 1
    R = col.shape[1]
    tok_end = ints.shape[0] // 2
    tok_hi = np.int64(1) << 31
    while True:
        if i >= n or b[_u(i)] != 123:
            return -BAD_FORM
        k = meta[M_NEW]
        if k >= R:
            return -FULL
        i += 1
        got = 0
        prompt_len = -1
        prefill_len = -1
        prompt_off = 0
        prefill_off = 0
        run = MEMO_NEW  # as in _sched_output: the next run's memo slot, the open run's start and end
        rs = -1
        re = 0
        after = START
        while True:
            at = i
            key, i = _member_key(b, i, n, keytab, keyidx, OBJ_NEW, after, run, MEMO_RUNS, rs >= 0)
            if i < 0:
                return i
            if key == END:
                break
            after = NUM_KEYS + run if key == RUN else key
            if key == RUN:  # as in _sched_output
                run += 1
            elif key < REQ_ID or key > NUM_COMPUTED:  # skipped
                i, rs = _skip_member(b, at, i, n, rs)
                re = i
            else:
                run, rs = _close_run(b, rs, re, keytab, keyidx, run, MEMO_RUNS)
                got = _seen(got, key, REQ_ID, NUM_COMPUTED + 1, REQ_ID)
                if got < 0:
                    return -BAD_FORM
                if key == REQ_ID:
                    if b[_u(i)] != 34:
                        return -BAD_FORM
                    e = _string_end(b, i, n)
                    if e < 0 or e - i - 1 > key_max:
                        return -UNSUPPORTED
                    col[NEW_ID_S, _u(k)] = i + 1
                    col[NEW_ID_E, _u(k)] = e
                    i = e + 1
                elif key == PROMPT or key == PREFILL:
                    if _is_null(b, i, n):
                        i += 4
                    else:
                        off = meta[M_TPOS]
                        i, cnt = _int_list(b, i, n, ints, off, tok_end, 0, tok_hi)
                        if i < 0:
                            return i
                        meta[M_TPOS] = off + cnt
                        if key == PROMPT:
                            prompt_len, prompt_off = cnt, off
                        else:
                            prefill_len, prefill_off = cnt, off
                elif key == BLOCK_IDS:
                    i, off, cnt = _one_group(b, i, n, ints, meta, num_gpu_blocks)
                    if i < 0:
                        return i
                    col[NEW_B_OFF, _u(k)] = off
                    col[NEW_B_LEN, _u(k)] = cnt
                else:  # NUM_COMPUTED
                    i, v = _int(b, i, n)
                    if i < 0:
                        return -BAD_FORM
                    if v < 0 or v > max_model_len:
                        return -OUT_OF_RANGE
                    col[NEW_NC, _u(k)] = v
            if i < 0:
                return i
            i, more = _end_member(b, i, n)
            if i < 0:
                return i
            if not more:
                break
        _close_run(b, rs, re, keytab, keyidx, run, MEMO_RUNS)
        if (got & 0b11001) != 0b11001:  # req_id, block_ids, num_computed_tokens
            return -BAD_FORM
        if prefill_len >= 0:  # NewRequestData.token_ids: the prefill tokens when given, else the prompt
            col[NEW_TOK_OFF, _u(k)] = prefill_off
            col[NEW_TOK_LEN, _u(k)] = prefill_len
            col[NEW_FIELD, _u(k)] = 1
        elif prompt_len >= 0:
            col[NEW_TOK_OFF, _u(k)] = prompt_off
            col[NEW_TOK_LEN, _u(k)] = prompt_len
            col[NEW_FIELD, _u(k)] = 0
        else:
            return -BAD_FORM
        if col[NEW_TOK_LEN, _u(k)] > max_model_len or col[NEW_B_LEN, _u(k)] > max_blocks:
            return -OUT_OF_RANGE
        col[NEW_IN_S, _u(k)] = -1
        meta[M_NEW] = k + 1
        i, more = _next(b, i, n, 93)
        if i < 0:
            return -BAD_JSON
        if not more:
            return i


@_jit
def _cached(b, i, n, num_gpu_blocks, max_model_len, meta, col, ints, slots, row_key, row_key_len, keytab,
            keyidx):
    """`scheduled_cached_reqs` at b[i]: the next index, or -reason."""
    if _is_null(b, i, n):
        return i + 4
    if b[_u(i)] != 123:
        return -BAD_FORM
    i += 1
    got = 0
    c_n = -1
    after = START
    while True:
        key, i = _key(b, i, n, keytab, keyidx, OBJ_CACHED, after)
        if i < 0:
            return i
        if key == END:
            break
        after = key
        got = _seen(got, key, NUM_COMPUTED, LEGACY_TOKENS + 1, NUM_COMPUTED)
        if got < 0:
            return -BAD_FORM
        if key == REQ_IDS:
            i, c_n = _id_list(b, i, n, col, C_ROWS, C_ID_S, slots, row_key, row_key_len)
            if i < 0:
                return i
            meta[M_CACHED] = c_n
        elif key == NUM_COMPUTED or key == NUM_OUTPUT or key == NEW_BLOCK_IDS:
            if c_n < 0:
                return -UNSUPPORTED  # before req_ids
            if key == NUM_OUTPUT and _is_null(b, i, n):
                i += 4
                meta[M_OUT_N] = -1
            elif key != NEW_BLOCK_IDS:  # ints, one tight loop: num_computed_tokens kept, num_output_tokens counted
                i, cnt = _int_list(b, i, n, col[C_NC if key == NUM_COMPUTED else SCRATCH], 0, c_n, 0,
                                   max_model_len + 1 if key == NUM_COMPUTED else 1 << 31)
                if i < 0:
                    return -BAD_FORM if i == -FULL else i  # more entries than ids
                meta[M_NC_N if key == NUM_COMPUTED else M_OUT_N] = cnt
            else:  # new_block_ids: per request null, or its new blocks
                if b[_u(i)] != 91:
                    return -BAD_FORM
                i = _ws(b, i + 1, n)
                cnt = 0
                if i < n and b[_u(i)] == 93:
                    i += 1
                else:
                    while True:
                        if cnt >= c_n:
                            return -BAD_FORM
                        if _is_null(b, i, n):
                            col[C_NB, _u(cnt)] = 0
                            i += 4
                        else:
                            i, off, nb = _one_group(b, i, n, ints, meta, num_gpu_blocks)
                            if i < 0:
                                return i
                            col[C_NB, _u(cnt)] = 1
                            col[C_B_OFF, _u(cnt)] = off
                            col[C_B_LEN, _u(cnt)] = nb
                        cnt += 1
                        i, more = _next(b, i, n, 93)
                        if i < 0:
                            return -BAD_JSON
                        if not more:
                            break
                meta[M_NB_N] = cnt
        elif key == RESUMED_IDS or key == ALL_TOKEN_IDS:
            i = _empty(b, i, n, 93 if key == RESUMED_IDS else 125)
            if i < 0:
                return -UNSUPPORTED
        elif key == LEGACY_RESUMED or key == LEGACY_TOKENS:
            return -UNSUPPORTED
        else:
            i = _skip(b, i, n)
            if i < 0:
                return -BAD_JSON
        i, more = _end_member(b, i, n)
        if i < 0:
            return i
        if not more:
            break
    if not got & (1 << (NUM_COMPUTED - 19)) and c_n > 0:
        return -BAD_FORM
    if not got & (1 << (NUM_COMPUTED - 19)):
        meta[M_NC_N] = 0
    if not got & (1 << (NEW_BLOCK_IDS - 19)):
        meta[M_NB_N] = -1
        for j in range(max(c_n, 0)):
            col[C_NB, _u(j)] = 0
    if not got & (1 << (NUM_OUTPUT - 19)):
        meta[M_OUT_N] = -1
    return i


@_jit
def _scheduled(b, i, n, max_model_len, epoch, meta, col, slots, row_key, row_key_len):
    """`num_scheduled_tokens` at b[i]: the next index, or -reason."""
    if b[_u(i)] != 123:
        return -BAD_FORM
    i = _ws(b, i + 1, n)
    if i < n and b[_u(i)] == 125:
        return i + 1
    R = col.shape[1]
    num_new = meta[M_NEW]
    c_n = meta[M_CACHED]
    B = 0
    while True:
        if i >= n or b[_u(i)] != 34:
            return -BAD_JSON
        # the usual step lists the cached requests here in the same order: one compare, no lookup
        if B < c_n and col[C_ROWS, _u(B)] >= 0 and _quoted_as(b, i + 1, col[C_ID_S, _u(B)], col[C_ID_E, _u(B)]):
            e = i + 1 + col[C_ID_E, _u(B)] - col[C_ID_S, _u(B)]
            if B >= R:
                return -FULL
            r = col[C_ROWS, _u(B)]
        else:
            e = _string_end(b, i, n)
            if e < 0:
                return -UNSUPPORTED
            if B >= R:
                return -FULL
            r = _resolve(b, i + 1, e, num_new, col, slots, row_key, row_key_len)
        if r == 1 << 30:
            return -UNKNOWN_ID
        if r < 0:
            if col[NEW_IN_S, _u(-r - 1)] >= 0:
                return -BAD_FORM  # a key twice
            col[NEW_IN_S, _u(-r - 1)] = B
        else:
            if col[MK_SCHED, _u(r)] == epoch:
                return -BAD_FORM
            col[MK_SCHED, _u(r)] = epoch
        col[S_ROWS, B] = r
        col[S_ID_S, B] = i + 1
        col[S_ID_E, B] = e
        i = _after_key(b, e, n)
        if i < 0:
            return -BAD_JSON
        i, v = _int(b, i, n)
        if i < 0:
            return -BAD_FORM
        if v < 1 or v > max_model_len:
            return -OUT_OF_RANGE
        col[S_COUNTS, B] = v
        B += 1
        meta[M_SCHED] = B
        i, more = _next(b, i, n, 125)
        if i < 0:
            return -BAD_JSON
        if not more:
            return i


@_jit
def _sched_output(b, i, n, num_gpu_blocks, max_model_len, key_max, max_blocks, v2, epoch, meta, col, ints,
                  slots, row_key, row_key_len, keytab, keyidx):
    """`scheduler_output` at b[i]: the next index, or -reason."""
    if b[_u(i)] != 123:
        return -BAD_FORM
    i += 1
    got = 0
    run = MEMO_SO  # the memo slot of the next run of skipped members
    rs = -1  # where the open run starts (-1: none is open)
    re = 0  # where its last value ends
    after = START  # the key before (the guesses' `after`)
    while True:
        at = i
        key, i = _member_key(b, i, n, keytab, keyidx, OBJ_SO, after, run, MEMO_NEW, rs >= 0)
        if i < 0:
            return i
        if key == END:
            break
        after = NUM_KEYS + run if key == RUN else key
        if key == RUN:  # the run the previous line had here, skipped in one compare
            run += 1
        elif key < NEW_REQS or key > PREEMPTED:  # a key the scanner skips (its value checked as JSON)
            i, rs = _skip_member(b, at, i, n, rs)
            re = i
        else:  # a key the scanner reads: a run of skipped members before it ends here
            run, rs = _close_run(b, rs, re, keytab, keyidx, run, MEMO_NEW)
            got = _seen(got, key, NEW_REQS, PREEMPTED + 1, 0)
            if got < 0:
                return -BAD_FORM
            if key == NEW_REQS:
                i = _new_reqs(b, i, n, num_gpu_blocks, max_model_len, key_max, max_blocks, meta, col, ints, keytab,
                              keyidx)
            elif key == CACHED_REQS:
                if not got & (1 << NEW_REQS):
                    return -UNSUPPORTED  # out of the recorder's order
                i = _cached(b, i, n, num_gpu_blocks, max_model_len, meta, col, ints, slots, row_key, row_key_len,
                            keytab, keyidx)
            elif key == NUM_SCHEDULED:
                if not got & (1 << CACHED_REQS):
                    return -UNSUPPORTED
                i = _scheduled(b, i, n, max_model_len, epoch, meta, col, slots, row_key, row_key_len)
            elif key == TOTAL:
                i, v = _int(b, i, n)
                if i < 0:
                    return -BAD_FORM
                if v < 0 or v >= 1 << 31:  # meta is int32
                    return -OUT_OF_RANGE
                meta[M_TOTAL] = v
            elif key == SPEC_TOKENS:
                i = _empty(b, i, n, 125)
                if i < 0:
                    return -UNSUPPORTED
            else:  # FINISHED or PREEMPTED
                i, cnt = _id_list(b, i, n, col, F_ROWS if key == FINISHED else P_ROWS, -1, slots, row_key,
                                 row_key_len)
                if i >= 0:
                    if key == PREEMPTED and cnt and not v2:
                        return -UNSUPPORTED
                    meta[M_FINISHED if key == FINISHED else M_PREEMPTED] = cnt
        if i < 0:
            return i
        i, more = _end_member(b, i, n)
        if i < 0:
            return i
        if not more:
            break
    _close_run(b, rs, re, keytab, keyidx, run, MEMO_NEW)
    if not got & (1 << NUM_SCHEDULED) or not got & (1 << TOTAL):
        return -BAD_FORM
    c_n = meta[M_CACHED]
    if meta[M_NC_N] != c_n or (meta[M_NB_N] >= 0 and meta[M_NB_N] != c_n) or \
            (meta[M_OUT_N] >= 0 and meta[M_OUT_N] != c_n):
        return -BAD_FORM
    return i


@_jit
def _sampled(b, i, n, epoch, meta, col, ints, slots, row_key, row_key_len):
    """`sampled_token_ids` at b[i]: the next index, or -reason."""
    if _is_null(b, i, n):
        return i + 4
    if b[_u(i)] != 123:
        return -BAD_FORM
    meta[M_HAS_SAMPLED] = 1
    meta[M_SM_OFF] = meta[M_TPOS]
    i = _ws(b, i + 1, n)
    if i < n and b[_u(i)] == 125:
        return i + 1
    R = col.shape[1]
    B = meta[M_SCHED]
    num_new = meta[M_NEW]
    tok_end = ints.shape[0] // 2
    tok_hi = np.int64(1) << 31
    m = 0
    same = True
    while True:
        if i >= n or b[_u(i)] != 34:
            return -BAD_JSON
        if m < B and _quoted_as(b, i + 1, col[S_ID_S, _u(m)], col[S_ID_E, _u(m)]):
            e = i + 1 + col[S_ID_E, _u(m)] - col[S_ID_S, _u(m)]
            r = -(1 << 29)  # the usual order: the m-th scheduled request, no lookup
        else:
            e = _string_end(b, i, n)
            if e < 0:
                return -UNSUPPORTED
            r = _resolve(b, i + 1, e, num_new, col, slots, row_key, row_key_len)
        if r == 1 << 30:
            return -UNKNOWN_ID
        if r == -(1 << 29):
            s_idx = m
        elif r < 0:
            s_idx = col[NEW_IN_S, _u(-r - 1)]
        elif col[MK_SCHED, _u(r)] != epoch:
            return -UNKNOWN_ID  # not scheduled this step
        elif m < B and col[S_ROWS, _u(m)] == r:
            s_idx = m
        else:
            s_idx = -1
            for t in range(B):
                if col[S_ROWS, _u(t)] == r:
                    s_idx = t
                    break
        if s_idx < 0 or m >= R:
            return -BAD_FORM
        if s_idx != m:
            same = False
        if not same:  # a key twice (while in order, every earlier entry is its own)
            for t in range(m):
                if col[SM_IDX, _u(t)] == s_idx:
                    return -BAD_FORM
        col[SM_IDX, _u(m)] = s_idx
        i = _after_key(b, e, n)
        if i < 0:
            return -BAD_JSON
        off = meta[M_TPOS]
        # one sampled token, `[digits]`, the usual entry: read inline (a call to _int_list costs more than it)
        j, v = _int(b, i + 1, n) if b[_u(i)] == 91 else (-1, 0)
        if j > 0 and b[_u(j)] == 93 and 0 <= v < tok_hi and off < tok_end:
            ints[_u(off)] = v
            i, cnt = j + 1, 1
        else:  # anything else the long way, which reads it or names why not
            i, cnt = _int_list(b, i, n, ints, off, tok_end, 0, tok_hi)
            if i < 0:
                return i
        col[SM_COUNT, _u(m)] = cnt
        meta[M_TPOS] = off + cnt
        m += 1
        i, more = _next(b, i, n, 125)
        if i < 0:
            return -BAD_JSON
        if not more:
            break
    meta[M_SAMPLED] = m
    meta[M_SM_TOKENS] = meta[M_TPOS] - meta[M_SM_OFF]
    meta[M_SM_SAME] = 1 if (same and m == B) else 0
    return i


@_jit
def _drafts(b, i, n, meta, ints):
    """`draft_token_ids` at b[i]: checked (ids in range), not kept: the next index, or -reason."""
    if _is_null(b, i, n):
        return i + 4
    if b[_u(i)] != 123:
        return -BAD_FORM
    i = _ws(b, i + 1, n)
    if i < n and b[_u(i)] == 125:
        return i + 1
    tok_end = ints.shape[0] // 2
    tok_hi = np.int64(1) << 31
    while True:
        if i >= n or b[_u(i)] != 34:
            return -BAD_JSON
        e = _string_end(b, i, n)
        if e < 0:
            return -UNSUPPORTED
        i = _after_key(b, e, n)
        if i < 0:
            return -BAD_JSON
        i, cnt = _int_list(b, i, n, ints, meta[M_TPOS], tok_end, 0, tok_hi)
        if i < 0:
            return i
        i, more = _next(b, i, n, 125)
        if i < 0:
            return -BAD_JSON
        if not more:
            return i


@_jit
def _checks(b, num_free, max_num_tokens, max_blocks, epoch, meta, col, num_blocks, slots, row_key, row_key_len):
    """What a type cannot say, and what the state update would refuse: 0 or a reason."""
    c_n = meta[M_CACHED]
    B = meta[M_SCHED]
    num_new = meta[M_NEW]
    if B != num_new + c_n:
        return MISMATCH
    total = 0
    for j in range(B):
        total += col[S_COUNTS, _u(j)]
    if total != meta[M_TOTAL]:
        return MISMATCH
    if total > max_num_tokens:
        return OUT_OF_RANGE
    for k in range(num_new):
        if col[NEW_IN_S, _u(k)] < 0:
            return MISMATCH  # a new request not scheduled
    removed = 0
    nf = meta[M_FINISHED]
    for j in range(nf + meta[M_PREEMPTED]):
        r = col[F_ROWS, _u(j)] if j < nf else col[P_ROWS, _u(j - nf)]
        if r >= 0 and col[MK_REMOVED, _u(r)] != epoch:
            col[MK_REMOVED, _u(r)] = epoch
            removed += 1
    meta[M_REMOVED] = removed
    for j in range(c_n):
        r = col[C_ROWS, _u(j)]
        if r < 0 or col[MK_SCHED, _u(r)] != epoch or col[MK_CACHED, _u(r)] == epoch or col[MK_REMOVED, _u(r)] == epoch:
            return MISMATCH  # unknown, not scheduled, listed twice, or finished in this step
        col[MK_CACHED, _u(r)] = epoch
        if col[C_NB, _u(j)] and num_blocks[0, _u(r)] + col[C_B_LEN, _u(j)] > max_blocks:
            return OUT_OF_RANGE
    if num_new > num_free + removed:
        return FULL
    for k in range(num_new):
        s = col[NEW_ID_S, _u(k)]
        e = col[NEW_ID_E, _u(k)]
        r = _lookup(b, s, e, slots, row_key, row_key_len)
        if r >= 0 and col[MK_REMOVED, _u(r)] != epoch:
            return MISMATCH  # still live
        for t in range(k):
            if _same_span(b, s, e, col[NEW_ID_S, _u(t)], col[NEW_ID_E, _u(t)]):
                return MISMATCH  # new twice
    return 0


# ------------------------------------------------------------------------------------------- the scanner

@_jit
def scan_line(b, n, expected_step, num_free, arena, num_blocks, tab, row_key):
    """Scan line b[:n] of a one-group trace into the columns. Returns 0 (accepted) or a reason > 0."""
    meta = arena[:META_LEN]  # the arena's parts (scan_layout), where trace/scan.py cut them
    num_gpu_blocks, max_model_len = np.int64(meta[A_GPU_BLOCKS]), np.int64(meta[A_MAX_MODEL_LEN])
    max_num_tokens, max_blocks, v2 = np.int64(meta[A_MAX_TOKENS]), np.int64(meta[A_MAX_BLOCKS]), meta[A_V2] != 0
    R, at_ints, at_keyidx, at_keytab = (np.int64(meta[A_ROWS]), np.int64(meta[A_INTS]), np.int64(meta[A_KEYIDX]),
                                        np.int64(meta[A_KEYTAB]))
    slots = tab[:tab.shape[0] - row_key.shape[0]]  # the id table's two int32 arrays (trace/scan.py ReqIdTable)
    row_key_len = tab[tab.shape[0] - row_key.shape[0]:]
    col = arena[META_LEN:at_ints].reshape((NUM_COLS, R))
    ints = arena[at_ints:at_keyidx]
    keyidx = arena[at_keyidx:at_keytab]
    keytab = arena[at_keytab:]
    epoch = np.int64(meta[A_EPOCH]) + 1  # marks this scan's rows in the MK_* columns
    if epoch >= 1 << 30:
        for c in range(MK_SCHED, MK_REMOVED + 1):
            for r in range(R):
                col[c, r] = 0
        epoch = 1
    meta[A_EPOCH] = epoch
    for k in range(NUM_META):
        meta[k] = 0
    meta[M_BPOS] = ints.shape[0] // 2
    key_max = row_key.shape[1]
    got = 0
    i = _ws(b, 0, n)
    if i >= n or b[_u(i)] != 123:
        return BAD_JSON
    i += 1
    after = START
    while True:
        key, i = _key(b, i, n, keytab, keyidx, OBJ_TOP, after)
        if i < 0:
            return -i
        if key == END:
            break
        after = key
        got = _seen(got, key, STEP, NEW_REQS, 0)
        if got < 0:
            return BAD_FORM
        if key == STEP:
            i, v = _int(b, i, n)
            if i < 0:
                return BAD_FORM
            if v != expected_step:
                return MISMATCH
        elif key == SCHEDULER_OUTPUT:
            if not got & (1 << STEP):
                return UNSUPPORTED
            i = _sched_output(b, i, n, num_gpu_blocks, max_model_len, key_max, max_blocks, v2, epoch, meta, col,
                              ints, slots, row_key, row_key_len, keytab, keyidx)
        elif key == SAMPLED:
            if not got & (1 << SCHEDULER_OUTPUT):
                return UNSUPPORTED
            i = _sampled(b, i, n, epoch, meta, col, ints, slots, row_key, row_key_len)
        elif key == DRAFTS:
            i = _drafts(b, i, n, meta, ints)
        elif 4 <= key < 8:
            return UNSUPPORTED  # kind, async spec-decode keys: the checked path
        else:
            i = _skip(b, i, n)
            if i < 0:
                return BAD_JSON
        if i < 0:
            return -i
        i, more = _end_member(b, i, n)
        if i < 0:
            return -i
        if not more:
            break
    if _ws(b, i, n) != n:
        return BAD_JSON  # something after the object
    if not got & (1 << SCHEDULER_OUTPUT):
        return BAD_FORM
    return _checks(b, num_free, max_num_tokens, max_blocks, epoch, meta, col, num_blocks, slots, row_key,
                   row_key_len)


@_jit
def apply_cached(col, ints, num_cached, max_model_len, kv_groups, block_spans, num_computed_tokens, block_table,
                 num_blocks, capacity):
    """The cached requests of a scanned line of a one-group trace: num_computed_tokens, the new blocks appended
    to the row, each grown row's capacity. The scan checked every bound."""
    for j in range(num_cached):
        r = col[C_ROWS, _u(j)]
        num_computed_tokens[_u(r)] = col[C_NC, _u(j)]
        if col[C_NB, _u(j)] == 0:
            continue
        off = col[C_B_OFF, _u(j)]
        cnt = col[C_B_LEN, _u(j)]
        have = num_blocks[0, _u(r)]
        for t in range(cnt):
            block_table[_u(r), _u(have + t)] = ints[_u(off + t)]
        num_blocks[0, _u(r)] = have + cnt
        cap = np.int64(max_model_len)
        for g in range(kv_groups.shape[0]):
            cap = min(cap, np.int64(num_blocks[_u(kv_groups[g]), _u(r)]) * block_spans[kv_groups[g]])
        capacity[_u(r)] = cap


# Exports compiled ahead of time (kvmap.aot): name -> (kernel, signature). AOT_SOURCES: their source files.
AOT_EXPORTS = {
    "table_insert": ("table_insert", "i8(i4[::1], u1[:, ::1], i4[::1], u1[::1], i8)"),
    "table_remove": ("table_remove", "i8(i4[::1], u1[:, ::1], i4[::1], i8)"),
    "table_find": ("table_find", "i8(i4[::1], u1[:, ::1], i4[::1], u1[::1])"),
    "scan_line": ("scan_line", "i8(Bytes(u1, 1, 'C', readonly=True), i8, i8, i8, i4[::1], i4[:, ::1], i4[::1], "
                               "u1[:, ::1])"),
    "apply_cached": ("apply_cached", "void(i4[:, ::1], i4[::1], i8, i8, i4[::1], i4[::1], i4[::1], i4[:, ::1], "
                                     "i4[:, ::1], i4[::1])"),
}
AOT_SOURCES = ("trace/scan_kernels.py", "trace/scan_layout.py")
