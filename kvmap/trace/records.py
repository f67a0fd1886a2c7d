"""Trace records: the header and one step's `SchedulerOutput`, typed, under vLLM's own names.

Rules: plain dataclasses, no behaviour beyond derived properties; every parser produces these and every
consumer (workers, validate, explain) reads only these. Shapes are stated per field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT = "kvmap-vllm-trace/1"
TOKEN_ID_LIMIT = 2**31  # token rows are int32, as vLLM's
GROUP_KINDS = ("full_attention", "sliding_window", "chunked_local", "mamba")
PROTOCOLS = ("v1", "v2")
ASYNC_SPEC_KEYS = frozenset({"spec_draft_token_ids", "num_rejected_tokens", "num_computed_tokens_correction"})


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    group_id: int
    kind: str  # full_attention | sliding_window | chunked_local | mamba
    block_size: int  # tokens per block in this group
    sliding_window: int | None = None  # tokens, sliding_window groups only
    attention_chunk_size: int | None = None  # tokens, chunked_local groups only
    kernel_block_size: int | None = None  # tokens per attention-kernel block; None: block_size (no split)
    dcp_sharded: bool = True  # False: replicated on every DCP rank (cp = 1 for this group)
    uses_slot_mapping: bool = True  # False (mamba): slots all PAD_SLOT_ID, rows hold state indices
    extra_retained_tokens: int = 0  # tokens kept below the window (sliding_window groups; vLLM's SlidingWindowSpec)
    attention_backend: str | None = None  # vLLM's AttentionBackendEnum name (FLASH_ATTN, ...); None: unknown


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None
    dtype: str | None = None


@dataclass(frozen=True, slots=True)
class TraceHeader:
    model_runner_protocol: str  # "v1" | "v2"
    block_size: int
    num_gpu_blocks: int  # block ids are 0 .. num_gpu_blocks - 1, one pool for all groups
    kv_cache_groups: tuple[KVCacheGroup, ...]
    max_num_seqs: int  # also the number of worker request-state rows
    max_num_batched_tokens: int
    max_model_len: int
    num_speculative_tokens: int = 0
    null_block_id: int | None = None
    max_num_scheduled_tokens: int | None = None
    vllm_version: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    async_scheduling: bool | None = None
    max_concurrent_batches: int = 1  # engine batch-queue depth (2 under async scheduling)
    eos_token_id: int | None = None  # informational: why a request stopped
    stop_token_ids: tuple[int, ...] = ()
    scheduling_policy: str | None = None
    kv_cache_spec: KVCacheSpec = field(default_factory=KVCacheSpec)
    extra: dict[str, Any] = field(default_factory=dict)  # informational keys kvmap does not interpret
    source: str | None = field(default=None, compare=False, repr=False)  # the file it came from, for errors
    decode_context_parallel_size: int = 1  # DCP world size: every request's KV spread over cp ranks by token
    cp_kv_cache_interleave_size: int = 1  # consecutive tokens on one DCP rank before the next
    tensor_parallel_size: int = 1  # KV heads split over TP ranks; mappings identical on TP ranks
    # the forward pass (docs/trace-format.md, "Forward-pass keys"): None when the recorder did not write them
    runner: str | None = None  # "mrv2" | "v1": the model runner that ran (None: not recorded)
    cudagraph_mode: str | None = None  # vLLM's resolved CUDAGraphMode name (None: not recorded, eager)
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # resolved capture sizes, ascending

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_groups)

    @property
    def cp_size(self) -> int:
        return self.decode_context_parallel_size

    @property
    def has_kernel_split(self) -> bool:
        """Some group hands the attention kernel blocks smaller than the manager's."""
        return any(g.kernel_block_size not in (None, g.block_size) for g in self.kv_cache_groups)

    @property
    def token_budget(self) -> int:
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]  # [prompt_len]
    block_ids: list[list[int]]  # [num_groups][num_blocks_g]: all blocks so far, prefix hits first
    num_computed_tokens: int  # prefix-cache hit length = position of the first scheduled token
    prefill_token_ids: list[int] | None  # v2 protocol: prompt + outputs before a preemption

    @property
    def token_ids(self) -> list[int]:
        """The tokens the worker's row starts with."""
        return self.prefill_token_ids if self.prefill_token_ids is not None else self.prompt_token_ids


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str]  # running requests (running-queue order), then v1 resumed ones
    resumed_req_ids: set[str]  # v1: new_block_ids replace the row instead of appending
    new_block_ids: list[list[list[int]] | None]  # [num_cached] -> None | [num_groups][new blocks]
    num_computed_tokens: list[int]  # [num_cached], before this step's tokens
    all_token_ids: dict[str, list[int]]  # v1: full token list of requests not scheduled last step
    num_output_tokens: list[int] | None  # [num_cached]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this step (drafts included), scheduler order
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]  # req_id -> draft ids to verify
    finished_req_ids: list[str]  # free before this step
    preempted_req_ids: list[str]  # preempted while scheduling this step


@dataclass(slots=True)
class Step:
    step: int
    line: int  # 1-based line in the file
    scheduler_output: SchedulerOutput
    sampled_token_ids: dict[str, list[int]] | None  # req_id -> tokens the model returned; None: not recorded
    draft_token_ids: dict[str, list[int]] | None  # req_id -> drafts proposed after this step
    async_spec: AsyncSpecDecode | None = None  # async scheduling with speculative decoding (None: not recorded)

    # what the replay loop reads of every step
    @property
    def num_reqs(self) -> int:
        return len(self.scheduler_output.num_scheduled_tokens)

    @property
    def num_tokens(self) -> int:
        return self.scheduler_output.total_num_scheduled_tokens

    @property
    def new_req_ids(self) -> list[str]:
        return [nr.req_id for nr in self.scheduler_output.scheduled_new_reqs]

    def scheduled_req_ids(self):
        """The scheduled requests' ids, in scheduler order."""
        return self.scheduler_output.num_scheduled_tokens.keys()


@dataclass(slots=True)
class AsyncSpecDecode:
    """What a recorder saw of async speculative decoding in one step (docs/trace-format.md): the scheduler sends -1
    draft placeholders and an optimistic num_computed_tokens."""

    spec_draft_token_ids: dict[str, list[int]]  # req_id -> the real drafts verified this step (placeholders' ids)
    num_rejected_tokens: dict[str, int]  # req_id -> drafts rejected this step
    num_computed_tokens_correction: dict[str, int]  # req_id -> how far this step's num_computed_tokens is too high
