"""`kvmap explain`: how one step's scheduler decisions become GPU addresses, token by token.

Rules: replay (numpy worker, no KV cache) up to the step, then describe it as plain data: the step (scheduler
order, batch order, `idx_mapping`, `query_start_loc`, `seq_lens`, what changed; a streaming-input
continuation is a "continued session", with its held and new token count, computed tokens and blocks), a
request (row, batch row, token range, positions, block-table rows per group with the blocks this step
touches, and the sliding-window entries Model Runner V2's forward-pass table holds as block 0), and a token
(the whole chain, each link with its arithmetic, for every KV cache group, and the bytes it occupies),
with the step's whole mappings (the `--dump-mappings` record) and its DCP layout, which the pictures draw.
Renderers (kvmap/render/explain.py, kvmap/render/html/) draw it; `--json` prints it. Nothing here formats
for a terminal.
"""

from __future__ import annotations

import numpy as np

from kvmap.errors import KvmapError
from kvmap.explain.forward import forward_dict
from kvmap.forward.config import ForwardConfig, resolve
from kvmap.forward.graph_parts import v1_reorder_threshold
from kvmap.kv.cache import KVGeometry
from kvmap.layout import PAD_SLOT_ID, GroupLayout, rank_layouts
from kvmap.trace import Trace
from kvmap.workers.host import NumpyWorker

NULLED = "out of window (block 0 in the forward-pass table: Model Runner V2 nulls it)"


def _list(items: list[str], limit: int = 12) -> str:
    s = ", ".join(items[:limit])
    return s + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def first_scheduled_step(trace: Trace, req_id: str) -> int:
    """The first step that schedules `req_id` (`explain --req` without `--step`)."""
    steps = 0
    for s in trace.steps():
        steps += 1
        if req_id in s.scheduler_output.num_scheduled_tokens:
            return s.step
    raise KvmapError(f"request {req_id!r} is never scheduled in the trace's {steps} steps", field="--req")


def explain(trace: Trace, step: int, req_id: str | None = None, token: int | None = None,
            group: int | None = None, geometry: KVGeometry | None = None, runner: str | None = None,
            forward: tuple = (None, None, None)) -> dict:
    """The step as plain data; with `req_id` (or a flat `token` index) its request, with `token` the token's
    whole chain, in every KV cache group (or only `group`). `runner` (default: the header's, else mrv2) sets the
    batch order and the forward-pass rules (`forward`: the sampler indices, the padded shape, the split and the
    FlashInfer indices with their arithmetic); `forward`: the overrides (attention backend, cudagraph mode,
    capture sizes) of the header's keys."""
    h = trace.header
    geometry = (geometry or KVGeometry()).check()
    if step < 0:
        raise KvmapError(f"step {step} does not exist: steps are numbered from 0", field="--step")
    if group is not None and not 0 <= group < h.num_groups:
        raise KvmapError(f"group {group} does not exist: the trace has groups 0..{h.num_groups - 1}", field="--group")
    worker, target, held = _replay_to(trace, step, resolve(h, runner, *forward))
    m = worker.mappings()
    qsl = m.query_start_loc.tolist()
    groups = [g for g in range(h.num_groups) if group is None or g == group]
    origin = _origins(target.scheduler_output, held)
    out = _step_dict(trace, target, m, origin, geometry, held)
    out["forward"] = forward_dict(worker.forward_config, worker.forward, m, worker.forward_step())
    # the step's whole mappings (the --dump-mappings record) and the DCP layout: what the pictures draw
    out["mappings"] = m.to_dict(target.step)
    out["layout"] = {"cp_size": h.decode_context_parallel_size, "interleave": h.cp_kv_cache_interleave_size,
                     "ranks": list(worker.ranks), "null_block_id": h.null_block_id,
                     "group_cp": [lay.cp_size for lay in worker.layouts],  # [G] 1: a replicated group
                     "has_slots": [lay.has_slots for lay in worker.layouts]}  # [G] False: a state group
    if req_id is None:
        if token is not None:  # a flat token index
            if not 0 <= token < m.num_tokens:
                raise KvmapError(f"token {token} does not exist: step {step} has flat tokens 0..{m.num_tokens - 1}",
                                 field="--token")
            b = int(np.searchsorted(m.query_start_loc, token, side="right")) - 1
            req_id, token = m.req_ids[b], token - qsl[b]
        else:
            return out
    out["request"] = _request_dict(worker, target, m, req_id, origin, groups)
    if token is not None:
        out["token"] = _token_chain(worker, target, m, out["request"], token, groups, geometry)
    return out


