"""Re-record every bundled trace from its workload file: `python scripts/record_traces.py [NAME ...]`.

Needs vLLM (see README, 'Recording traces'). Output is deterministic: the same workload gives the same bytes.
Traces longer than 1 MiB are written gzip-compressed. Async traces that kvmap's replay/validate cannot read
yet (async speculative decoding: -1 draft placeholders, optimistic num_computed_tokens) go to traces/pending/,
outside the bundled set the tests iterate, until those rules are implemented.
"""

import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
GZIP = {"long_mixed"}
PENDING = {"async_spec_decode"}
names = sys.argv[1:] or sorted(p.stem for p in (root / "traces" / "workloads").glob("*.yaml"))
for name in names:
    out = root / "traces" / ("pending" if name in PENDING else "") / (
        f"{name}.jsonl.gz" if name in GZIP else f"{name}.jsonl")
    subprocess.run([sys.executable, "-m", "kvmap", "record", str(root / "traces" / "workloads" / f"{name}.yaml"),
                    "-o", str(out), "--no-progress"], check=True)
