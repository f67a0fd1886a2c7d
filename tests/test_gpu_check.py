"""scripts/gpu_check.py's vLLM section, checked here on host tensors: the rows it prints on a GPU machine come
from `vllm_dump_rows`, which runs vllm-mrv2 (under the Triton interpreter on "cpu") and the reference on the
bundled traces and names the first step where their dumps differ. Needs vLLM 0.33 (CI: .venv-record)."""

from __future__ import annotations

import pytest

from kvmap import vllm_compat

from .conftest import load_script

MRV2 = vllm_compat.installed("vllm") in vllm_compat.SUPPORTED["vllm-mrv2"]["vllm"]
pytestmark = pytest.mark.skipif(not MRV2, reason="vLLM 0.33 is not installed here (CI: .venv-record)")


def _gpu_check():
    return load_script("gpu_check")


def test_the_gpu_sections_dump_rows_run_on_host_tensors():
    rows = _gpu_check().vllm_dump_rows("cpu", ("dcp2", "kernel_block_split"))
    assert rows == ["vllm-mrv2 on cpu, dcp2: 34 steps, equal to the reference",
                    "vllm-mrv2 on cpu, kernel_block_split: 23 steps, equal to the reference"]


def test_the_gpu_sections_dump_rows_name_the_first_step_that_differs(monkeypatch):
    from kvmap.run import replay as replay_mod

    real = replay_mod.replay

    def planted(trace, config, on_mappings=None, **kw):
        def take(d):  # vllm-mrv2's slot of step 5's first token moved by one block
            if config.backend == "vllm-mrv2" and d["step"] == 5:
                g0 = d["slot_mapping"][0]  # [num_groups] x [num_tokens]
                d = {**d, "slot_mapping": [[g0[0] + 16, *g0[1:]], *d["slot_mapping"][1:]]}
            on_mappings(d)
        return real(trace, config, on_mappings=take, **kw)

    monkeypatch.setattr(replay_mod, "replay", planted)
    assert _gpu_check().vllm_dump_rows("cpu", ("kernel_block_split",)) == [
        "vllm-mrv2 on cpu, kernel_block_split: 23 steps, DIFFERS at step 5"]
