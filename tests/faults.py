"""Fault generators for the fault-injection suites (tests/test_faults*.py): each plants one fault into the lines
of a real bundled trace at a site chosen by a seeded random generator, and says where it planted it.

A mutator takes (lines, rng) and returns (step, req_id) of the fault, or None when the trace has no site for
it; `lines` is the parsed trace (header first) and is changed in place.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
from pathlib import Path

from .conftest import TRACES

SMALL = ["worked_example.jsonl", "prefix_caching.jsonl", "spec_decode.jsonl", "preemption_v1.jsonl",
         "preemption_v2.jsonl", "chunked_prefill.jsonl", "hybrid_sliding_window.jsonl"]
_CACHE: dict[str, list[dict]] = {}


def load(name: str) -> list[dict]:
    if name not in _CACHE:
        p = TRACES / name
        op = gzip.open if name.endswith(".gz") else open
        with op(p, "rt") as f:
            _CACHE[name] = [json.loads(x) for x in f]
    return copy.deepcopy(_CACHE[name])


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def so(L, k):
    return L[k + 1]["scheduler_output"]


def _sites(L, pred):
    return [(k, i, r) for k in range(len(L) - 1)
            for i, r in enumerate(so(L, k)["scheduled_cached_reqs"]["req_ids"]) if pred(L, k, i, r)]


def _new_sites(L, pred):
    return [(k, i, nr) for k in range(len(L) - 1) for i, nr in enumerate(so(L, k)["scheduled_new_reqs"])
            if pred(L, k, i, nr)]


def _pick(rng, sites):
    return rng.choice(sites) if sites else None


def _decode(L, k, i, r):
    s = so(L, k)
    return s["num_scheduled_tokens"][r] == 1 and not s["scheduled_spec_decode_tokens"].get(r) \
        and r not in s["scheduled_cached_reqs"]["resumed_req_ids"]


# ---------------------------------------------------------------------------------- mutators


def unknown_cached(L, rng):
    site = _pick(rng, _sites(L, _decode))
    if site is None:
        return None
    k, i, r = site
    s = so(L, k)
    s["scheduled_cached_reqs"]["req_ids"][i] = "ghost"
    s["num_scheduled_tokens"] = {("ghost" if x == r else x): n for x, n in s["num_scheduled_tokens"].items()}
    smp = L[k + 1].get("sampled_token_ids")
    if smp is not None:
        L[k + 1]["sampled_token_ids"] = {("ghost" if x == r else x): t for x, t in smp.items()}
    return k, "ghost"


def finish_early(L, rng):
    site = _pick(rng, _sites(L, _decode))
    if site is None:
        return None
    k, i, r = site
    so(L, k)["finished_req_ids"].append(r)
    return k, r


def null_in_context(L, rng):
    null = L[0].get("null_block_id") or 0
    full = [g for g, grp in enumerate(L[0]["kv_cache_groups"]) if grp["kind"] == "full_attention"]
    site = _pick(rng, _new_sites(L, lambda L, k, i, nr: full and len(nr["block_ids"][full[0]]) >= 2
                                 and nr["num_computed_tokens"] == 0))
    if site is None:
        return None
    k, i, nr = site
    nr["block_ids"][full[0]][0] = null
    return k, nr["req_id"]


def repeat_block(L, rng):
    full = [g for g, grp in enumerate(L[0]["kv_cache_groups"]) if grp["kind"] == "full_attention"]
    site = _pick(rng, _new_sites(L, lambda L, k, i, nr: full and len(nr["block_ids"][full[0]]) >= 2))
    if site is None:
        return None
    k, i, nr = site
    row = nr["block_ids"][full[0]]
    row[-1] = row[0]
    return k, nr["req_id"]


def resumed_without_row(L, rng):
    site = _pick(rng, _sites(L, lambda L, k, i, r: r in so(L, k)["scheduled_cached_reqs"]["resumed_req_ids"]))
    if site is None:
        return None
    k, i, r = site
    so(L, k)["scheduled_cached_reqs"]["new_block_ids"][i] = None
    return k, r


def bool_block(L, rng):
    site = _pick(rng, _new_sites(L, lambda L, k, i, nr: any(nr["block_ids"])))
    if site is None:
        return None
    k, i, nr = site
    row = next(b for b in nr["block_ids"] if b)
    row[0] = True
    return k, nr["req_id"]


def schedule_more(L, rng):
    """A decode step schedules 3 blocks' worth of tokens more than the row and the tokens allow."""
    site = _pick(rng, _sites(L, _decode))
    if site is None:
        return None
    k, i, r = site
    s = so(L, k)
    extra = 3 * L[0]["block_size"]
    s["num_scheduled_tokens"][r] += extra
    s["total_num_scheduled_tokens"] += extra
    return k, r


