"""Turn a running vLLM scheduler into a kvmap trace: header from its config, one line per `schedule()`.

Rules:
- `RecordingScheduler` wraps any vLLM v1 scheduler object: `schedule()` is serialized at once (before anything
  can mutate the output), `update_from_output()` adds the model's sampled tokens (copied before the scheduler
  trims them in place), `update_draft_token_ids()` the drafts; the line is written when the step's output
  arrives (or when the next step starts, for a step whose output never came). Offline recording and the live
  plugin use this same class.
- Every dataclass field of `SchedulerOutput` is written; sets become sorted lists, tuples lists; objects that
  are not plain data (sampling params, connector metadata, tensors) become null.
- The writer never breaks the engine: a write error is reported once on stderr and recording stops.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import sys
from typing import Any

from kvmap.trace import FORMAT

_OPAQUE = {"sampling_params", "pooling_params", "lora_request", "mm_features", "prompt_embeds",
           "kv_connector_metadata", "ec_connector_metadata", "ec_manager_metadata", "aux_output_connector_metadata",
           "kv_connector_block_state", "encoder_input_updates", "scheduled_encoder_input_stats", "kv_hints"}


def to_plain(value: Any, key: str | None = None) -> Any:
    if key in _OPAQUE:
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(to_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name), f.name) for f in dataclasses.fields(value)}
    if hasattr(value, "tolist"):  # numpy / torch
        try:
            return value.tolist()
        except Exception:  # noqa: BLE001 - opaque device tensors
            return None
    return None


def header_from_config(vllm_config: Any, kv_cache_config: Any,
                       kernel_block_sizes: list[int | None] | None = None, **extra: Any) -> dict:
    """The trace header (trace-format.md) from a running vLLM's configs. `kernel_block_sizes` (one per group, as
    vLLM's worker chose them: `prepare_kernel_block_sizes`; None: no split) is known only on the worker side; the
    scheduler never sees it; attention groups only. Multi-rank keys are written only where they differ from their
    defaults, so older traces keep their bytes."""
    import vllm
    from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec

    sc, cc, pc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.parallel_config
    groups, spec0 = [], None
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = "sliding_window" if isinstance(spec, SlidingWindowSpec) else "full_attention"
        name = type(spec).__name__
        if "Mamba" in name:
            kind = "mamba"
        elif "ChunkedLocal" in name:
            kind = "chunked_local"
        grp = {"group_id": i, "kind": kind, "block_size": spec.block_size,
               "sliding_window": getattr(spec, "sliding_window", None) if kind == "sliding_window" else None,
               "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
               "num_layers": len(g.layer_names), "spec": name}
        kbs = kernel_block_sizes[i] if kernel_block_sizes and i < len(kernel_block_sizes) else None
        if kbs is not None and kbs != spec.block_size and isinstance(spec, AttentionSpec):
            grp["kernel_block_size"] = kbs
        if not getattr(spec, "dcp_sharded", True):  # vLLM: Mamba state and draft groups are replicated
            grp["dcp_sharded"] = False
        if kind == "mamba":  # vLLM: the V1 runner gives Mamba groups SlotMappingMode.NONE
            grp["uses_slot_mapping"] = False
        groups.append(grp)
        if spec0 is None and isinstance(spec, AttentionSpec):
            spec0 = spec
    spec_cfg = vllm_config.speculative_config
    ranks = {k: v for k, v in (("decode_context_parallel_size", pc.decode_context_parallel_size),
                               ("cp_kv_cache_interleave_size", pc.cp_kv_cache_interleave_size),
                               ("tensor_parallel_size", pc.tensor_parallel_size)) if v != 1}
    return {
        "kind": "header",
        "format": FORMAT,
        "vllm_version": vllm.__version__,
        "model_runner_protocol": "v2" if vllm_config.use_v2_model_runner else "v1",
        "block_size": cc.block_size,
        "num_gpu_blocks": kv_cache_config.num_blocks,
        "null_block_id": 0,
        "kv_cache_groups": groups,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_num_scheduled_tokens": getattr(sc, "max_num_scheduled_tokens", None),
        "max_model_len": vllm_config.model_config.max_model_len,
        "num_speculative_tokens": spec_cfg.num_speculative_tokens if spec_cfg else 0,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "async_scheduling": sc.async_scheduling,
        "scheduling_policy": str(getattr(sc, "policy", "fcfs")),
        "kv_cache_spec": {"num_layers": sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups),
                          "num_kv_heads": getattr(spec0, "num_kv_heads", None),
                          "head_size": getattr(spec0, "head_size", None),
                          "dtype": str(getattr(spec0, "dtype", "")).replace("torch.", "") or None},
        **ranks,
        **extra,
    }


class TraceWriter:
    """Writes header and step lines; flushes every line; on the first write error, warns once and stops."""

    def __init__(self, path: str, header: dict) -> None:
        self.path = path
        self.failed = False
        self.steps = 0
        try:
            raw = open(path, "wb")
            # mtime=0 and no file name: byte-identical output for identical input
            self._f: io.IOBase = (io.TextIOWrapper(gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename=""),
                                                   encoding="utf-8")
                                  if path.endswith(".gz") else io.TextIOWrapper(raw, encoding="utf-8"))
        except OSError as e:
            self._fail(e)
            return
        self.write(header)

    def _fail(self, e: Exception) -> None:
        if not self.failed:
            print(f"kvmap record: cannot write {self.path}: {e}; recording stops, the engine goes on",
                  file=sys.stderr)
        self.failed = True

    def write(self, obj: dict) -> None:
        if self.failed:
            return
        try:
            self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
            self._f.flush()
        except Exception as e:  # noqa: BLE001 - never break the engine
            self._fail(e)

    def close(self) -> None:
        if not self.failed:
            try:
                self._f.close()
            except Exception as e:  # noqa: BLE001
                self._fail(e)


class RecordingScheduler:
    """Delegates to a vLLM scheduler and records each step. Attribute access falls through to the scheduler."""

    def __init__(self, scheduler: Any, writer: TraceWriter) -> None:
        self._scheduler = scheduler
        self._writer = writer
        self._pending: dict | None = None
        self._step = 0
        self.num_preemptions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def _flush(self) -> None:
        if self._pending is not None:
            self._writer.write(self._pending)
            self._writer.steps += 1
            self._pending = None

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = self._scheduler.schedule(*args, **kwargs)
        self._flush()
        try:
            so = to_plain(out)
            self.num_preemptions += len(so.get("preempted_req_ids") or [])
            self._pending = {"step": self._step, "scheduler_output": so, "sampled_token_ids": None,
                             "draft_token_ids": {}}
        except Exception as e:  # noqa: BLE001
            self._writer._fail(e)
        self._step += 1
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._pending is not None:
            try:
                req_ids = list(model_runner_output.req_ids)
                sampled = model_runner_output.sampled_token_ids
                self._pending["sampled_token_ids"] = {
                    r: [int(t) for t in sampled[model_runner_output.req_id_to_index[r]]]
                    for r in scheduler_output.num_scheduled_tokens if r in model_runner_output.req_id_to_index
                } if sampled is not None and len(sampled) == len(req_ids) else None
            except Exception as e:  # noqa: BLE001
                self._writer._fail(e)
        return self._scheduler.update_from_output(scheduler_output, model_runner_output)

    def update_draft_token_ids(self, draft_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if self._pending is not None and draft_token_ids is not None:
            self._pending["draft_token_ids"] = {r: [int(t) for t in d] for r, d in
                                                zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)}
        return self._scheduler.update_draft_token_ids(draft_token_ids, *args, **kwargs)

    def close(self) -> None:
        self._flush()
        self._writer.close()
