"""`kvmap explain`'s forward-pass section: the step's sampler indices, padded shape, decode/prefill split and
FlashInfer indices (kvmap/forward), each with its arithmetic.

Rules: plain data, as the rest of explain (the renderer draws it); each request's line states the rule of its
runner with this step's numbers, so that a reader can redo it by hand (docs/trace-format.md, "Forward-pass dump
keys"); the arrays themselves are the dump's keys under vLLM's names.
"""

from __future__ import annotations

from kvmap.forward import flashinfer as FI
from kvmap.forward.config import ForwardConfig
from kvmap.forward.graph_parts import split_rule
from kvmap.forward.inputs import ForwardInputs, ForwardStep
from kvmap.forward.sampler import NUM_NEW_SAMPLED_TOKENS, STALE_INPUT_ID, mrv2_input_ids_spec


def forward_dict(config: ForwardConfig, fwd: ForwardInputs, m, step: ForwardStep) -> dict:
    """{runner, cudagraph_mode, skipped, sampler: {arrays..., rows: [one line of arithmetic per request]},
    padding: {...,  why}, split: [per group], flashinfer: [per FLASHINFER group]}."""
    s = fwd.sampler
    qsl = m.query_start_loc.tolist()
    out = {"runner": config.runner, "cudagraph_mode": config.cudagraph_mode,
           "attention_backends": [g.attention_backend for g in config.groups], "skipped": list(config.skipped),
           "sampler": s.to_dict()}
    rows = []
    r = step.rows
    if config.runner == "mrv2":
        last = step.last_sampled_tokens()
        cu = s.cu_num_logits.tolist()
        for b, req_id in enumerate(m.req_ids):
            n = cu[b + 1] - cu[b]
            line = (f"{req_id}: num_logits = {n - NUM_NEW_SAMPLED_TOKENS} drafts + {NUM_NEW_SAMPLED_TOKENS} = "
                    f"{n}; logits_indices[{cu[b]}:{cu[b + 1]}] = query_start_loc[{b + 1}] - {n} + j = "
                    f"{qsl[b + 1]} - {n} + 0..{n - 1} = {list(range(qsl[b + 1] - n, qsl[b + 1]))}")
            row = int(m.idx_mapping[b])
            seq, pre = int(r.seq_lens[b]), int(r.prefill_len[row])
            if seq <= pre:
                line += f"; input ids: prefill tokens (seq_len {seq} <= prefill_len {pre})"
            else:
                if seq - n >= pre:
                    line += f"; input_ids[{qsl[b + 1] - n}] = last_sampled_tokens[{row}] = {int(last[row])}"
                if n > NUM_NEW_SAMPLED_TOKENS:
                    line += f"; drafts at input_ids[{qsl[b + 1] - n + 1}:{qsl[b + 1]}]"
            rows.append(line)
        ids = mrv2_input_ids_spec(r, last)
        stale = [int(i) for i in (ids == STALE_INPUT_ID).nonzero()[0]]
        out["sampler"]["stale_input_ids"] = stale  # flat tokens neither MRV2 kernel writes (none in vLLM traces)
    else:
        for b, req_id in enumerate(m.req_ids):
            if s.num_draft_tokens is None:
                rows.append(f"{req_id}: logits_indices[{b}] = query_start_loc[{b + 1}] - 1 = {qsl[b + 1] - 1}")
                continue
            d = int(s.num_draft_tokens[b])
            cs = int(s.cu_num_sampled_tokens[b])
            rows.append(f"{req_id}: {d} drafts + 1 bonus = {d + 1} sampled rows; logits_indices = "
                        f"query_start_loc[{b + 1}] - {d + 1} + j = {list(range(qsl[b + 1] - d - 1, qsl[b + 1]))}; "
                        f"bonus_logits_indices[{b}] = cu_num_sampled_tokens[{b}] - 1 = {cs - 1}; "
                        f"num_decode_draft_tokens = {int(s.num_decode_draft_tokens[b])}")
    out["sampler"]["rows"] = rows
    out["padding"] = padding_dict(config, fwd.cudagraph, step)
    out["split"] = split_list(config, fwd.attention)
    out["flashinfer"] = flashinfer_list(config, fwd.backends, m)
    return out


