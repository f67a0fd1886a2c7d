"""Multi-rank rules for `kvmap validate` (docs/trace-format.md, "Extensions for vLLM as deployed today").

Rules:
- Block sizes: a group's row addresses `block_size * cp` positions per id (`block_spans`, the layout's
  `virtual_block_size`; a replicated group, `dcp_sharded` false, `block_size`); a state group
  (`uses_slot_mapping` false) holds state indices, so its row covers no positions (span None). The shadow
  model takes its spans from here.
- Header: `cp_kv_cache_interleave_size` divides every sharded group's block size, `kernel_block_size` divides
  its group's block size (the parser rejects both; re-stated here so a validator built from a header object
  sees them too).
- Rows: a row holds at most `cdiv(max_model_len + num_speculative_tokens, block_size * cp)` ids (the worker's
  row width; vLLM's `max_num_blocks` before alignment; wider rows read out of bounds, vllm#53982).
- Dumps (`validate --deep`): every token local on exactly one DCP rank of a sharded group and on none of a
  state group; `dcp_local_seq_lens` sum to `seq_len`; each kernel row is its manager row expanded; a slot lies
  inside the rank's shard. Each problem names step, request and rank.
"""

from __future__ import annotations

from kvmap.layout import PAD_SLOT_ID, group_layouts


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_spans(h) -> list[int | None]:
    """[G] global positions one block id of the group covers, the layout's `virtual_block_size` (None: a state
    group)."""
    return [lay.virtual_block_size if g.uses_slot_mapping else None
            for g, lay in zip(h.kv_cache_groups, group_layouts(h))]


def header_problems(h) -> list[tuple[str, int | None, str]]:
    """(message, group, field) for every header rule that fails: the multi-rank rules, then the block sizes."""
    out = []
    cp, I = h.decode_context_parallel_size, h.cp_kv_cache_interleave_size
    for i, g in enumerate(h.kv_cache_groups):
        if cp > 1 and g.dcp_sharded and g.uses_slot_mapping and g.block_size % I:
            out.append((f"cp_kv_cache_interleave_size {I} does not divide group {i}'s block_size {g.block_size}",
                        i, "cp_kv_cache_interleave_size"))
        if g.kernel_block_size and g.block_size % g.kernel_block_size:
            out.append((f"kernel_block_size {g.kernel_block_size} does not divide block_size {g.block_size}", i,
                        f"kv_cache_groups[{i}].kernel_block_size"))
    for i, g in enumerate(h.kv_cache_groups):
        if h.block_size % g.block_size and g.uses_slot_mapping:
            out.append((f"scheduler block_size {h.block_size} is not a multiple of group {i}'s block_size "
                        f"{g.block_size}", i, "kv_cache_groups.block_size"))
    if h.max_model_len < h.block_size:
        out.append(("max_model_len is shorter than one block", None, "max_model_len"))
    return out


def dump_problems(h, d: dict, backend: str) -> list[tuple[str, str | None, int | None, str]]:
    """(message, req_id, group, field) for every cross-rank invariant a dump record breaks."""
    out: list[tuple[str, str | None, int | None, str]] = []
    cp = h.decode_context_parallel_size
    qsl = d["query_start_loc"]

    def req_of(t: int) -> str:
        return d["req_ids"][max(j for j in range(len(qsl) - 1) if qsl[j] <= t)]

    if cp > 1 and "dcp_ranks" not in d:
        slots = d["slot_mapping"]  # [cp][G][T]
        for g, grp in enumerate(h.kv_cache_groups):
            want = 1 if (grp.uses_slot_mapping and grp.dcp_sharded) else None
            for t in range(len(d["positions"])):
                holders = [r for r in range(cp) if slots[r][g][t] != PAD_SLOT_ID]
                if not grp.uses_slot_mapping:
                    ok = not holders
                elif want is None:  # replicated: every rank holds it, at the same slot
                    ok = len(holders) == cp and len({slots[r][g][t] for r in range(cp)}) == 1
                else:
                    ok = len(holders) == 1
                if not ok:
                    out.append((f"{backend}: position {d['positions'][t]} is local on DCP ranks {holders} "
                                f"(slots {[slots[r][g][t] for r in range(cp)]})", req_of(t), g, "slot_mapping"))
                    break
                for r in holders:
                    if not 0 <= slots[r][g][t] < h.num_gpu_blocks * grp.block_size:
                        out.append((f"{backend}: rank {r}'s slot {slots[r][g][t]} is outside its shard of "
                                    f"{h.num_gpu_blocks * grp.block_size} slots", req_of(t), g, "slot_mapping"))
                        break
        lens = d["dcp_local_seq_lens"]
        for b, s in enumerate(d["seq_lens"]):
            got = [lens[r][b] for r in range(cp)]
            if sum(got) != s:
                out.append((f"{backend}: dcp_local_seq_lens {got} over the ranks sum to {sum(got)}, seq_len is {s}",
                            d["req_ids"][b], None, "dcp_local_seq_lens"))
                break
    if "kernel_block_tables" in d:
        for g, grp in enumerate(h.kv_cache_groups):
            k = grp.block_size // (grp.kernel_block_size or grp.block_size)
            for b, (row, krow) in enumerate(zip(d["block_tables"][g], d["kernel_block_tables"][g])):
                if krow != [x * k + j for x in row for j in range(k)]:
                    out.append((f"{backend}: the kernel row is not the manager row {row[:4]} expanded by {k}",
                                d["req_ids"][b], g, "kernel_block_tables"))
                    break
    return out