def _replay_to(trace: Trace, step: int, config: ForwardConfig) -> tuple[NumpyWorker, object, dict]:
    """A numpy worker (no KV cache) replayed through `step` under `config`'s runner, computing the forward
    inputs; (the worker, the step, what each continued session held just before it: `_held`)."""
    worker = NumpyWorker(trace.header)
    worker.use_batch_order(config.runner, v1_reorder_threshold(config) if config.runner == "v1" else None)
    worker.use_forward(config)
    target = None
    last = -1
    held: dict = {}
    for s in trace.steps(0, step + 1):
        last = s.step
        if s.step == step:
            held = _held(worker, s)
        worker.run_step(s)
        if s.step == step:
            target = s
            break
        worker.append_sampled()
    if target is None:
        if last < 0:
            raise KvmapError("the trace has no steps (a header and nothing after it): nothing to explain",
                             path=trace.name)
        raise KvmapError(f"step {step} does not exist: the trace has steps 0..{last}", path=trace.name,
                         field="--step")
    return worker, target, held


def _held(worker: NumpyWorker, step) -> dict:
    """Streaming-input continuations of `step` (a live, not preempted id sent as new): what the request held
    before it, {req_id: {"tokens", "blocks"}}."""
    st = worker.state
    out = {}
    for nr in step.scheduler_output.scheduled_new_reqs:
        row = st.req_id_to_index.get(nr.req_id)
        if row is None or nr.req_id in st.preempted:
            continue
        out[nr.req_id] = {"tokens": int(st.total_len[row]),
                          "blocks": [st.block_tables[g][row, :int(st.num_blocks[g, row])].tolist()
                                     for g in range(worker.header.num_groups)]}
    return out


def _continued(nr, held: dict) -> dict:
    """What a continuation changed: the tokens the request held (prompt and sampled), the new prompt's length,
    its num_computed_tokens (what stays cached), and each group's block row (held -> now)."""
    return {"held_tokens": held["tokens"], "prompt_len": len(nr.token_ids),
            "num_computed_tokens": nr.num_computed_tokens,
            "blocks": [[old, list(new)] for old, new in zip(held["blocks"], nr.block_ids)]}


def _origins(so, held: dict):
    """How each request of the step got there: new (with its prefix hit), a continued session, resumed (v1 or
    v2), or cached."""
    new_ids = {nr.req_id: nr for nr in so.scheduled_new_reqs}
    c = so.scheduled_cached_reqs

    def origin(r: str) -> str:
        if r in held:
            return "continued session"
        if r in new_ids:
            nr = new_ids[r]
            if nr.prefill_token_ids is not None and len(nr.prefill_token_ids) > len(nr.prompt_token_ids):
                return "resumed (re-added as new, v2)"
            return "new" + (f" (prefix hit: {nr.num_computed_tokens} tokens)" if nr.num_computed_tokens else "")
        return "resumed (v1)" if r in c.resumed_req_ids else "cached"

    return origin


