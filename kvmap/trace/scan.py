"""The line scanner: a step line's bytes straight into flat int32 columns, for the replay's hot path.

Rules:
- The fastest of the decoders, with the typed decoder's contract: a line it accepts means exactly what the
  checked path would make of it, and any other line is declined (`scan` returns None) and decoded the
  checked way (`Trace.steps`), which names the problem. It never declines by raising.
- The one form it accepts (trace-format.md, vLLM's SchedulerOutput as the recorder writes it): `step` first,
  then `scheduler_output` with `scheduled_new_reqs` and `scheduled_cached_reqs` before
  `num_scheduled_tokens`, then `sampled_token_ids`; one KV cache group; no drafts
  (`scheduled_spec_decode_tokens` empty), no async spec-decode keys, no `kind`, no resumed requests, no
  `all_token_ids`, no legacy keys; ids plain ASCII without escapes, at most `KEY_MAX` bytes. Every other key
  is skipped with its JSON checked. Everything the typed decoder checks is checked (ranges, lengths, sums,
  the id sets), and everything the state update would refuse (an unknown or still-live id, a full pool of
  rows, a row that overflows) makes it decline, so the update of an accepted line cannot fail before its
  position check, which is the checked update's own.
- Request ids resolve to rows through a `ReqIdTable` that the worker state keeps in step with its
  `req_id_to_index`; the scanner only reads it and the rows' block counts.
- The columns live in the scanner and are valid until the next `scan`. A `ScannedStep` decodes its line in
  full (the checked way) only when something asks for its `scheduler_output`.
- The scanner keeps what the kernel learns from a line for the next (the skip memo, the key guesses, in
  `keytab` and `keyidx`; the cached rows, in `col`): guesses the kernel checks before it takes them, so they
  change how fast a line is scanned, never what it means.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from kvmap.trace import scan_layout as L
from kvmap.trace.records import Step, TraceHeader
from kvmap.trace.scan_layout import KEYS, key_slot

KEY_MAX = 96  # bytes of a request id the table holds (vLLM's are about 40-50)
REASONS = {L.BAD_JSON: "not JSON the scanner checks", L.BAD_FORM: "another form",
           L.UNSUPPORTED: "a form the scanner leaves to the decoder", L.UNKNOWN_ID: "an unknown request id",
           L.OUT_OF_RANGE: "a value out of range", L.FULL: "a full buffer",
           L.MISMATCH: "counts or ids that do not match"}  # a declined line's reason, as the summary says it


def _key_slots(names: list[bytes], size: int) -> np.ndarray:
    """[size] key slot -> key id (-1 empty), linear probing from `key_slot`: the scanner's key lookup."""
    slots = np.full(size, -1, dtype=np.int32)
    for k, name in enumerate(names):
        j = key_slot(name)
        while slots[j] >= 0:
            j = (j + 1) & (size - 1)
        slots[j] = k
    return slots


def _kernels():
    from kvmap.aot import load

    return load("kvmap.trace.scan_kernels")


class ReqIdTable:
    """Request id -> row, in arrays the scanner reads (scan_kernels: open addressing, backward-shift delete).
    `untracked`: live requests whose id the table cannot hold; while there are any, nothing is scanned."""

    def __init__(self, rows: int) -> None:
        self.k = _kernels()
        size = 1 << max(4, (4 * rows - 1).bit_length())
        self.tab = np.zeros(size + rows, dtype=np.int32)  # [size + R] slots, then row_key_len: one argument
        self.slots = self.tab[:size]  # [size] hash slot -> row (-1 empty)
        self.slots[:] = -1
        self.row_key = np.zeros((rows, KEY_MAX), dtype=np.uint8)  # [R, KEY_MAX] row -> id bytes
        self.row_key_len = self.tab[size:]  # [R] row -> id length (0: none)
        self.tracked = np.zeros(rows, dtype=np.bool_)  # [R] row -> its id is in the table
        self.untracked = 0

    def add(self, req_id: str, row: int) -> None:
        key = req_id.encode("utf-8")
        plain = key.isascii() and b"\\" not in key and b'"' not in key and min(key, default=32) >= 32
        if plain and self.k.table_insert(self.slots, self.row_key, self.row_key_len,
                                         np.frombuffer(key, np.uint8).copy(), row) == 0:
            self.tracked[row] = True
        else:
            self.untracked += 1

    def find(self, req_id: str) -> int:
        """The row the table holds for `req_id`, or -1."""
        key = np.frombuffer(req_id.encode("utf-8"), np.uint8).copy()
        return int(self.k.table_find(self.slots, self.row_key, self.row_key_len, key))

    def remove(self, row: int) -> None:
        if self.tracked[row]:
            self.k.table_remove(self.slots, self.row_key, self.row_key_len, row)
            self.tracked[row] = False
        else:
            self.untracked -= 1