def padding_dict(config: ForwardConfig, pad, step: ForwardStep) -> dict:
    """The step's graph choice and why: the runner's uniform-decode rule with this step's numbers."""
    d = pad.desc
    R, T = d.num_reqs, d.num_tokens
    qsl = step.rows.query_start_loc
    Q = int((qsl[1:] - qsl[:-1]).max()) if R else 0
    q = 1 + config.num_speculative_tokens
    top = pad.max_cudagraph_capture_size
    why = []
    if config.eager:
        why.append("cudagraph mode NONE: eager, nothing padded")
    elif config.runner == "v1":
        why.append(f"V1 uniform decode (shape only): max_query_len {Q} == 1 + k = {q} and num_tokens {T} == "
                   f"{Q} * {R} = {Q * R}: {d.uniform_decode}")
    else:
        why.append(f"MRV2 uniform token count: decode_graph_eligible and num_tokens {T} == max_query_len {Q} * "
                   f"num_reqs {R} = {Q * R}: {Q if d.uniform_decode else None}")
    if not config.eager and T > top:
        why.append(f"num_tokens {T} > the largest capture size {top}: eager, unpadded")
    elif d.cudagraph_mode == "FULL":
        how = (f"the decode graph: num_reqs_padded = {d.num_tokens_padded} // {q} = {d.num_reqs_padded}"
               if d.uniform_decode and d.num_reqs_padded * q == d.num_tokens_padded and
               config.cudagraph_mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
               else f"a mixed FULL graph: num_reqs_padded = min({d.num_tokens_padded}, max_num_seqs "
                    f"{config.max_num_seqs}) = {d.num_reqs_padded}")
        why.append(f"FULL graph of {d.num_tokens_padded} tokens (the smallest captured size >= {T}), {how}")
    elif d.cudagraph_mode == "PIECEWISE":
        why.append(f"PIECEWISE graph of {d.num_tokens_padded} tokens (the smallest captured size >= {T}); "
                   f"requests unpadded ({R})")
    elif not config.eager:
        why.append(f"no graph of mode {config.cudagraph_mode} fits: eager, unpadded")
    if d.num_tokens_padded > T or d.num_reqs_padded > R:
        why.append(f"padded tails: query_start_loc[{R + 1}:{d.num_reqs_padded + 1}] = {T} (the unpadded total), "
                   f"seq_lens[{R}:{d.num_reqs_padded}] = 0, block-table rows {R}..{d.num_reqs_padded - 1} = "
                   f"block 0, slot_mapping[{T}:{d.num_tokens_padded}] = -1, is_padding from token {T}; attention "
                   f"metadata uses the padded counts only under FULL ({d.pad_attn})")
    return {**pad.to_dict(), "num_tokens": T, "num_reqs": R, "uniform_decode": d.uniform_decode,
            "max_cudagraph_capture_size": top, "why": why}