def drop_sampled(L, rng):
    """A full decode step's sampled token is lost: the next step's position has no known token."""
    site = _pick(rng, [s for s in _sites(L, _decode) if s[0] + 2 < len(L)
                       and s[2] in so(L, s[0] + 1)["num_scheduled_tokens"]
                       and (L[s[0] + 1].get("sampled_token_ids") or {}).get(s[2])])
    if site is None:
        return None
    k, i, r = site
    L[k + 1]["sampled_token_ids"][r] = []
    return k + 1, r


def steal_block(L, rng):
    """A new request also gets a block another live request holds at another position."""
    full = [g for g, grp in enumerate(L[0]["kv_cache_groups"]) if grp["kind"] == "full_attention"]
    if not full:
        return None
    g = full[0]
    sites = []
    for k in range(1, len(L) - 1):
        s = so(L, k)
        c = s["scheduled_cached_reqs"]
        for nr in s["scheduled_new_reqs"]:
            if nr["num_computed_tokens"] == 0 and len(nr["block_ids"][g]) >= 2 and c["req_ids"]:
                sites.append((k, nr))
    site = _pick(rng, sites)
    if site is None:
        return None
    k, nr = site
    # a block of a request scheduled as cached in this step: it is live
    other = so(L, k)["scheduled_cached_reqs"]["req_ids"][0]
    held = _row_of(L, k, other, g)
    if len(held) < 1:
        return None
    nr["block_ids"][g][1] = held[0]
    return k, nr["req_id"]


def _row_of(L, k, r, g):
    """Request r's block row in group g just before step k (new rows, appends; v1 replacements)."""
    row: list[int] = []
    for j in range(k):
        s = so(L, j)
        for nr in s["scheduled_new_reqs"]:
            if nr["req_id"] == r:
                row = list(nr["block_ids"][g])
        c = s["scheduled_cached_reqs"]
        for i, x in enumerate(c["req_ids"]):
            if x == r and c["new_block_ids"][i] is not None:
                new = c["new_block_ids"][i][g]
                row = list(new) if x in c["resumed_req_ids"] else row + list(new)
    return row


def new_twice(L, rng):
    site = _pick(rng, [s for s in _sites(L, _decode) if s[0] >= 1])
    if site is None:
        return None
    k, i, r = site
    s = so(L, k)
    c = s["scheduled_cached_reqs"]
    nc = c["num_computed_tokens"][i]
    for key in ("req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"):
        if isinstance(c.get(key), list):
            c[key].pop(i)
    G = len(L[0]["kv_cache_groups"])
    s["scheduled_new_reqs"].append({"req_id": r, "prompt_token_ids": [1] * (nc + 1), "block_ids": [[]] * G,
                                    "num_computed_tokens": nc, "prefill_token_ids": None})
    return k, r


def few_rows(L, rng):
    """max_num_seqs below the number of requests holding rows at once."""
    live, peak, at = set(), 0, (0, None)
    for k in range(len(L) - 1):
        s = so(L, k)
        live -= set(s["finished_req_ids"])
        if L[0]["model_runner_protocol"] == "v2":
            live -= set(s["preempted_req_ids"])
        for nr in s["scheduled_new_reqs"]:
            live.add(nr["req_id"])
            if len(live) > peak:
                peak, at = len(live), (k, nr["req_id"])
    if peak < 2:
        return None
    L[0]["max_num_seqs"] = peak - 1
    return at


def cross_group_block(L, rng):
    """A hybrid model: a new request's block of a group that is not full attention is a block another live
    request (scheduled as cached in this step) holds in a full-attention group: one block in two groups."""
    groups = L[0]["kv_cache_groups"]
    full = [g for g, grp in enumerate(groups) if grp["kind"] == "full_attention"]
    other = [g for g, grp in enumerate(groups) if grp["kind"] in ("sliding_window", "chunked_local")]
    if not full or not other:
        return None
    sites = [(k, nr) for k in range(1, len(L) - 1) for nr in so(L, k)["scheduled_new_reqs"]
             if nr["block_ids"][other[0]] and so(L, k)["scheduled_cached_reqs"]["req_ids"]]
    site = _pick(rng, sites)
    if site is None:
        return None
    k, nr = site
    held = _row_of(L, k, so(L, k)["scheduled_cached_reqs"]["req_ids"][0], full[0])
    if not held:
        return None
    nr["block_ids"][other[0]][-1] = held[-1]
    return k, nr["req_id"]


def finish_twice(L, rng):
    """A finished request is listed in finished_req_ids again in a later step (vLLM frees a request once)."""
    sites = []
    for f in range(len(L) - 2):
        for r in so(L, f)["finished_req_ids"]:
            for k in range(f + 1, len(L) - 1):
                s = so(L, k)
                if any(nr["req_id"] == r for nr in s["scheduled_new_reqs"]):
                    break
                sites.append((k, r))
    site = _pick(rng, sites)
    if site is None:
        return None
    k, r = site
    so(L, k)["finished_req_ids"].append(r)
    return k, r


