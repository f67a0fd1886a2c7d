"""The KV memory efficiency of every bundled trace, as the README's table: paged (tokens held / (blocks in use x
block_size), per KV group) beside contiguous allocation (every live request reserving max_model_len, or its final
length); mean, p5 and minimum over the measured steps holding KV (`kvmap replay --json`'s `kv_memory`).

Usage: python scripts/memory_efficiency.py   (prints a Markdown table)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvmap.files import bundled_traces  # noqa: E402
from kvmap.run.config import ReplayConfig  # noqa: E402
from kvmap.run.kvstats import memory_dict  # noqa: E402
from kvmap.run.replay import replay  # noqa: E402
from kvmap.trace import Trace  # noqa: E402


def fig(x: dict) -> str:
    return "n/a" if x["mean"] is None else f"{x['mean']:.1%} / {x['p5']:.1%} / {x['min']:.1%}"


def main() -> None:
    print("| trace | paged, per group (mean / p5 / min) | contiguous, max_model_len each | contiguous, final length "
          "each |")
    print("|---|---|---|---|")
    for name, path in bundled_traces().items():
        r = replay(Trace(path), ReplayConfig(nvtx=False, write_kv=False))
        eff = memory_dict(r)["efficiency"]
        paged = "; ".join(f"{k} {fig(v)}" for k, v in eff.items() if k.startswith("g") and "." not in k)
        print(f"| {name} | {paged} | {fig(eff['contiguous_max_len'])} | "
              f"{fig(eff['contiguous_final'])} |")


if __name__ == "__main__":
    main()
