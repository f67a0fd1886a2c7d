"""Write traces/worked_example.jsonl: the explainer's example as a 4-step trace, by hand.

Block size 16, 8 request-state rows. B arrives first (row 7), then A (row 6). Step 0 computes B's 31-token
prompt (blocks [37, 12]) and the first 16 of A's 24 prompt tokens (block [81]); step 1 is the explainer's
step: B decodes 1 token at position 31, A computes its last 8 prompt tokens into new block 44. Step 2 decodes
both (B needs a third block, 5). Step 3 only delivers the finished ids.

Token ids are 1000 * (1 for A, 2 for B) + position, so `input_ids` show where each token came from.
"""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "traces" / "worked_example.jsonl")
A = [1000 + p for p in range(24)]
B = [2000 + p for p in range(31)]


def cached(req_ids, new_block_ids, num_computed_tokens, num_output_tokens):
    return {"req_ids": req_ids, "resumed_req_ids": [], "new_token_ids": [], "all_token_ids": {},
            "new_block_ids": new_block_ids, "num_computed_tokens": num_computed_tokens,
            "num_output_tokens": num_output_tokens}


def step(i, new, cached_reqs, nst, sampled, finished=()):
    return {"step": i, "scheduler_output": {
        "scheduled_new_reqs": new, "scheduled_cached_reqs": cached_reqs, "num_scheduled_tokens": nst,
        "total_num_scheduled_tokens": sum(nst.values()), "scheduled_spec_decode_tokens": {},
        "num_common_prefix_blocks": [0], "finished_req_ids": list(finished), "preempted_req_ids": []},
        "sampled_token_ids": sampled, "draft_token_ids": {}}


lines = [
    {"kind": "header", "format": "kvmap-vllm-trace/1", "model_runner_protocol": "v2", "block_size": 16,
     "num_gpu_blocks": 96, "null_block_id": 0,
     "kv_cache_groups": [{"group_id": 0, "kind": "full_attention", "block_size": 16, "sliding_window": None}],
     "max_num_seqs": 8, "max_num_batched_tokens": 47, "max_model_len": 64, "num_speculative_tokens": 0,
     "enable_prefix_caching": False, "enable_chunked_prefill": True,
     "scenario": "the explainer's worked example, written by hand (scripts/make_worked_example.py)"},
    step(0, [
        {"req_id": "B", "prompt_token_ids": B, "block_ids": [[37, 12]], "num_computed_tokens": 0,
         "prefill_token_ids": B},
        {"req_id": "A", "prompt_token_ids": A, "block_ids": [[81]], "num_computed_tokens": 0,
         "prefill_token_ids": A},
    ], cached([], [], [], []), {"B": 31, "A": 16}, {"B": [2031], "A": []}),
    step(1, [], cached(["B", "A"], [None, [[44]]], [31, 16], [1, 0]), {"B": 1, "A": 8},
         {"B": [2032], "A": [1024]}),
    step(2, [], cached(["B", "A"], [[[5]], None], [32, 24], [2, 1]), {"B": 1, "A": 1},
         {"B": [2033], "A": [1025]}),
    step(3, [], cached([], [], [], []), {}, {}, finished=["B", "A"]),
]
out.write_text("".join(json.dumps(x) + "\n" for x in lines))
print(f"wrote {out}")
