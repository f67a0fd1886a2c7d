"""Multi-field edits of real step lines, for the differential fuzz (tests/test_fuzz_multi.py): each mutation
applies 2 or 3 edits at once to one step line of a bundled trace, so that fields contradict each other (an id
repeated in one list and still missing from another, totals re-summed so that only deeper checks can tell).

Rules:
- An edit takes (step, rng, ctx) and changes `step` (a parsed step line) in place, returning a short label, or
  None when the line has no site for it. `ctx` is the trace's header line (a dict).
- Everything is drawn from the `random.Random` passed in, so one seed gives one mutation.
- `mutate` applies 2 or 3 distinct edits (a re-summed total, when drawn, always last) and returns their labels.
"""

from __future__ import annotations

import random

GHOST = "ghost"  # a request id no trace uses
CACHED_COLUMNS = ("new_block_ids", "num_computed_tokens", "num_output_tokens")  # parallel to req_ids


def _so(step: dict) -> dict:
    return step["scheduler_output"]


def _cached(step: dict) -> dict:
    return _so(step)["scheduled_cached_reqs"]


def _nst(step: dict) -> dict:
    return _so(step)["num_scheduled_tokens"]


def _scheduled(step: dict) -> list[str]:
    return list(_nst(step))


def _known_ids(step: dict) -> list[str]:
    """Every id the line names: new, cached, scheduled, finished, preempted."""
    so = _so(step)
    ids = [r["req_id"] for r in so["scheduled_new_reqs"]] + list(_cached(step)["req_ids"]) + list(_nst(step))
    ids += list(so.get("finished_req_ids") or []) + list(so.get("preempted_req_ids") or [])
    return list(dict.fromkeys(x for x in ids if isinstance(x, str)))


def _columns(c: dict) -> list[str]:
    return [k for k in CACHED_COLUMNS if isinstance(c.get(k), list) and len(c[k]) == len(c["req_ids"])]


# ------------------------------------------------------------------------------------------------ edits


def repeat_cached_id(step, rng, ctx):
    """A cached id written twice in req_ids: over another entry (whose id stays in num_scheduled_tokens), or
    appended with its parallel columns extended consistently, or appended alone."""
    c = _cached(step)
    ids = c["req_ids"]
    if not ids:
        return None
    i = rng.randrange(len(ids))
    how = rng.choice(["over", "append", "append_bare"]) if len(ids) > 1 else rng.choice(["append", "append_bare"])
    if how == "over":
        j = rng.choice([j for j in range(len(ids)) if j != i])
        ids[j] = ids[i]
        return f"repeat_cached_id:over[{j}]={ids[i]}"
    cols = _columns(c)
    ids.append(ids[i])
    if how == "append":
        for k in cols:
            c[k].append(c[k][i])
    return f"repeat_cached_id:{how}={ids[i]}"


def repeat_new_req(step, rng, ctx):
    """A new request listed twice (the copy identical, or with its own computed count)."""
    new = _so(step)["scheduled_new_reqs"]
    if not new:
        return None
    r = dict(rng.choice(new))
    if rng.random() < 0.3:
        r["num_computed_tokens"] = r.get("num_computed_tokens", 0) + 1
    new.insert(rng.randrange(len(new) + 1), r)
    return f"repeat_new_req={r['req_id']}"


def drop_id(step, rng, ctx):
    """An id dropped from one list and kept in the other: from req_ids (columns popped or not), from
    scheduled_new_reqs, or from num_scheduled_tokens."""
    c, so, nst = _cached(step), _so(step), _nst(step)
    sites = ["nst"] if nst else []
    sites += ["cached"] if c["req_ids"] else []
    sites += ["new"] if so["scheduled_new_reqs"] else []
    if not sites:
        return None
    where = rng.choice(sites)
    if where == "nst":
        r = rng.choice(list(nst))
        del nst[r]
        return f"drop_id:nst={r}"
    if where == "new":
        r = so["scheduled_new_reqs"].pop(rng.randrange(len(so["scheduled_new_reqs"])))
        return f"drop_id:new={r['req_id']}"
    i = rng.randrange(len(c["req_ids"]))
    cols = _columns(c)
    r = c["req_ids"].pop(i)
    if rng.random() < 0.7:
        for k in cols:
            c[k].pop(i)
        return f"drop_id:cached={r}"
    return f"drop_id:cached_bare={r}"