def _step_dict(trace: Trace, target, m, origin, geometry: KVGeometry, held: dict) -> dict:
    """The step: groups, scheduler order, batch order, the mappings, what changed, the KV geometry."""
    h = trace.header
    so = target.scheduler_output
    qsl = m.query_start_loc.tolist()
    new_ids = {nr.req_id: nr for nr in so.scheduled_new_reqs}
    c = so.scheduled_cached_reqs
    appended = {}
    for r, new in zip(c.req_ids, c.new_block_ids):
        if new is not None:
            appended[r] = {"replaced" if r in c.resumed_req_ids else "appended": new}
    return {
        "trace": trace.name,
        "step": target.step,
        "line": target.line,
        "protocol": h.model_runner_protocol,
        "groups": [{"group": g, "kind": grp.kind, "block_size": grp.block_size, "sliding_window": grp.sliding_window,
                    "attention_chunk_size": grp.attention_chunk_size} for g, grp in enumerate(h.kv_cache_groups)],
        "scheduler_order": [{"req_id": r, "num_scheduled_tokens": n, "origin": origin(r)}
                            for r, n in so.num_scheduled_tokens.items()],
        "batch": [{"batch_idx": b, "req_id": r, "row": int(m.idx_mapping[b]),
                   "num_computed_tokens": int(m.num_computed_tokens[b]),
                   "num_scheduled_tokens": int(m.num_scheduled_tokens[b]),
                   "num_draft_tokens": len(so.scheduled_spec_decode_tokens.get(r, [])),
                   "tokens": [qsl[b], qsl[b + 1]], "seq_len": int(m.seq_lens[b])} for b, r in enumerate(m.req_ids)],
        "idx_mapping": m.idx_mapping.tolist(),
        "query_start_loc": qsl,
        "seq_lens": m.seq_lens.tolist(),
        "num_tokens": m.num_tokens,
        "changes": {"finished": list(so.finished_req_ids), "preempted": list(so.preempted_req_ids),
                    "added": [r for r in new_ids if origin(r).startswith("new")],
                    "resumed": [r for r in so.num_scheduled_tokens if origin(r).startswith("resumed")],
                    "continued": {r: _continued(new_ids[r], held[r]) for r in new_ids if r in held},
                    "blocks": appended},
        "kv_geometry": {"num_kv_heads": geometry.num_kv_heads, "head_size": geometry.head_size,
                        "dtype": geometry.dtype, "bytes_per_token": geometry.bytes_per_token},
    }