def new_while_preempted(L, rng):
    """v1 protocol: a preempted request comes back in scheduled_new_reqs instead of resumed."""
    if L[0]["model_runner_protocol"] != "v1":
        return None
    site = _pick(rng, [(k, r) for k in range(len(L) - 2) for r in so(L, k)["preempted_req_ids"]
                       if r not in so(L, k + 1)["num_scheduled_tokens"]])
    if site is None:
        return None
    k, r = site
    s = so(L, k + 1)
    G = len(L[0]["kv_cache_groups"])
    s["scheduled_new_reqs"].append({"req_id": r, "prompt_token_ids": [1] * 4, "block_ids": [[]] * G,
                                    "num_computed_tokens": 0, "prefill_token_ids": None})
    s["num_scheduled_tokens"][r] = 1
    s["total_num_scheduled_tokens"] += 1
    return k + 1, r


def not_resumed(L, rng):
    """A preempted request is scheduled again without being listed in resumed_req_ids."""
    site = _pick(rng, _sites(L, lambda L, k, i, r: r in so(L, k)["scheduled_cached_reqs"]["resumed_req_ids"]))
    if site is None or L[0]["model_runner_protocol"] != "v1":
        return None
    k, i, r = site
    so(L, k)["scheduled_cached_reqs"]["resumed_req_ids"].remove(r)
    return k, r


def wide_row(L, rng):
    """A new request's block row is padded with null blocks past the row width cdiv(max_model_len + drafts,
    block_size * cp)."""
    h = L[0]
    null = h.get("null_block_id") or 0
    site = _pick(rng, _new_sites(L, lambda L, k, i, nr: True))
    if site is None:
        return None
    k, i, nr = site
    g = 0
    span = h["kv_cache_groups"][g]["block_size"]
    width = -(-(h["max_model_len"] + h.get("num_speculative_tokens", 0)) // span)
    nr["block_ids"][g] = nr["block_ids"][g] + [null] * (width + 1 - len(nr["block_ids"][g]))
    return k, nr["req_id"]


def short_model_len(L, rng):
    """max_model_len one below the longest sequence the trace schedules: the step that schedules its last
    position is refused (or the step before, whose sampled token would pass max_model_len)."""
    ends = []
    nc: dict[str, int] = {}
    for k in range(len(L) - 1):
        s = so(L, k)
        for nr in s["scheduled_new_reqs"]:
            nc[nr["req_id"]] = nr["num_computed_tokens"]
        c = s["scheduled_cached_reqs"]
        for r, n in zip(c["req_ids"], c["num_computed_tokens"]):
            nc[r] = n
        ends += [(nc[r] + n, k, r) for r, n in s["num_scheduled_tokens"].items()]
    longest = max(e for e, _, _ in ends)
    if longest - 1 < L[0]["block_size"] or L[0].get("async_scheduling") or any(
            len(nr["prompt_token_ids"]) >= longest for k in range(len(L) - 1) for nr in so(L, k)["scheduled_new_reqs"]):
        return None
    L[0]["max_model_len"] = longest - 1
    _, k, r = next(x for x in ends if x[0] == longest)
    return k, r


def blank_line(L, rng):
    return "blank", rng.randrange(1, len(L) - 1)


MUTATORS = [unknown_cached, finish_early, null_in_context, repeat_block, resumed_without_row, bool_block,
            schedule_more, drop_sampled, steal_block, new_twice, few_rows, cross_group_block, finish_twice,
            new_while_preempted, not_resumed, wide_row, short_model_len]
# faults replay runs through (vLLM's workers would too): only validate names them. A block in two groups
# corrupts KV only where groups share memory (vLLM's hybrid layers do; replay's KV cache gives each group its
# own pages); a finished id listed again is ignored by vLLM's workers, as it is by replay.
REPLAY_RUNS = {cross_group_block, finish_twice}


def plant(name: str, mutator, seed: int, tmp: Path) -> tuple[Path, object] | None:
    """Write trace `name` with `mutator`'s fault planted (seed picks the site) under `tmp`."""
    L = load(name)
    where = mutator(L, random.Random(seed))
    if where is None:
        return None
    return write(tmp / f"{Path(name).name.split('.')[0]}-{mutator.__name__}-{seed}.jsonl", L), where


def plant_everywhere(mutator, tmp: Path):
    """(name, path, where) for each small trace that has a site for `mutator`, its fault planted (seed 0)."""
    for name in SMALL:
        got = plant(name, mutator, 0, tmp)
        if got is not None:
            yield name, *got
