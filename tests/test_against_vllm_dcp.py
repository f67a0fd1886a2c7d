"""Multi-rank slot mappings (decode context parallelism, kernel block splits, state groups) against vLLM's own code.

For every step of the bundled multi-rank traces, the batch (each request's block-table rows per group and its
positions) is derived from the trace by a minimal tracker written here (not kvmap's worker), and:

- every DCP rank's `slot_mapping` is computed by vLLM's V1 `BlockTable` (its Triton slot-mapping kernel, run on
  CPU under TRITON_INTERPRET=1) with the DCP world size and rank set, and compared with `slot_for`, a plain-Python
  scalar transcription of docs/trace-format.md's per-rank rule;
- `dcp_local_seq_lens` from vLLM's V1 helper (`get_dcp_local_seq_lens`) and Model Runner V2's Triton kernel
  (`prepare_dcp_local_seq_lens`) are compared with `dcp_local_seq_len`;
- the same for Model Runner V2's fused slot kernel (`vllm/v1/worker/gpu/block_table.py`,
  `_compute_slot_mappings_kernel`: all groups in one launch, rows read through idx_mapping);
- kernel block rows from vLLM's `AttentionGroup.map_to_kernel_block_table` are compared with `kernel_row`, and
  the slot computed over the kernel row must equal the manager-block slot;
- a planted vllm#51031 fault (vLLM's kernel handed kernel rows and the kernel block size) is named at its step,
  request, position and ranks.

The comparison (`slot_mismatches`) takes plain arrays (rows, query_start_loc, positions, every rank's slots), so
it can later be pointed at kvmap's mapping dump (`slot_mapping` as `[cp][groups][tokens]`). The oracle self-tests
run everywhere; the vLLM comparisons run where vLLM is installed (CI's record environment) and skip elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from types import SimpleNamespace

import pytest

from .conftest import TRACES

PAD_SLOT_ID = -1
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (CI records in .venv-record)")
DCP_TRACES = ["dcp2.jsonl", "dcp4_interleave8.jsonl", "vllm51031.jsonl", "dcp2_mamba.jsonl"]
KERNEL_TRACES = ["kernel_block_split.jsonl", "vllm51031.jsonl"]
ALL_TRACES = sorted(set(DCP_TRACES) | set(KERNEL_TRACES))


# ----------------------------------------------------------- the oracle: docs/trace-format.md, one token at a time


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def local_position(pos: int, block_size: int, cp: int, rank: int, interleave: int) -> int | None:
    """The rank-local position of global position `pos` (virtual block * block_size + local offset), or None if
    the token is not stored on `rank`."""
    vbs = block_size * cp
    vb, off = pos // vbs, pos % vbs
    if (off // interleave) % cp != rank:
        return None
    return vb * block_size + (off // (interleave * cp)) * interleave + off % interleave


def slot_for(row_blocks: list[int], pos: int, block_size: int, cp: int, rank: int, interleave: int) -> int:
    """docs/trace-format.md's per-rank slot rule: row[vb] * block_size + (off // (I*cp)) * I + off % I if the token is
    local on `rank`, else PAD_SLOT_ID; vb, off = divmod(pos, block_size * cp). cp = 1 gives the classic
    row[pos // block_size] * block_size + pos % block_size."""
    vbs = block_size * cp
    vb, off = pos // vbs, pos % vbs
    if (off // interleave) % cp != rank:
        return PAD_SLOT_ID
    return row_blocks[vb] * block_size + (off // (interleave * cp)) * interleave + off % interleave


def dcp_local_seq_len(seq_len: int, cp: int, rank: int, interleave: int) -> int:
    """Tokens of a `seq_len`-token sequence stored on `rank`."""
    return (seq_len // (cp * interleave)) * interleave + min(max(seq_len % (cp * interleave) - rank * interleave, 0),
                                                              interleave)


def kernel_row(row_blocks: list[int], block_size: int, kernel_block_size: int) -> list[int]:
    """The expanded kernel-block row: manager id b becomes b*k .. b*k+k-1, k = block_size / kernel_block_size."""
    k = block_size // kernel_block_size
    return [b * k + j for b in row_blocks for j in range(k)]


def kernel_slot_for(krow: list[int], pos: int, block_size: int, kernel_block_size: int, cp: int, rank: int,
                    interleave: int) -> int:
    """The same slot computed over the kernel row: krow[lp // K] * K + lp % K (lp: the rank-local position)."""
    lp = local_position(pos, block_size, cp, rank, interleave)
    if lp is None:
        return PAD_SLOT_ID
    return krow[lp // kernel_block_size] * kernel_block_size + lp % kernel_block_size


def faulty_kernel_slot_vllm51031(krow: list[int], pos: int, kernel_block_size: int, cp: int, rank: int,
                                 interleave: int) -> int:
    """The vllm#51031 mistake, for demonstration: the DCP virtual block taken from the kernel block size
    (kernel_block_size * cp) over the kernel row, as if the kernel block were the manager block. This is what
    vLLM's own V1 slot kernel computes when handed the kernel rows and the kernel block size."""
    return slot_for(krow, pos, kernel_block_size, cp, rank, interleave)


# ------------------------------------------------------------------------------------- the comparison (plain arrays)


def slot_mismatches(rows: list[list[int]], query_start_loc: list[int], positions: list[int],
                    slots: list[list[int]], *, block_size: int, cp: int, interleave: int,
                    kernel_block_size: int | None = None, kernel_rows: list[list[int]] | None = None,
                    what: str = "", req_ids: list[str] | None = None) -> list[str]:
    """Compare every rank's slots (`slots[rank][token]`) for one group of one step with the oracle. `rows[b]` is
    batch request b's block-table row (manager block ids), its tokens are query_start_loc[b] .. [b+1]-1.
    With `kernel_rows` (the expanded rows someone computed), they must equal `kernel_row`, and the slot over
    them must equal the manager slot. Cross-rank: every token is written (not -1) on exactly one rank. Returns
    one line per mismatch (empty: all agree)."""
    out: list[str] = []
    if len(slots) != cp:
        return [f"{what}: {len(slots)} ranks of slots, expected cp={cp}"]
    for b, row in enumerate(rows):
        rq = f"request {req_ids[b]!r}" if req_ids else f"request {b}"
        if kernel_rows is not None:
            want_k = kernel_row(row, block_size, kernel_block_size)
            if list(kernel_rows[b][: len(want_k)]) != want_k:
                out.append(f"{what} {rq}: kernel row {list(kernel_rows[b])} != {want_k}")
        for t in range(query_start_loc[b], query_start_loc[b + 1]):
            p = positions[t]
            owners = 0
            for r in range(cp):
                want = slot_for(row, p, block_size, cp, r, interleave)
                got = int(slots[r][t])
                if got != want:
                    out.append(f"{what} {rq} token {t} (position {p}) rank {r}: slot {got}, rule says {want}")
                owners += got != PAD_SLOT_ID
                if kernel_block_size:
                    krow = kernel_rows[b] if kernel_rows is not None else kernel_row(row, block_size,
                                                                                     kernel_block_size)
                    ks = kernel_slot_for(list(krow), p, block_size, kernel_block_size, cp, r, interleave)
                    if ks != want:
                        out.append(f"{what} {rq} position {p} rank {r}: kernel-row slot {ks} != {want}")
            if owners != 1:  # cross-rank: on what the ranks wrote, not on the rule
                out.append(f"{what} {rq} position {p}: written on {owners} ranks, not exactly one")
    return out


def dump_mismatches(header: dict, d: dict) -> list[str]:
    """Check one line of a mapping dump (docs/trace-format.md, "Mapping dump": `block_tables[g][b]`,
    `query_start_loc`, `positions`, `seq_lens`, `slot_mapping` as `[g][t]`, or `[cp][g][t]` when cp > 1,
    `dcp_local_seq_lens[cp][b]`, `kernel_block_tables[g][b]`) against the rule. kvmap's `--dump-mappings` output
    can be fed here line by line once the worker implements issue 14."""
    cp_all = header.get("decode_context_parallel_size", 1)
    out: list[str] = []
    what = f"step {d['step']}"
    for g, grp in enumerate(header["kv_cache_groups"]):
        cp, inter = rank_settings(header, grp)
        ranks = [d["slot_mapping"][r][g] for r in range(cp_all)] if cp_all > 1 else [d["slot_mapping"][g]]
        rows = d["block_tables"][g]
        if not uses_slot_mapping(grp):  # kvmap's convention for state groups: no slots on any rank
            out += [f"{what} group {g} rank {r}: state group slots {s[:8]}..., expected all -1"
                    for r, s in enumerate(ranks) if any(x != PAD_SLOT_ID for x in s)]
            continue
        kbs = grp.get("kernel_block_size")
        krows = d["kernel_block_tables"][g] if kbs and kbs != grp["block_size"] else None
        if cp == cp_all:
            out += slot_mismatches(rows, d["query_start_loc"], d["positions"], ranks, block_size=grp["block_size"],
                                   cp=cp, interleave=inter, kernel_block_size=kbs if krows else None,
                                   kernel_rows=krows, what=f"{what} group {g}", req_ids=d["req_ids"])
        else:  # replicated group: every rank holds the cp = 1 slots
            for r, s in enumerate(ranks):
                out += slot_mismatches(rows, d["query_start_loc"], d["positions"], [s], block_size=grp["block_size"],
                                       cp=1, interleave=1, kernel_block_size=kbs if krows else None,
                                       kernel_rows=krows, what=f"{what} group {g} (rank {r})", req_ids=d["req_ids"])
    if cp_all > 1:
        inter = header.get("cp_kv_cache_interleave_size", 1)
        for b, (q, sl) in enumerate(zip(d["req_ids"], d["seq_lens"])):
            got = [d["dcp_local_seq_lens"][r][b] for r in range(cp_all)]
            want = [dcp_local_seq_len(sl, cp_all, r, inter) for r in range(cp_all)]
            if got != want or sum(got) != sl:
                out.append(f"{what} request {q!r}: dcp_local_seq_lens {got}, rule says {want} (seq_len {sl})")
    return out


def oracle_dump(header: dict, step: int, b, slot_fn=slot_for) -> dict:
    """The dump line the rule gives for a batch from `batches` (what kvmap's worker should write); `slot_fn`
    replaces the slot rule, to plant a fault."""
    cp_all = header.get("decode_context_parallel_size", 1)
    per_rank = []
    for r in range(cp_all):
        groups = []
        for g, grp in enumerate(header["kv_cache_groups"]):
            cp, inter = rank_settings(header, grp)
            slots = []
            for i, row in enumerate(b.rows[g]):
                for t in range(b.query_start_loc[i], b.query_start_loc[i + 1]):
                    slots.append(slot_fn(row, b.positions[t], grp["block_size"], cp, r if cp > 1 else 0, inter)
                                 if uses_slot_mapping(grp) else PAD_SLOT_ID)
            groups.append(slots)
        per_rank.append(groups)
    d = {"step": step, "req_ids": b.req_ids, "query_start_loc": b.query_start_loc, "seq_lens": b.seq_lens,
         "positions": b.positions, "block_tables": b.rows,
         "slot_mapping": per_rank if cp_all > 1 else per_rank[0]}
    if cp_all > 1:
        inter = header.get("cp_kv_cache_interleave_size", 1)
        d["dcp_local_seq_lens"] = [[dcp_local_seq_len(s, cp_all, r, inter) for s in b.seq_lens]
                                   for r in range(cp_all)]
    if any(g.get("kernel_block_size") for g in header["kv_cache_groups"]):
        d["kernel_block_tables"] = [[kernel_row(row, grp["block_size"], grp.get("kernel_block_size")
                                                or grp["block_size"]) for row in b.rows[g]]
                                    for g, grp in enumerate(header["kv_cache_groups"])]
    return d


# ------------------------------------------------------------ a minimal tracker: the batch of each step, from the trace


def read_trace(path) -> tuple[dict, list[dict]]:
    with open(path) as f:
        lines = [json.loads(x) for x in f]
    return lines[0], lines[1:]


def batches(path):
    """Yield (step, batch) for every step with scheduled tokens; batch has req_ids, rows[g][b] (each request's
    block ids per group as the worker holds them), query_start_loc, positions, seq_lens. Rows: block_ids of
    scheduled_new_reqs; cached requests append new_block_ids, resumed ones (v1) replace the row."""
    header, steps = read_trace(path)
    ngroups = len(header["kv_cache_groups"])
    rows: dict[str, list[list[int]]] = {}
    for line in steps:
        so = line["scheduler_output"]
        for r in so.get("finished_req_ids") or []:
            rows.pop(r, None)
        for r in so.get("preempted_req_ids") or []:
            if header.get("model_runner_protocol") == "v2":
                rows.pop(r, None)
        start: dict[str, int] = {}
        for nr in so["scheduled_new_reqs"]:
            rows[nr["req_id"]] = [list(g) for g in nr["block_ids"]]
            start[nr["req_id"]] = nr["num_computed_tokens"]
        c = so["scheduled_cached_reqs"]
        resumed = set(c.get("resumed_req_ids") or [])
        for i, r in enumerate(c["req_ids"]):
            nb = c["new_block_ids"][i]
            if r in resumed:
                rows[r] = [list(g) for g in nb] if nb is not None else [[] for _ in range(ngroups)]
            elif nb is not None:
                for g in range(ngroups):
                    rows[r][g].extend(nb[g])
            start[r] = c["num_computed_tokens"][i]
        req_ids = list(so["num_scheduled_tokens"])
        if not req_ids:
            continue
        qsl, positions, seq_lens = [0], [], []
        for r in req_ids:
            n = so["num_scheduled_tokens"][r]
            positions += range(start[r], start[r] + n)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start[r] + n)
        yield line["step"], SimpleNamespace(req_ids=req_ids, rows=[[rows[r][g] for r in req_ids]
                                                                   for g in range(ngroups)],
                                            query_start_loc=qsl, positions=positions, seq_lens=seq_lens)


def rank_settings(header: dict, group: dict) -> tuple[int, int]:
    """(cp, interleave) for a group: replicated groups (dcp_sharded false) use cp = 1."""
    cp = header.get("decode_context_parallel_size", 1)
    if not group.get("dcp_sharded", group.get("kind") != "mamba"):
        cp = 1
    return cp, header.get("cp_kv_cache_interleave_size", 1)


def uses_slot_mapping(group: dict) -> bool:
    return group.get("uses_slot_mapping", group.get("kind") != "mamba")


# ------------------------------------------------------------------------------------ oracle self-tests (no vLLM)


@pytest.mark.parametrize("block_size, cp, interleave", [(16, 1, 1), (16, 2, 1), (16, 4, 8), (64, 2, 32),
                                                        (16, 2, 16), (64, 8, 4)])
def test_oracle_every_token_on_one_rank_and_lengths_sum(block_size, cp, interleave):
    rng = random.Random(block_size * 100 + cp * 10 + interleave)
    row = rng.sample(range(1, 1000), 40)
    for seq_len in range(0, 300, 7):
        lens = [dcp_local_seq_len(seq_len, cp, r, interleave) for r in range(cp)]
        assert sum(lens) == seq_len
        for r in range(cp):  # the local length counts the rank's tokens below seq_len
            assert lens[r] == sum(local_position(p, block_size, cp, r, interleave) is not None
                                  for p in range(seq_len))
    seen = set()
    for p in range(block_size * cp * 30):
        owners = [r for r in range(cp) if slot_for(row, p, block_size, cp, r, interleave) != PAD_SLOT_ID]
        assert len(owners) == 1
        s = slot_for(row, p, block_size, cp, owners[0], interleave)
        assert s // block_size == row[p // (block_size * cp)]  # the slot lies in the row's block for p
        assert (owners[0], s) not in seen  # no two tokens share a rank's slot
        seen.add((owners[0], s))
        if cp == 1:
            assert s == row[p // block_size] * block_size + p % block_size
        for k in (1, 2, block_size // 4 or 1, block_size):
            if block_size % k == 0:
                krow = kernel_row(row, block_size, k)
                assert kernel_slot_for(krow, p, block_size, k, cp, owners[0], interleave) == s


def test_oracle_catches_the_vllm51031_mistake():
    """Block 64, kernel 16, DCP 2, interleave 32: with the faulty virtual block (16 * 2 tokens over the kernel
    row) position 32 goes to rank 0, slot 336 (where the rule keeps position 16: silent KV corruption, no error)
    instead of rank 1, slot 320."""
    row = [5, 9]
    krow = kernel_row(row, 64, 16)  # [20..23, 36..39]
    good = [(p, r, slot_for(row, p, 64, 2, r, 32)) for p in range(256) for r in range(2)]
    bad = [(p, r, faulty_kernel_slot_vllm51031(krow, p, 16, 2, r, 32)) for p in range(256) for r in range(2)]
    diff = [(g, b) for g, b in zip(good, bad) if g != b]
    assert diff and diff[0] == ((32, 0, PAD_SLOT_ID), (32, 0, 5 * 64 + 16))
    assert slot_for(row, 16, 64, 2, 0, 32) == 5 * 64 + 16 and slot_for(row, 32, 64, 2, 1, 32) == 5 * 64


@pytest.mark.parametrize("name", ALL_TRACES)
def test_dump_check_is_silent_on_the_rule_and_names_a_planted_fault(name):
    """The dump check, as the lead will run it on kvmap's `--dump-mappings`: silent on the rule's own dump of
    every step; a planted vllm#51031-style fault (virtual block from the kernel block size) is named at its
    step, request, position and rank where the trace has a kernel split with DCP."""
    header, _ = read_trace(TRACES / name)
    data = list(batches(TRACES / name))
    for step, b in data:
        assert dump_mismatches(header, oracle_dump(header, step, b)) == []
    grp = header["kv_cache_groups"][0]
    kbs = grp.get("kernel_block_size")
    if not kbs or header.get("decode_context_parallel_size", 1) == 1:
        return

    def fault(row, pos, block_size, cp, rank, interleave):
        return faulty_kernel_slot_vllm51031(kernel_row(row, block_size, kbs), pos, kbs, cp, rank, interleave)

    found = [(step, m) for step, b in data for m in dump_mismatches(header, oracle_dump(header, step, b, fault))]
    assert found[0][1] == "step 0 group 0 request 'a' token 32 (position 32) rank 0: slot 80, rule says -1"
    assert found[1][1] == "step 0 group 0 request 'a' token 32 (position 32) rank 1: slot -1, rule says 64"
    assert len({s for s, _ in found}) == 16


# ------------------------------------------------------------------------------------------ against vLLM's own code


@pytest.fixture(scope="module")
def vllm_env():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch
    import vllm.v1.utils as vu

    vu.PIN_MEMORY = False  # no accelerator: vLLM's CpuGpuBuffer copies plain memory
    import vllm.v1.worker.block_table as vbt

    def make(block_size, max_num_reqs, width, max_tokens, cp, rank, interleave):
        """vLLM's V1 BlockTable on DCP rank `rank` of `cp`: it reads both from its DCP group."""
        real = vbt.get_dcp_group
        vbt.get_dcp_group = lambda: SimpleNamespace(world_size=cp, rank_in_group=rank)
        try:
            bt = vbt.BlockTable(block_size=block_size, max_num_reqs=max_num_reqs, max_num_blocks_per_req=width,
                                max_num_batched_tokens=max_tokens, pin_memory=False, device=torch.device("cpu"),
                                cp_kv_cache_interleave_size=interleave)
        finally:
            vbt.get_dcp_group = real
        assert (bt.dcp_world_size, bt.dcp_rank) == (cp, rank)
        return bt

    return SimpleNamespace(torch=torch, make=make, vbt=vbt)


def _width(header: dict, group: dict, cp: int, vbt) -> int:
    """vLLM's row width: AttentionSpec.max_num_blocks_per_req (cdiv(max_model_len, block_size * cp)), aligned by
    get_block_table_width; a Mamba group ("none" mode) holds 1 block (+ speculative blocks)."""
    if group["kind"] == "mamba":
        return 1 + header.get("num_speculative_tokens", 0)
    n = cdiv(header["max_model_len"] + header.get("num_speculative_tokens", 0), group["block_size"] * cp)
    return vbt.get_block_table_width(n, group["block_size"])


@needs_vllm
@pytest.mark.parametrize("name", ALL_TRACES)
def test_every_rank_slot_mapping_equals_vllms_kernel(name, vllm_env):
    torch, make = vllm_env.torch, vllm_env.make
    header, _ = read_trace(TRACES / name)
    assert header.get("decode_context_parallel_size", 1) > 1 or any(
        g.get("kernel_block_size") for g in header["kv_cache_groups"]), "not a multi-rank trace"
    data = list(batches(TRACES / name))
    checked = 0
    for g, grp in enumerate(header["kv_cache_groups"]):
        if not uses_slot_mapping(grp):
            continue
        cp, inter = rank_settings(header, grp)
        width = _width(header, grp, cp, vllm_env.vbt)
        tables = [make(grp["block_size"], header["max_num_seqs"], width, header["max_num_batched_tokens"], cp, r,
                       inter) for r in range(cp)]
        for step, b in data:
            B, T = len(b.req_ids), len(b.positions)
            qsl = torch.tensor(b.query_start_loc, dtype=torch.int32)
            pos = torch.tensor(b.positions, dtype=torch.int64)
            slots = []
            for bt in tables:
                for i, row in enumerate(b.rows[g]):  # V1: the batch row is the table row
                    assert len(row) <= width, f"step {step}: row of {len(row)} blocks, table width {width}"
                    bt.add_row(row, i)
                bt.commit_block_table(B)
                bt.compute_slot_mapping(B, qsl, pos)
                assert (bt.slot_mapping.gpu[T:] == PAD_SLOT_ID).all()
                slots.append(bt.slot_mapping.gpu[:T].tolist())
            bad = slot_mismatches(b.rows[g], b.query_start_loc, b.positions, slots, block_size=grp["block_size"],
                                  cp=cp, interleave=inter, what=f"{name} step {step} group {g}")
            assert not bad, "\n".join(bad[:10])
            checked += T * cp
    assert checked > 0


@needs_vllm
@pytest.mark.parametrize("name", DCP_TRACES)
def test_dcp_local_seq_lens_equal_vllms(name, vllm_env):
    torch = vllm_env.torch
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens
    from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens

    header, _ = read_trace(TRACES / name)
    cp, inter = header["decode_context_parallel_size"], header.get("cp_kv_cache_interleave_size", 1)
    max_reqs = header["max_num_seqs"]
    n = 0
    for step, b in batches(TRACES / name):
        sl = torch.tensor(b.seq_lens, dtype=torch.int32)
        want = [[dcp_local_seq_len(s, cp, r, inter) for s in b.seq_lens] for r in range(cp)]
        v1 = get_dcp_local_seq_lens(sl, cp, None, inter)  # V1 runner: [num_reqs, cp]
        assert v1.T.tolist() == want, f"step {step}"
        for r in range(cp):
            assert get_dcp_local_seq_lens(sl, cp, r, inter).tolist() == want[r], f"step {step} rank {r}"
            out = torch.full((max_reqs,), 99, dtype=torch.int32)
            got = prepare_dcp_local_seq_lens(out, sl, len(b.seq_lens), cp, r, inter, num_reqs_padded=max_reqs)
            assert got.tolist() == want[r] + [0] * (max_reqs - len(b.seq_lens)), f"step {step} rank {r} (MRV2)"
        assert [sum(x) for x in zip(*want)] == b.seq_lens
        n += 1
    assert n > 0


@needs_vllm
@pytest.mark.parametrize("name", KERNEL_TRACES)
def test_kernel_block_rows_equal_vllms_map_to_kernel_block_table(name, vllm_env):
    """vLLM expands manager rows into kernel rows at metadata-build time (AttentionGroup.map_to_kernel_block_table);
    the slot over the kernel row equals the manager-block slot vLLM's slot kernel wrote."""
    torch = vllm_env.torch
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import AttentionGroup

    header, _ = read_trace(TRACES / name)
    data = list(batches(TRACES / name))
    n = 0
    for g, grp in enumerate(header["kv_cache_groups"]):
        kbs = grp.get("kernel_block_size")
        if not kbs:
            continue
        bs, k = grp["block_size"], grp["block_size"] // kbs
        cp, inter = rank_settings(header, grp)
        width = _width(header, grp, cp, vllm_env.vbt)
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)
        ag = AttentionGroup(backend=AttentionBackend, layer_names=[], kv_cache_spec=spec, kv_cache_group_id=g,
                            kernel_block_size=kbs,
                            kernel_block_table=torch.zeros(1, header["max_num_seqs"], width * k, dtype=torch.int32),
                            kernel_block_offsets=torch.arange(k, dtype=torch.int32))
        tables = [vllm_env.make(bs, header["max_num_seqs"], width, header["max_num_batched_tokens"], cp, r, inter)
                  for r in range(cp)]
        for step, b in data:
            B, T = len(b.req_ids), len(b.positions)
            table = torch.zeros(B, width, dtype=torch.int32)
            for i, row in enumerate(b.rows[g]):
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            kt = ag.map_to_kernel_block_table(table).tolist()
            krows = [kt[i][: len(row) * k] for i, row in enumerate(b.rows[g])]
            slots = []
            for bt in tables:
                for i, row in enumerate(b.rows[g]):
                    bt.add_row(row, i)
                bt.commit_block_table(B)
                bt.compute_slot_mapping(B, torch.tensor(b.query_start_loc, dtype=torch.int32),
                                        torch.tensor(b.positions, dtype=torch.int64))
                slots.append(bt.slot_mapping.gpu[:T].tolist())
            bad = slot_mismatches(b.rows[g], b.query_start_loc, b.positions, slots, block_size=bs, cp=cp,
                                  interleave=inter, kernel_block_size=kbs, kernel_rows=krows,
                                  what=f"{name} step {step} group {g}")
            assert not bad, "\n".join(bad[:10])
            n += 1
    assert n > 0


@needs_vllm
def test_state_group_has_no_v1_slot_mapping(vllm_env):
    """A Mamba group: the V1 runner builds its BlockTable with SlotMappingMode.NONE; compute_slot_mapping then
    writes nothing (the rule: all PAD_SLOT_ID), and the row holds one state block per request."""
    torch, vbt = vllm_env.torch, vllm_env.vbt
    header, _ = read_trace(TRACES / "dcp2_mamba.jsonl")
    g = next(i for i, grp in enumerate(header["kv_cache_groups"]) if grp["kind"] == "mamba")
    grp = header["kv_cache_groups"][g]
    assert grp["uses_slot_mapping"] is False and grp["dcp_sharded"] is False
    bt = vbt.BlockTable(block_size=grp["block_size"], max_num_reqs=header["max_num_seqs"], max_num_blocks_per_req=1,
                        max_num_batched_tokens=header["max_num_batched_tokens"], pin_memory=False,
                        device=torch.device("cpu"), cp_kv_cache_interleave_size=1,
                        slot_mapping_mode=vbt.SlotMappingMode.NONE)
    bt.slot_mapping.gpu.fill_(12345)
    for step, b in batches(TRACES / "dcp2_mamba.jsonl"):
        for i, row in enumerate(b.rows[g]):
            assert len(row) == 1, f"step {step}: state row {row}"
            bt.add_row(row, i)
        bt.commit_block_table(len(b.req_ids))
        bt.compute_slot_mapping(len(b.req_ids), torch.tensor(b.query_start_loc, dtype=torch.int32),
                                torch.tensor(b.positions, dtype=torch.int64))
        assert (bt.slot_mapping.gpu == 12345).all()  # untouched: no slot mapping for state groups


@needs_vllm
def test_the_vllm51031_mistake_on_vllms_kernel_is_caught(vllm_env):
    """Planted fault: vLLM's own slot kernel handed the kernel rows and the kernel block size (so its virtual block
    is kernel_block_size * cp = 32 tokens, not block_size * cp = 128), as Model Runner V2 did before vllm#51031.
    The comparison names the first bad token: step 0, request 'a', position 32, which rank 0 writes into the slot
    where the rule keeps position 16 (silent corruption) while rank 1 never stores it."""
    torch = vllm_env.torch
    header, _ = read_trace(TRACES / "vllm51031.jsonl")
    grp = header["kv_cache_groups"][0]
    bs, kbs = grp["block_size"], grp["kernel_block_size"]
    cp, inter = rank_settings(header, grp)
    width = _width(header, grp, cp, vllm_env.vbt) * (bs // kbs)
    tables = [vllm_env.make(kbs, header["max_num_seqs"], width, header["max_num_batched_tokens"], cp, r, inter)
              for r in range(cp)]
    found, bad_steps = [], 0
    for step, b in batches(TRACES / "vllm51031.jsonl"):
        slots = []
        for bt in tables:
            for i, row in enumerate(b.rows[0]):
                bt.add_row(kernel_row(row, bs, kbs), i)
            bt.commit_block_table(len(b.req_ids))
            bt.compute_slot_mapping(len(b.req_ids), torch.tensor(b.query_start_loc, dtype=torch.int32),
                                    torch.tensor(b.positions, dtype=torch.int64))
            slots.append(bt.slot_mapping.gpu[: len(b.positions)].tolist())
        bad = slot_mismatches(b.rows[0], b.query_start_loc, b.positions, slots, block_size=bs, cp=cp,
                              interleave=inter, what=f"step {step}")
        if bad:
            bad_steps += 1
            found.append((step, b.req_ids, b.rows[0][0], bad))
    step, req_ids, row, bad = found[0]
    assert step == 0 and req_ids == ["a"]
    assert bad[:2] == ["step 0 request 0 token 32 (position 32) rank 0: slot 80, rule says -1",
                       "step 0 request 0 token 32 (position 32) rank 1: slot -1, rule says 64"]
    assert row[0] == 1 and slot_for(row, 16, bs, cp, 0, inter) == 80  # where rank 0 keeps position 16
    assert bad_steps == 16


@pytest.fixture
def interpreter_bool_masks(monkeypatch):
    """Triton 3.9's interpreter rejects a load mask built as `~bool_scalar | bool_vector` (it arrives as int8 0/1:
    "mask has unsupported dtype"), which Model Runner V2's slot kernel does for CP_SIZE > 1. Cast such masks to
    bool: the values are unchanged, only the dtype the interpreter's C loader accepts."""
    import numpy as np
    import triton.runtime.interpreter as ti

    orig = ti.InterpreterBuilder.create_masked_load

    def load(self, ptrs, mask, other, *args, **kwargs):
        if mask is not None and mask.data.dtype != np.bool_:
            assert set(np.unique(mask.data).tolist()) <= {0, 1}
            mask = ti.TensorHandle(mask.data.astype(np.bool_), mask.dtype)
        return orig(self, ptrs, mask, other, *args, **kwargs)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_load", load)


def _vllm_specs(header: dict):
    """vLLM's own KVCacheSpec per group, as the recorder built them: their uses_slot_mapping and dcp_sharded flags
    are what Model Runner V2 hands its slot kernel."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    out = []
    for grp in header["kv_cache_groups"]:
        if grp["kind"] == "mamba":
            out.append(MambaSpec(block_size=grp["block_size"], shapes=((2, 8),), dtypes=(torch.float16,),
                                 mamba_cache_mode="none"))
        else:
            out.append(FullAttentionSpec(block_size=grp["block_size"], num_kv_heads=1, head_size=8,
                                         dtype=torch.float16))
    return out


@needs_vllm
@pytest.mark.parametrize("name", ALL_TRACES)
def test_every_rank_slot_mapping_equals_model_runner_v2_kernel(name, vllm_env, interpreter_bool_masks):
    """Model Runner V2's fused slot kernel (`_compute_slot_mappings_kernel`, all groups in one launch, rows read
    through idx_mapping) on every DCP rank. Sharded attention groups follow the rule. vLLM 0.33's MambaSpec says
    uses_slot_mapping True and dcp_sharded False, so MRV2 writes a Mamba group cp = 1 slots
    (row[p // block_size] * block_size + p % block_size) on every rank; docs/trace-format.md's rule writes -1 there.
    Neither is read by a Mamba kernel; the test pins what vLLM does."""
    torch = vllm_env.torch
    from vllm.v1.worker.gpu.block_table import _compute_slot_mappings_kernel

    header, _ = read_trace(TRACES / name)
    specs = _vllm_specs(header)
    groups = header["kv_cache_groups"]
    cp_all, inter = header.get("decode_context_parallel_size", 1), header.get("cp_kv_cache_interleave_size", 1)
    R, max_tokens = header["max_num_seqs"], header["max_num_batched_tokens"]
    tables = [torch.zeros(R, _width(header, grp, rank_settings(header, grp)[0], vllm_env.vbt), dtype=torch.int32)
              for grp in groups]
    ptrs = torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64)
    strides = torch.tensor([t.stride(0) for t in tables], dtype=torch.int64)
    sizes = torch.tensor([s.block_size for s in specs], dtype=torch.int32)
    enabled = torch.tensor([s.uses_slot_mapping for s in specs], dtype=torch.bool)
    sharded = torch.tensor([s.dcp_sharded for s in specs], dtype=torch.bool)
    assert [s.dcp_sharded for s in specs] == [grp.get("dcp_sharded", grp["kind"] != "mamba") for grp in groups]
    checked = 0
    for step, b in batches(TRACES / name):
        B, T = len(b.req_ids), len(b.positions)
        idx = torch.tensor([R - 1 - i for i in range(B)], dtype=torch.int32)  # request-state rows from the end
        for g, t in enumerate(tables):
            t.zero_()
            for i, row in enumerate(b.rows[g]):
                t[R - 1 - i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        per_rank = []
        for r in range(cp_all):
            out = torch.full((len(groups), max_tokens), 12345, dtype=torch.int64)
            _compute_slot_mappings_kernel[(len(groups), B + 1)](
                max_tokens, idx, torch.tensor(b.query_start_loc, dtype=torch.int32),
                torch.tensor(b.positions, dtype=torch.int64), ptrs, strides, sizes, enabled, sharded, out,
                out.stride(0), r, CP_SIZE=cp_all, CP_INTERLEAVE=inter, PAD_ID=PAD_SLOT_ID, TRITON_BLOCK_SIZE=1024)
            assert (out[:, T:] == PAD_SLOT_ID).all()
            per_rank.append(out[:, :T].tolist())
        for g, grp in enumerate(groups):
            cp, _ = rank_settings(header, grp)
            what = f"{name} step {step} group {g}"
            if cp == cp_all:
                bad = slot_mismatches(b.rows[g], b.query_start_loc, b.positions, [s[g] for s in per_rank],
                                      block_size=grp["block_size"], cp=cp, interleave=inter, what=what)
            else:  # replicated: every rank writes the cp = 1 slots
                bad = [m for s in per_rank for m in slot_mismatches(
                    b.rows[g], b.query_start_loc, b.positions, [s[g]], block_size=grp["block_size"], cp=1,
                    interleave=1, what=what)]
            assert not bad, "\n".join(bad[:10])
            checked += T
    assert checked > 0