def _request_dict(worker: NumpyWorker, target, m, req_id: str, origin, groups: list[int]) -> dict:
    """One scheduled request: its rows, token range, positions, and block-table rows with each block's state."""
    h, st, step = worker.header, worker.state, target.step
    so = target.scheduler_output
    qsl = m.query_start_loc.tolist()
    batch_of = {r: b for b, r in enumerate(m.req_ids)}
    if req_id not in batch_of:
        where = "is not scheduled in" if req_id in st.req_id_to_index else "does not exist at"
        raise KvmapError(f"request {req_id!r} {where} step {step}; scheduled: {_list(list(m.req_ids)) or 'none'}",
                         field="--req")
    b = batch_of[req_id]
    row = int(m.idx_mapping[b])
    nc = int(m.num_computed_tokens[b])
    n = int(m.num_scheduled_tokens[b])
    drafts = len(so.scheduled_spec_decode_tokens.get(req_id, []))
    req: dict = {"req_id": req_id, "batch_idx": b, "row": row, "origin": origin(req_id),
                 "num_computed_tokens": nc, "num_scheduled_tokens": n, "num_draft_tokens": drafts,
                 "tokens": [qsl[b], qsl[b + 1]], "positions": [nc, nc + n],  # both [start, end)
                 "input_ids": m.input_ids[qsl[b]:qsl[b + 1]].tolist(), "seq_len": nc + n, "block_tables": []}
    for g in groups:
        grp = h.kv_cache_groups[g]
        bs = st.block_spans[g]  # positions one block id spans: block_size * cp
        nb = int(st.num_blocks[g, row])
        ids = st.block_tables[g][row, :nb].tolist()
        layout = GroupLayout.of(grp)
        lo = layout.readable_start(nc) // bs
        n0 = layout.null_history_blocks(nc) if g in worker.null_groups and worker.is_mrv2 else 0
        touched = list(range(nc // bs, (nc + n - 1) // bs + 1))
        entries = []
        for j, blk in enumerate(ids):
            if blk == (h.null_block_id if h.null_block_id is not None else 0) and grp.kind != "full_attention":
                state = "null"
            elif j < n0:
                state = NULLED
            elif j < lo:
                state = "out of window (stale: never read or written again)"
            elif j in touched:
                state = "written this step"
            elif j * bs < nc + n:
                state = "read"
            else:
                state = "allocated ahead"
            entries.append({"logical_block": j, "block": blk, "state": state})
        if not grp.uses_slot_mapping:
            entries = [dict(e, state="state index") for e in entries]
        bt = {"group": g, "kind": grp.kind, "block_size": grp.block_size, "entries": entries}
        if n0 or (g in worker.null_groups and worker.is_mrv2):
            R = layout.num_retained_tokens
            bt["null_history_blocks"] = n0  # leading entries the forward-pass table holds as block 0
            bt["null_history"] = (f"Model Runner V2: entries 0..{n0 - 1} of the forward-pass row are block 0: "
                                  if n0 else "Model Runner V2 nulls no entry of this row: ") + \
                f"max({nc} - R, 0) // {grp.block_size} = {n0}, R = {grp.sliding_window} - 1 + " \
                f"{layout.extra_retained_tokens} = {R} (sliding_window - 1 + extra_retained_tokens)"
        req["block_tables"].append(bt)
    return req


def _token_chain(worker: NumpyWorker, target, m, req: dict, token: int, groups: list[int],
                 geometry: KVGeometry) -> dict:
    """One token's whole chain, request -> batch -> row -> flat token -> position -> block -> slot -> bytes, in
    every group (on every rank: `_rank_chain`), each link with its arithmetic."""
    h, st, step = worker.header, worker.state, target.step
    req_id, b, row = req["req_id"], req["batch_idx"], req["row"]
    nc, n, drafts = req["num_computed_tokens"], req["num_scheduled_tokens"], req["num_draft_tokens"]
    qsl = m.query_start_loc.tolist()
    if not 0 <= token < n:
        raise KvmapError(f"token {token} does not exist: request {req_id!r} has {n} token"
                         f"{'s' if n != 1 else ''} in step {step} (0..{n - 1})", field="--token")
    t = qsl[b] + token
    p = int(m.positions[t])
    chain = {"token": token, "flat_token_index": t, "position": p, "input_id": int(m.input_ids[t]),
             "is_draft": token >= n - drafts, "links": [
                 f"request {req_id!r} -> batch {b} (batch order: sorted by scheduled tokens)",
                 f"batch {b} -> row {row} (idx_mapping[{b}] = {row})",
                 f"token {token} of the request -> flat token {qsl[b]} + {token} = {t} "
                 f"(query_start_loc[{b}] = {qsl[b]})",
                 f"flat token {t} -> position {nc} + {token} = {p} (num_computed_tokens + offset)",
             ], "groups": []}
    H, D = geometry.num_kv_heads, geometry.head_size
    elem = geometry.bytes_per_token // geometry.lanes
    multirank = h.decode_context_parallel_size > 1 or h.has_kernel_split or len(st.kv_groups) < h.num_groups
    for g in groups:
        grp = h.kv_cache_groups[g]
        if multirank:
            chain["groups"].append(_rank_chain(worker, m, g, b, row, t, p, geometry))
            continue
        bs = grp.block_size
        layout = GroupLayout.of(grp)
        lb, off = layout.block_of(p)
        blk = int(st.block_tables[g][row, lb])
        slot = int(m.slot_mapping[g, t])
        assert slot == layout.slot(st.block_tables[g][row], p)
        plane = h.num_gpu_blocks * bs * H * D * elem  # bytes of the K half of one layer's tensor
        k0 = slot * H * D * elem
        chain["groups"].append({
            "group": g, "kind": grp.kind, "block_size": bs, "logical_block": lb, "offset": off, "block": blk,
            "slot": slot, "links": [
                f"position {p} -> block {p} // {bs} = {lb}, offset {p} % {bs} = {off}",
                f"block_table[{row}][{lb}] = {blk}",
                f"slot {blk} * {bs} + {off} = {slot}",
                f"bytes (one layer, [2, {h.num_gpu_blocks}, {bs}, {H}, {D}] {geometry.dtype}): "
                f"K at {k0}..{k0 + H * D * elem - 1}, "
                f"V at {plane + k0}..{plane + k0 + H * D * elem - 1} ({H * D * elem} bytes each)",
            ]})
    return chain


def _rank_chain(worker: NumpyWorker, m, g: int, b: int, row: int, t: int, p: int, geometry: KVGeometry) -> dict:
    """One group's chain on every DCP rank: the virtual block and offset, which rank holds the token, its
    local position and slot on that rank, the kernel block it lands in; each link with its arithmetic."""
    h, st = worker.header, worker.state
    grp = h.kv_cache_groups[g]
    lays = [x[g] for x in rank_layouts(h, range(h.decode_context_parallel_size))]
    lay = lays[0]
    bs, cp, I, vbs = lay.block_size, lay.cp_size, lay.interleave, lay.virtual_block_size
    K, k = lay.kernel_size, lay.kernel_blocks_per_block
    vb, off = lay.block_of(p)
    nb = int(st.num_blocks[g, row])
    blk = int(st.block_tables[g][row, vb]) if vb < nb else None
    d: dict = {"group": g, "kind": grp.kind, "block_size": bs, "kernel_block_size": K, "cp_size": cp,
               "interleave": I, "logical_block": vb, "offset": off, "block": blk, "ranks": [], "links": []}
    links = d["links"]
    if not lay.has_slots:
        row_ids = st.block_tables[g][row, :nb].tolist()
        links.append(f"a state group (uses_slot_mapping false): block_table[{row}] = {row_ids} holds state "
                     f"indices, not KV blocks")
        links.append(f"slot {PAD_SLOT_ID} (PAD_SLOT_ID) on every rank; not read back as KV")
        d["slot"] = PAD_SLOT_ID
        d["ranks"] = [{"rank": r, "holds": False, "slot": PAD_SLOT_ID, "links": []} for r in range(len(lays))]
        return d
    if cp > 1:
        links.append(f"position {p} -> virtual block {p} // ({bs} * {cp}) = {vb}, offset {p} % {vbs} = {off} "
                     f"(a block id spans block_size * cp = {vbs} positions)")
        links.append(f"block_table[{row}][{vb}] = {blk} (the same id on every rank)")
        owner = off // I % cp
        links.append(f"held by rank ({off} // {I}) % {cp} = {owner} (interleave {I})")
    else:
        owner = 0
        links.append(f"position {p} -> block {p} // {bs} = {vb}, offset {p} % {bs} = {off}")
        links.append(f"block_table[{row}][{vb}] = {blk}"
                     + (" (replicated on every DCP rank: dcp_sharded false)" if h.decode_context_parallel_size > 1
                        else ""))
    seq_len = int(m.seq_lens[b])
    H, D = geometry.tp_shard(h.tensor_parallel_size).num_kv_heads, geometry.head_size
    elem = geometry.bytes_per_token // geometry.lanes
    for i, rl in enumerate(lays):
        r = rl.cp_rank
        got = int(m.rank_slot_mapping[i, g, t]) if m.rank_slot_mapping is not None else int(m.slot_mapping[g, t])
        want = int(rl.slot(st.block_tables[g][row], p))
        assert got == want, (got, want)
        rd: dict = {"rank": r, "holds": want != PAD_SLOT_ID, "slot": want, "links": []}
        rlinks = rd["links"]
        if m.dcp_local_seq_lens is not None:
            q, rem = divmod(seq_len, cp * I)
            rd["dcp_local_seq_len"] = int(m.dcp_local_seq_lens[i, b])
            rlinks.append(f"dcp_local_seq_len ({seq_len} // ({cp} * {I})) * {I} + clamp({rem} - {r} * {I}, 0, {I}) "
                          f"= {q * I} + {min(max(rem - r * I, 0), I)} = {rd['dcp_local_seq_len']}")
        if want == PAD_SLOT_ID:
            rlinks.append(f"not local: ({off} // {I}) % {cp} = {owner} != {r} -> slot {PAD_SLOT_ID} (PAD_SLOT_ID)")
            d["ranks"].append(rd)
            continue
        lo = rl.local_offset(p)
        lp = rl.local_position(p)
        if cp > 1:
            rlinks.append(f"local offset ({off} // ({I} * {cp})) * {I} + {off} % {I} = {lo}")
            rlinks.append(f"local position {vb} * {bs} + {lo} = {lp}")
        rlinks.append(f"slot {blk} * {bs} + {lo} = {want}")
        if k > 1:
            kb, ko = divmod(lp, K)
            kid = blk * k + (kb - vb * k)
            rd.update(kernel_block=kid, kernel_logical_block=kb, kernel_offset=ko)
            rlinks.append(f"kernel block: {lp} // {K} = {kb} -> kernel_block_table[{row}][{kb}] = {blk} * {k} + "
                          f"{kb - vb * k} = {kid}, offset {lp} % {K} = {ko}; slot {kid} * {K} + {ko} = {kid * K + ko}")
        plane = h.num_gpu_blocks * bs * H * D * elem
        k0 = want * H * D * elem
        rlinks.append(f"bytes (rank {r}'s shard, one layer, [2, {h.num_gpu_blocks}, {bs}, {H}, {D}] "
                      f"{geometry.dtype}; {H} of the KV heads per TP rank): K at {k0}..{k0 + H * D * elem - 1}, "
                      f"V at {plane + k0}..{plane + k0 + H * D * elem - 1}")
        d["ranks"].append(rd)
    d["slot"] = d["ranks"][owner]["slot"]
    d["rank"] = owner
    return d
