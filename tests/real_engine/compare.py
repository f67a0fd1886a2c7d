"""Compare kvmap's replay (its `--dump-mappings` file, docs/trace-format.md) with a real worker's capture
(run_engine.py's capture.jsonl), PER REQUEST on every step: the two runners' batch orders differ.

Per step and request: query length, seq_len, positions, input_ids, and for every KV cache group the block-table
row (the first cdiv(seq_len, block_size) entries, the ones attention reads) and the slots of its tokens.
Only the dump format is used, so this survives changes inside kvmap.

    python tests/real_engine/compare.py DUMP.jsonl CAPTURE.jsonl   # prints a JSON summary, exit 1 on mismatch
"""

from __future__ import annotations

import json
import sys


def _per_request_dump(d: dict) -> dict:
    out = {}
    q = d["query_start_loc"]
    for i, r in enumerate(d["req_ids"]):
        a, b = q[i], q[i + 1]
        seq = d["seq_lens"][i]
        rows, slots = [], []
        for g in range(len(d["block_tables"])):
            rows.append(d["block_tables"][g][i])
            slots.append(d["slot_mapping"][g][a:b])
        out[r] = {"query_len": b - a, "seq_len": seq, "positions": d["positions"][a:b],
                  "input_ids": d["input_ids"][a:b], "rows": rows, "slots": slots}
    return out


def _per_request_capture(c: dict) -> dict:
    out = {}
    g0 = c["groups"][0]
    q = g0["query_start_loc"]
    for i, r in enumerate(c["req_ids"]):
        a, b = q[i], q[i + 1]
        out[r] = {"query_len": b - a, "seq_len": g0["seq_lens"][i], "positions": c["positions"][a:b],
                  "input_ids": c["input_ids"][a:b], "rows": [g["block_table"][i] for g in c["groups"]],
                  "slots": [g["slot_mapping"][a:b] for g in c["groups"]],
                  "block_sizes": [g["block_size"] for g in c["groups"]]}
    return out


def compare(dump_path: str, capture_path: str) -> dict:
    dumps = {}
    with open(dump_path) as f:
        for line in f:
            d = json.loads(line)
            dumps[d["step"]] = d
    caps = [json.loads(x) for x in open(capture_path)]
    mismatches: list[str] = []
    steps = reqs = tokens = 0
    v1_order_steps = mrv2_order_equal = 0
    for c in caps:
        s = c["step"]
        if s is None:
            mismatches.append("a captured worker step has no trace step (the recorder did not know it)")
            continue
        d = dumps.get(s)
        if d is None:
            mismatches.append(f"step {s}: the worker ran it, kvmap's dump has no such step")
            continue
        want = _per_request_capture(c)
        got = _per_request_dump(d)
        if set(want) != set(got):
            mismatches.append(f"step {s}: requests differ: worker {sorted(want)}, kvmap {sorted(got)}")
            continue
        steps += 1
        v1_order_steps += 1
        mrv2_order_equal += c["req_ids"] == d["req_ids"]
        for r, w in want.items():
            k = got[r]
            reqs += 1
            tokens += w["query_len"]
            for key in ("query_len", "seq_len", "positions", "input_ids"):
                if w[key] != k[key]:
                    mismatches.append(f"step {s}, request {r}: {key}: worker {w[key]}, kvmap {k[key]}")
            for g, bs in enumerate(w["block_sizes"]):
                n = -(-w["seq_len"] // bs)
                if w["rows"][g][:n] != k["rows"][g][:n]:
                    mismatches.append(f"step {s}, request {r}, group {g}: block row: worker {w['rows'][g][:n]}, "
                                      f"kvmap {k['rows'][g][:n]}")
                if w["slots"][g] != k["slots"][g]:
                    mismatches.append(f"step {s}, request {r}, group {g}: slot_mapping: worker {w['slots'][g]}, "
                                      f"kvmap {k['slots'][g]}")
    return {"captured_steps": len(caps), "steps_compared": steps, "request_steps_compared": reqs,
            "tokens_compared": tokens, "mismatches": len(mismatches), "first_mismatches": mismatches[:10],
            "steps_where_kvmap_default_order_equals_v1_runner": mrv2_order_equal}


if __name__ == "__main__":
    res = compare(sys.argv[1], sys.argv[2])
    print(json.dumps(res, indent=1))
    sys.exit(1 if res["mismatches"] else 0)