def extra_scheduled(step, rng, ctx):
    """One more key in num_scheduled_tokens: an unknown id, a finished or preempted id, or an id of a list."""
    nst = _nst(step)
    so = _so(step)
    pool = [GHOST] + [x for x in (so.get("finished_req_ids") or []) + (so.get("preempted_req_ids") or [])
                      if isinstance(x, str)]
    r = rng.choice(pool)
    if r in nst:
        r = r + "-x"
    nst[r] = rng.choice([1, 1, 2, ctx.get("block_size", 16)])
    return f"extra_scheduled={r}:{nst[r]}"


def move_new_to_cached(step, rng, ctx):
    """A new request listed as cached instead (or as well)."""
    so, c = _so(step), _cached(step)
    if not so["scheduled_new_reqs"]:
        return None
    i = rng.randrange(len(so["scheduled_new_reqs"]))
    keep = rng.random() < 0.4
    r = so["scheduled_new_reqs"][i] if keep else so["scheduled_new_reqs"].pop(i)
    cols = _columns(c)
    c["req_ids"].append(r["req_id"])
    values = {"new_block_ids": r.get("block_ids"), "num_computed_tokens": r.get("num_computed_tokens", 0),
              "num_output_tokens": 0}
    for k in cols:
        c[k].append(values[k])
    return f"move_new_to_cached{'_kept' if keep else ''}={r['req_id']}"


def move_cached_to_new(step, rng, ctx):
    """A cached request listed as new instead (or as well), with a prompt as long as its context."""
    so, c = _so(step), _cached(step)
    if not c["req_ids"]:
        return None
    i = rng.randrange(len(c["req_ids"]))
    keep = rng.random() < 0.4
    r = c["req_ids"][i]
    nc = c["num_computed_tokens"][i] if isinstance(c.get("num_computed_tokens"), list) and i < len(
        c["num_computed_tokens"]) else 0
    nc = nc if isinstance(nc, int) and 0 <= nc < 100_000 else 0
    blocks = c["new_block_ids"][i] if isinstance(c.get("new_block_ids"), list) and i < len(c["new_block_ids"]) \
        else None
    G = len(ctx.get("kv_cache_groups") or [None])
    if not keep:
        cols = _columns(c)
        c["req_ids"].pop(i)
        for k in cols:
            c[k].pop(i)
    prompt = [7] * (nc + _nst(step).get(r, 1))
    so["scheduled_new_reqs"].append({"req_id": r, "prompt_token_ids": prompt,
                                     "block_ids": blocks if blocks is not None else [[] for _ in range(G)],
                                     "num_computed_tokens": nc, "prefill_token_ids": None})
    return f"move_cached_to_new{'_kept' if keep else ''}={r}"


def _add_to_list(step, rng, key: str) -> str | None:
    """A scheduled (or already listed) id added to the scheduler output's list `key`."""
    lst = _so(step).setdefault(key, [])
    pool = _scheduled(step) + [x for x in lst if isinstance(x, str)]
    if not pool:
        return None
    r = rng.choice(pool)
    lst.append(r)
    return r


def add_finished(step, rng, ctx):
    """A scheduled (or already finished) id added to finished_req_ids."""
    r = _add_to_list(step, rng, "finished_req_ids")
    return None if r is None else f"add_finished={r}"


def add_preempted(step, rng, ctx):
    """A scheduled (or already preempted) id added to preempted_req_ids."""
    r = _add_to_list(step, rng, "preempted_req_ids")
    return None if r is None else f"add_preempted={r}"