def split_list(config: ForwardConfig, att) -> list[dict]:
    """Each attending group's decode/prefill split with its threshold and the first prefill row."""
    out = []
    for g, (grp, cm, t, sp) in enumerate(zip(config.groups, att.common, att.thresholds, att.splits)):
        if cm is None:
            continue
        item = {"group": g, "attention_backend": grp.attention_backend, "reorder_batch_threshold": t}
        if sp is None:
            item["line"] = (f"group {g} ({grp.attention_backend or 'backend unknown'}): no split "
                            "(the backend sets no reorder_batch_threshold, or is unknown)")
            out.append(item)
            continue
        qsl = cm.query_start_loc.tolist()
        ql = [qsl[b + 1] - qsl[b] for b in range(cm.num_reqs)]
        local = " (its chunked-local virtual batches)" if att.local[g] else ""
        b = sp.num_decodes
        uniform = split_rule(config, grp)[1]
        if sp.num_prefills == 0:
            rule = f"every row is a decode (query lengths {_short(ql)}, threshold {t})"
        elif b == 0 and ql[0] > t:
            rule = (f"row 0's query length {ql[0]} > threshold {t}: every row is a prefill, num_prefills = "
                    f"{cm.num_reqs}, num_prefill_tokens = num_actual_tokens = {cm.num_actual_tokens}")
        else:
            why = (f"query length {ql[b]} differs from row 0's {ql[0]} and is not 0 (require_uniform)" if uniform
                   else f"query length {ql[b]} > threshold {t}")
            rule = (f"row {b} is the first prefill ({why}): num_decodes = {b}, num_decode_tokens = "
                    f"query_start_loc[{b}] = {sp.num_decode_tokens}, num_prefills = {cm.num_reqs} - {b} = "
                    f"{sp.num_prefills}, num_prefill_tokens = num_actual_tokens {cm.num_actual_tokens} - "
                    f"{sp.num_decode_tokens} = {sp.num_prefill_tokens}")
        item.update(num_decodes=sp.num_decodes, num_decode_tokens=sp.num_decode_tokens, num_prefills=sp.num_prefills,
                    num_prefill_tokens=sp.num_prefill_tokens,
                    line=f"group {g} ({grp.attention_backend}){local}: {rule}")
        out.append(item)
    return out


def _short(xs: list, limit: int = 16) -> str:
    return str(xs) if len(xs) <= limit else f"[{', '.join(map(str, xs[:limit]))}, ...] ({len(xs)} in all)"


def flashinfer_list(config: ForwardConfig, be, m) -> list[dict]:
    """Each FLASHINFER group's paged-KV arrays, plan arguments and each row's arithmetic."""
    out = []
    for g, md in enumerate(be.metadata):
        if not isinstance(md, FI.FlashInferMetadata):
            continue
        P = config.groups[g].kernel_block_size
        ip, kv, last = md.paged_kv_indptr.tolist(), md.seq_lens_cpu.tolist(), md.paged_kv_last_page_len.tolist()
        rows = []
        for b in range(len(kv)):
            name = m.req_ids[b] if b < len(m.req_ids) else f"padding row {b}"
            nb = ip[b + 1] - ip[b]
            pages = _short(md.paged_kv_indices[ip[b]: ip[b + 1]].tolist())
            full = f" -> {P} (a full last page)" if last[b] != kv[b] % P else ""
            rows.append(f"{name}: kv_len {kv[b]}, num_blocks = ceil({kv[b]} / {P}) = {nb}; "
                        f"paged_kv_indptr[{b + 1}] = {ip[b]} + {nb} = {ip[b + 1]}; "
                        f"paged_kv_indices[{ip[b]}:{ip[b + 1]}] = block_table[{b}, :{nb}] = {pages}; "
                        f"paged_kv_last_page_len = {kv[b]} % {P} = {kv[b] % P}{full}")
        item = {"group": g, "page_size": P, "paged_kv_indptr": ip, "paged_kv_indices": md.paged_kv_indices.tolist(),
                "paged_kv_last_page_len": last, "rows": rows}
        if md.prefill is not None:
            item["prefill_plan"] = {"qo_indptr": md.prefill.qo_indptr.tolist(),
                                    "paged_kv_indptr": md.prefill.paged_kv_indptr.tolist(),
                                    "paged_kv_last_page_len": md.prefill.paged_kv_last_page_len.tolist(),
                                    "note": f"qo_indptr rebased (query_start_loc[{md.num_decodes}:] - "
                                            f"query_start_loc[{md.num_decodes}]); paged_kv_indptr not rebased; "
                                            "the whole paged_kv_indices"}
        if md.decode is not None:
            item["decode_plan"] = {"indptr": md.decode.indptr.tolist(),
                                   "last_page_len": md.decode.last_page_len.tolist(),
                                   "q_len_per_req": md.decode.q_len_per_req}
        out.append(item)
    return out
