"""Re-record every bundled trace from its workload file: `python scripts/record_traces.py [NAME ...]`.

Needs vLLM (see docs/recording.md, 'Installing vLLM for the recorder'). Output is deterministic: the same workload
gives the same bytes.
Traces longer than 1 MiB are written gzip-compressed.
"""

import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
GZIP = {"long_mixed"}
names = sys.argv[1:] or sorted(p.stem for p in (root / "traces" / "workloads").glob("*.yaml"))
for name in names:
    out = root / "traces" / (f"{name}.jsonl.gz" if name in GZIP else f"{name}.jsonl")
    subprocess.run([sys.executable, "-m", "kvmap", "record", str(root / "traces" / "workloads" / f"{name}.yaml"),
                    "-o", str(out), "--no-progress"], check=True)