def add_resumed(step, rng, ctx):
    """A cached id (or an unknown one) marked resumed."""
    c = _cached(step)
    if not isinstance(c.get("resumed_req_ids"), list):
        return None
    r = rng.choice(c["req_ids"] + [GHOST]) if c["req_ids"] else GHOST
    c["resumed_req_ids"].append(r)
    return f"add_resumed={r}"


def _block_rows(step):
    """(label, row) of every block id list of the line (new requests' block_ids, cached new_block_ids)."""
    rows = []
    for r in _so(step)["scheduled_new_reqs"]:
        for g, row in enumerate(r.get("block_ids") or []):
            if isinstance(row, list):
                rows.append((f"{r['req_id']}/new/{g}", row))
    c = _cached(step)
    for i, entry in enumerate(c.get("new_block_ids") or []):
        if isinstance(entry, list) and i < len(c["req_ids"]):
            for g, row in enumerate(entry):
                if isinstance(row, list):
                    rows.append((f"{c['req_ids'][i]}/cached/{g}", row))
    return rows


def edit_blocks(step, rng, ctx):
    """A block id list shortened, lengthened, or one id changed (another pool id, the null block, past the
    pool)."""
    rows = _block_rows(step)
    if not rows:
        return None
    label, row = rng.choice(rows)
    pool = ctx.get("num_gpu_blocks", 64)
    how = rng.choice(["shorten", "lengthen", "change"] if row else ["lengthen"])
    if how == "shorten":
        del row[rng.randrange(len(row)):]
    elif how == "lengthen":
        row.extend(rng.randrange(1, pool) for _ in range(rng.randint(1, 3)))
    else:
        row[rng.randrange(len(row))] = rng.choice([rng.randrange(1, pool), ctx.get("null_block_id") or 0, pool])
    return f"edit_blocks:{how}={label}"


def change_computed(step, rng, ctx):
    """num_computed_tokens of a new or cached request moved by one token, one block or back to 0."""
    so, c = _so(step), _cached(step)
    sites = [("new", i) for i in range(len(so["scheduled_new_reqs"]))]
    if isinstance(c.get("num_computed_tokens"), list):
        sites += [("cached", i) for i in range(len(c["num_computed_tokens"]))]
    if not sites:
        return None
    where, i = rng.choice(sites)
    bs = ctx.get("block_size", 16)
    delta = rng.choice([1, -1, bs, -bs, 2 * bs])
    if where == "new":
        r = so["scheduled_new_reqs"][i]
        if not isinstance(r.get("num_computed_tokens"), int):
            return None
        r["num_computed_tokens"] = max(0, r["num_computed_tokens"] + delta) if rng.random() < 0.8 else 0
        return f"change_computed:new={r['req_id']}"
    v = c["num_computed_tokens"][i]
    if not isinstance(v, int):
        return None
    c["num_computed_tokens"][i] = max(0, v + delta) if rng.random() < 0.8 else 0
    return f"change_computed:cached[{i}]"


def change_scheduled(step, rng, ctx):
    """One request's count in num_scheduled_tokens moved by one token or one block (total untouched)."""
    nst = _nst(step)
    if not nst:
        return None
    r = rng.choice(list(nst))
    if not isinstance(nst[r], int):
        return None
    nst[r] = max(0, nst[r] + rng.choice([1, -1, ctx.get("block_size", 16)]))
    return f"change_scheduled={r}:{nst[r]}"


def extra_drafts(step, rng, ctx):
    """Draft tokens for a scheduled request beyond num_speculative_tokens (its count raised to match, or not)."""
    nst = _nst(step)
    if not nst:
        return None
    so = _so(step)
    spec = so.get("scheduled_spec_decode_tokens")
    if not isinstance(spec, dict):
        spec = so["scheduled_spec_decode_tokens"] = {}
    r = rng.choice(list(nst))
    k = (ctx.get("num_speculative_tokens") or 0) + rng.randint(1, 3)
    spec[r] = [rng.randrange(1, 1000) for _ in range(k)]
    if rng.random() < 0.5 and isinstance(nst[r], int):
        nst[r] += k
    return f"extra_drafts={r}:{k}"