class LineScanner:
    """Scans the step lines of one trace for one worker state (its `ReqIdTable`, free rows, block counts)."""

    def __init__(self, header: TraceHeader, table: ReqIdTable, state) -> None:
        assert header.num_groups == 1
        self.k = _kernels()
        self.header = header
        self.table = table
        self.state = state  # the WorkerState whose rows the ids resolve to (read only here)
        R = header.max_num_seqs
        self.K = K = L
        self.max_num_tokens = max(header.max_num_batched_tokens, header.max_num_scheduled_tokens or 0)
        cap = 4 * max(header.max_model_len, self.max_num_tokens, 4096)
        names = [k.encode() for k in KEYS]
        memo = K.MEMO_RUNS * K.MEMO_MAX
        keytab = np.concatenate([np.zeros(memo, np.uint8), np.frombuffer(b"".join(names), np.uint8)])
        keyidx = np.concatenate([_key_slots(names, K.KEY_SLOTS), memo + np.cumsum([0] + [len(k) for k in names]),
                                 np.zeros(K.MEMO_RUNS, np.int64), np.full(K.KEYIDX_LEN - K.GUESS, -1)])
        assert len(keyidx) == K.KEYIDX_LEN and K.MEMO_LEN + K.MEMO_RUNS == K.GUESS
        # [arena] meta, col, ints, keyidx, keytab back to back (scan_layout): one argument for the kernel, which
        # reads where each part starts from meta (A_INTS, A_KEYIDX, A_KEYTAB)
        at_ints = K.META_LEN + K.NUM_COLS * R
        at_keyidx = at_ints + 2 * cap
        at_keytab = at_keyidx + K.KEYIDX_LEN
        self.arena = np.zeros(at_keytab + len(keytab), dtype=np.int32)
        # [META_LEN] what the line holds and the scan's cursors, then the scan's parameters and its epoch
        self.meta = self.arena[:K.META_LEN]
        self.col = self.arena[K.META_LEN:at_ints].reshape(K.NUM_COLS, R)  # [NUM_COLS, R] per-request columns
        # [2 * cap] the line's token ids in [0, cap) (prompts, then sampled), its block ids in [cap, 2 * cap)
        self.ints = self.arena[at_ints:at_keyidx]
        # [KEYIDX_LEN] key slot -> key id, each name's offset in keytab, each memo slot's length, the key guesses
        self.keyidx = self.arena[at_keyidx:at_keytab]
        self.keyidx[:] = keyidx
        # [memo + the names' bytes] the skip memo's slots, then the key names back to back, a byte an entry
        self.keytab = self.arena[at_keytab:]
        self.keytab[:] = keytab
        params = (header.num_gpu_blocks, header.max_model_len, self.max_num_tokens, state.max_num_blocks[0],
                  header.model_runner_protocol == "v2", 0, R, at_ints, at_keyidx, at_keytab)  # A_GPU_BLOCKS ..
        assert max(params) < 1 << 31 and len(self.arena) < 1 << 31
        self.meta[K.NUM_META:] = params
        self.m = memoryview(self.meta)  # the same, read as Python ints (a numpy scalar read costs 3x)
        # The kernel reads the line's own bytes, not a copy: CPython ends every bytes object's buffer in a
        # zero byte (the C API's PyBytes_AsString says so), and that is the sentinel the kernel's loops stop at.
        # Passing it costs less than passing an array, and the copy (0.2-0.3 us a line) is gone.
        self.raw = b""  # the line last scanned (new request ids are read from it)
        t = table
        self._scan_line = self.k.scan_line
        # the arguments that stay the same line after line (the arrays are filled in place)
        self._fixed = (self.arena, state.num_blocks, t.tab, t.row_key)
        self.scanned = 0
        self.declined: Counter[str] = Counter()  # reason -> lines

    def scan(self, raw: bytes, line: int, step: int, decode: Callable[[bytes, int, int], Step]):
        """The line as a `ScannedStep`, or None: decode it the checked way."""
        st = self.state
        if self.table.untracked or st.preempted:
            self.declined["ids the table does not hold" if self.table.untracked else
                          "a preempted request waits to resume (v1)"] += 1
            return None
        if type(raw) is not bytes:  # the sentinel is bytes' own (a subclass or a view may not have it)
            raw = bytes(raw)
        self.raw = raw
        why = self._scan_line(raw, len(raw), step, len(st.free_indices), *self._fixed)
        if why:
            self.declined[REASONS.get(why, str(why))] += 1
            return None
        self.scanned += 1
        m = self.m
        return ScannedStep(step, line, raw, self, decode, m[L.M_SCHED], m[L.M_TOTAL])

    def new_req_id(self, k: int) -> str:
        """The id of the line's k-th new request."""
        c = self.col
        return self.raw[c[self.K.NEW_ID_S, k]: c[self.K.NEW_ID_E, k]].decode("ascii")


class ScannedStep:
    """A step the scanner accepted: its columns (in `scanner`, until the next scan) and, on demand, the full
    `Step` the checked path decodes from the same line. (No __slots__: what the state sets later has a class
    default, so making one sets seven attributes, not eleven.)"""

    new_req_ids: list[str] | tuple = ()  # the new requests' ids, set when the state adds them
    rows: np.ndarray | None = None  # [num_reqs] scheduler entry -> req_state_idx, once applied
    names: dict[int, str] | None = None  # the state's req_state_idx -> req_id, once applied
    _full: Step | None = None

    def __init__(self, step: int, line: int, raw: bytes, scanner: LineScanner, decode, num_reqs: int,
                 num_tokens: int) -> None:
        self.step = step
        self.line = line
        self.raw = raw
        self.scanner = scanner
        self.num_reqs = num_reqs
        self.num_tokens = num_tokens
        self._decode = decode

    def scheduled_req_ids(self) -> list[str]:
        """The scheduled requests' ids, in scheduler order (after the state applied the step)."""
        return list(map(self.names.__getitem__, self.rows.tolist()))

    def full(self) -> Step:
        if self._full is None:
            self._full = self._decode(self.raw, self.line, self.step)
        return self._full

    @property
    def scheduler_output(self):
        return self.full().scheduler_output

    @property
    def sampled_token_ids(self):
        return self.full().sampled_token_ids

    @property
    def draft_token_ids(self):
        return self.full().draft_token_ids

    @property
    def async_spec(self):
        return self.full().async_spec
