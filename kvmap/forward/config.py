"""The forward-pass settings of a replay, resolved once from the trace header and the command line.

Rules:
- `ForwardConfig` is frozen and holds plain scalars and tuples only: every forward part (`kvmap.forward.inputs`
  PARTS) reads its settings from it, never from the header or the options directly.
- An option overrides the header key of the same name; a header without a key gives the default that vLLM
  0.33 would have had without it being recorded: `cudagraph_mode` "NONE" (eager, no capture sizes), each
  group's `attention_backend` None (unknown: the parts that need it skip that group and say so in `skipped`).
- `runner` selects both the batch order (workers/order.py) and the runner's forward-pass rules: "mrv2" (Model
  Runner V2, `vllm/v1/worker/gpu/`) or "v1" (`vllm/v1/worker/gpu_model_runner.py`). The header's `runner`
  key, when present, is the default; otherwise "mrv2".
- `--attention-backend NAME` sets every group's backend; `g=NAME` (comma-separated) sets group g's.
- `--cudagraph-capture-sizes default`: vLLM's default sizes for the header's max_num_seqs,
  max_num_batched_tokens and speculative tokens (`cudagraph.default_capture_sizes`, not Blackwell).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmap.errors import KvmapError
from kvmap.forward.attention import BACKENDS
from kvmap.forward.cudagraph import default_capture_sizes
from kvmap.trace import TraceHeader
from kvmap.trace.header import CUDAGRAPH_MODES, RUNNERS

DEFAULT_RUNNER = "mrv2"


@dataclass(frozen=True, slots=True)
class GroupForward:
    """One KV-cache group's forward-pass settings."""

    kind: str  # full_attention | sliding_window | chunked_local | mamba
    block_size: int  # the manager's block size (tokens)
    kernel_block_size: int  # tokens per attention-kernel block (block_size without a split)
    attention_backend: str | None  # vLLM's AttentionBackendEnum name; None: unknown
    sliding_window: int | None  # tokens (sliding_window groups)
    attention_chunk_size: int | None  # tokens (chunked_local groups)


@dataclass(frozen=True, slots=True)
class ForwardConfig:
    runner: str  # "mrv2" | "v1"
    cudagraph_mode: str  # vLLM's CUDAGraphMode name; "NONE": eager
    cudagraph_capture_sizes: tuple[int, ...]  # ascending; () when eager
    groups: tuple[GroupForward, ...]  # [num_groups]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_speculative_tokens: int  # k; > 0: a speculative config exists (V1 builds SpecDecodeMetadata)
    dcp_size: int  # decode context parallel world size
    skipped: tuple[str, ...] = ()  # what cannot be computed from this header, one sentence each
    cp_kv_cache_interleave_size: int = 1  # DCP interleave (tokens per rank run)

    @property
    def eager(self) -> bool:
        return self.cudagraph_mode == "NONE"


def check_runner(name: str, field: str = "--runner") -> str:
    if name not in RUNNERS:
        raise KvmapError(f"unknown runner {name!r}: use one of {', '.join(RUNNERS)}", field=field)
    return name


def parse_backends(spec: str | None, num_groups: int) -> dict[int, str]:
    """`--attention-backend`: NAME (every group) or `g=NAME,...` -> {group: NAME}."""
    if not spec:
        return {}
    out: dict[int, str] = {}
    for part in spec.split(","):
        g, sep, name = part.strip().rpartition("=")
        name = name.strip()
        if not (name.isupper() and name.replace("_", "").isalnum()):
            raise KvmapError(f"{name!r} is not an attention backend name (vLLM's enum names: FLASH_ATTN, "
                             "FLASHINFER, TRITON_ATTN, ...)", field="--attention-backend")
        if not sep:
            return {i: name for i in range(num_groups)}
        if not g.strip().isdigit() or int(g) >= num_groups:
            raise KvmapError(f"group {g!r} is not one of the trace's groups 0..{num_groups - 1}",
                             field="--attention-backend")
        out[int(g)] = name
    return out


def parse_capture_sizes(spec: str | None) -> tuple[int, ...] | None:
    """`--cudagraph-capture-sizes 1,2,4,8` -> (1, 2, 4, 8)."""
    if spec is None:
        return None
    try:
        sizes = sorted({int(s) for s in spec.split(",") if s.strip()})
    except ValueError:
        raise KvmapError(f"expected comma-separated token counts, got {spec!r}",
                         field="--cudagraph-capture-sizes") from None
    if not sizes or sizes[0] < 1:
        raise KvmapError("capture sizes must be positive token counts", field="--cudagraph-capture-sizes")
    return tuple(sizes)


def resolve(header: TraceHeader, runner: str | None = None, attention_backend: str | None = None,
            cudagraph_mode: str | None = None, cudagraph_capture_sizes: str | None = None) -> ForwardConfig:
    """The forward settings of `header` with the command line's overrides (None: the header's)."""
    runner = check_runner(runner) if runner is not None else (header.runner or DEFAULT_RUNNER)
    if cudagraph_mode is not None and cudagraph_mode not in CUDAGRAPH_MODES:
        raise KvmapError(f"unknown cudagraph mode {cudagraph_mode!r}: use one of {', '.join(CUDAGRAPH_MODES)}",
                         field="--cudagraph-mode")
    mode = cudagraph_mode or header.cudagraph_mode or "NONE"
    if cudagraph_capture_sizes == "default":  # vLLM's default sizes for the header's limits
        cudagraph_capture_sizes = ",".join(map(str, default_capture_sizes(
            header.max_num_seqs, header.max_num_batched_tokens, header.num_speculative_tokens)))
    sizes = parse_capture_sizes(cudagraph_capture_sizes)
    if sizes is None:
        sizes = header.cudagraph_capture_sizes or ()
    if mode == "NONE":
        sizes = ()
    elif not sizes:
        raise KvmapError(f"cudagraph mode {mode} needs capture sizes: the header has no cudagraph_capture_sizes",
                         field="--cudagraph-capture-sizes")
    over = parse_backends(attention_backend, header.num_groups)
    groups = tuple(GroupForward(g.kind, g.block_size, g.kernel_block_size or g.block_size,
                                over.get(i, g.attention_backend), g.sliding_window, g.attention_chunk_size)
                   for i, g in enumerate(header.kv_cache_groups))
    skipped = []
    if header.cudagraph_mode is None and cudagraph_mode is None:
        skipped.append("the header has no cudagraph_mode: replayed as eager (no CUDA-graph padding)")
    unknown = [i for i, g in enumerate(groups) if g.attention_backend is None and g.kind != "mamba"]
    if unknown:
        skipped.append(f"group(s) {', '.join(map(str, unknown))} have no attention_backend: their backend "
                       "metadata is not computed (--attention-backend names it)")
    other = [i for i, g in enumerate(groups) if g.attention_backend not in (None, *BACKENDS)]
    if other:
        names = ", ".join(f"{i}: {groups[i].attention_backend}" for i in other)
        skipped.append(f"group(s) {names}: a backend kvmap does not model (it models {', '.join(BACKENDS)}): "
                       "the split and backend metadata are not computed")
    return ForwardConfig(runner, mode, tuple(sizes), groups, header.max_num_seqs, header.max_num_batched_tokens,
                         header.max_model_len, header.num_speculative_tokens, header.decode_context_parallel_size,
                         tuple(skipped), header.cp_kv_cache_interleave_size)