def sampled_unscheduled(step, rng, ctx):
    """Sampled tokens for an id this step does not schedule (unknown, finished, or dropped)."""
    sampled = step.get("sampled_token_ids")
    if not isinstance(sampled, dict):
        sampled = step["sampled_token_ids"] = {}
    so = _so(step)
    pool = [GHOST] + [x for x in (so.get("finished_req_ids") or []) if isinstance(x, str)]
    r = rng.choice(pool)
    sampled[r] = [rng.randrange(1, 1000)]
    return f"sampled_unscheduled={r}"


def rename_new(step, rng, ctx):
    """A new request takes the id of a cached one (its count moved along, or not)."""
    so, c = _so(step), _cached(step)
    if not so["scheduled_new_reqs"] or not c["req_ids"]:
        return None
    r = rng.choice(so["scheduled_new_reqs"])
    old, new = r["req_id"], rng.choice(c["req_ids"])
    r["req_id"] = new
    nst = _nst(step)
    if rng.random() < 0.5 and old in nst:
        nst.pop(old)
    return f"rename_new={old}->{new}"


def rename_everywhere(step, rng, ctx):
    """A scheduled id renamed to another live one in every list but one."""
    ids = _known_ids(step)
    if len(ids) < 2:
        return None
    a, b = rng.sample(ids, 2)
    so, c = _so(step), _cached(step)
    skip = rng.choice(["nst", "cached", "new", "sampled"])
    if skip != "cached":
        c["req_ids"] = [b if x == a else x for x in c["req_ids"]]
    if skip != "new":
        for r in so["scheduled_new_reqs"]:
            if r["req_id"] == a:
                r["req_id"] = b
    if skip != "nst":
        so["num_scheduled_tokens"] = {(b if x == a else x): n for x, n in _nst(step).items()}
    if skip != "sampled" and isinstance(step.get("sampled_token_ids"), dict):
        step["sampled_token_ids"] = {(b if x == a else x): t for x, t in step["sampled_token_ids"].items()}
    return f"rename_everywhere={a}->{b}(not {skip})"


def resum_total(step, rng, ctx):
    """total_num_scheduled_tokens set to the sum of the counts (so the sum check passes)."""
    nst = _nst(step)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in nst.values()):
        return None
    _so(step)["total_num_scheduled_tokens"] = sum(nst.values())
    return "resum_total"


EDITS = [repeat_cached_id, repeat_new_req, drop_id, extra_scheduled, move_new_to_cached, move_cached_to_new,
         add_finished, add_preempted, add_resumed, edit_blocks, change_computed, change_scheduled, extra_drafts,
         sampled_unscheduled, rename_new, rename_everywhere]
# id edits are drawn more often: the bug class this fuzz is for (review-architecture.md, d.3)
WEIGHTS = [4, 2, 3, 3, 2, 2, 2, 1, 1, 2, 2, 2, 1, 1, 1, 2]


def mutate(step: dict, rng: random.Random, ctx: dict) -> list[str]:
    """Apply 2 or 3 distinct edits to `step` in place; a re-summed total (drawn half the time) comes last and
    counts as one. Returns the labels (fewer than 2 only when the line has too few sites)."""
    want = rng.choice([2, 3])
    resum = rng.random() < 0.5
    labels: list[str] = []
    tried: set[int] = set()
    while len(labels) < want - resum and len(tried) < len(EDITS):
        k = rng.choices(range(len(EDITS)), WEIGHTS)[0]
        if k in tried:
            continue
        tried.add(k)
        label = EDITS[k](step, rng, ctx)
        if label is not None:
            labels.append(label)
    if resum:
        label = resum_total(step, rng, ctx)
        if label is not None:
            labels.append(label)
    return labels
