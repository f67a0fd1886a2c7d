"""Workload files (YAML) for `kvmap record`: the scheduler's settings and the requests to feed it.

Rules: a file that cannot be read, unknown or missing keys and bad values are rejected with the file, the key
path and what was expected (one `KvmapError`); `null` for a key whose default is none means "not given". Every
value the generator and vLLM's scheduler need in range is checked here, before vLLM is imported: a request
that could never be scheduled (its tokens need more KV blocks at once than the pool gives one request) is
refused up front rather than found by running into `max_steps`. Requests are explicit (`requests:`) or
generated (`generate:`) from a seeded RNG, so a workload always yields the same requests. Token ids are
derived from the seed; shared prefixes give prefix-cache hits. A request with `chunks` is a streaming-input
session; `arrivals` lists every `add_request` the engine loop makes, in step order.
"""

from __future__ import annotations

import random
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

import yaml

from kvmap.errors import KvmapError
from kvmap.trace.header import CUDAGRAPH_MODES


@dataclass(frozen=True, slots=True)
class GroupSpec:
    kind: str = "full_attention"  # full_attention | sliding_window | chunked_local | mamba
    sliding_window: int | None = None
    attention_chunk_size: int | None = None  # chunked_local: tokens per local-attention chunk
    num_layers: int = 1
    # block size the worker's attention kernel sees (header only: vLLM's scheduler never sees it); must divide
    # block_size. None: the group's block size (no split)
    kernel_block_size: int | None = None
    attention_backend: str | None = None  # header only: vLLM's AttentionBackendEnum name (FLASH_ATTN, ...)


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """A later input chunk of a streaming-input session (vLLM's resumable requests)."""
    prompt_len: int
    max_tokens: int
    # the engine step it is added at (None: with the chunk before it): a chunk that comes while its session
    # still runs its turn is queued (`streaming_queue`), one that comes later finds the session waiting
    arrival_step: int | None = None


@dataclass(frozen=True, slots=True)
class RequestSpec:
    req_id: str
    prompt_len: int
    max_tokens: int
    arrival_step: int = 0
    prefix: str | None = None  # requests naming the same prefix share its first tokens
    prefix_len: int = 0
    # a streaming-input session: the request is resumable and these chunks follow its first (prompt_len,
    # max_tokens); each turn's last sampled token is dropped and the next chunk continues the same request id
    chunks: tuple[ChunkSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class Arrival:
    """One `add_request` of the engine loop: a request, a session's next chunk, or a session's end."""
    step: int
    req_id: str
    prompt: list[int]
    max_tokens: int
    resumable: bool  # a session's chunk (False for plain requests and for a session's end)
    end: bool = False  # the session's end (vLLM: a request that is not resumable for a live session id)


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    num_requests: int = 8
    arrival_rate: float = 1.0  # mean requests per engine step (Poisson arrivals)
    prompt_len: tuple[int, int] = (16, 256)  # uniform [lo, hi]
    output_len: tuple[int, int] = (4, 64)
    shared_prefix_len: int = 0  # tokens shared by requests that pick a prefix
    num_prefixes: int = 1
    prefix_fraction: float = 0.0  # share of requests that start with one of the prefixes


@dataclass(frozen=True, slots=True)
class Workload:
    name: str = "workload"
    description: str = ""
    protocol: str = "v2"  # v1 | v2: how the scheduler sends preempted/resumed requests
    block_size: int = 16
    num_gpu_blocks: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    kv_cache_groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    num_speculative_tokens: int = 0
    draft_error_rate: float = 0.3  # chance that each draft token is wrong (rejected)
    vocab_size: int = 32000
    # vLLM's async scheduling: the engine's batch queue (EngineCore.step_with_batch_queue, depth 2)
    async_scheduling: bool = False
    # early stops: the fake model emits a stop token at an output position with probability `stop_rate`
    # (the EOS id, or one of `stop_token_ids`, chosen by the same hash); requests then honour EOS
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_rate: float = 0.0
    seed: int = 0
    max_steps: int = 100000
    # multi-rank settings (vLLM ParallelConfig): DCP spreads every request's KV over the ranks by token, so one
    # scheduler block id spans block_size * decode_context_parallel_size positions
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    tensor_parallel_size: int = 1
    # the forward pass (header only: docs/trace-format.md, "Forward-pass keys"); None: not written
    runner: str | None = None  # mrv2 | v1
    cudagraph_mode: str | None = None  # vLLM's CUDAGraphMode name
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # token counts
    requests: tuple[RequestSpec, ...] = ()
    generate: GenerateSpec | None = None
    # the file it was loaded from (not a workload key): errors found while recording name it
    source: str | None = field(default=None, compare=False, metadata={"key": False})

    def request_list(self) -> list[RequestSpec]:
        reqs = list(self.requests)
        if self.generate:
            reqs += _generated(self.generate, random.Random(self.seed), len(reqs))
        return reqs


def _generated(g: GenerateSpec, rng: random.Random, first: int) -> list[RequestSpec]:
    out, step = [], 0
    for i in range(g.num_requests):
        if i:
            step += int(rng.expovariate(g.arrival_rate)) if g.arrival_rate > 0 else 0
        prefix = None
        if g.shared_prefix_len and rng.random() < g.prefix_fraction:
            prefix = f"p{rng.randrange(g.num_prefixes)}"
        plen = rng.randint(*g.prompt_len)
        if prefix:
            plen = max(plen, g.shared_prefix_len + 1)
        out.append(RequestSpec(f"req-{first + i}", plen, rng.randint(*g.output_len), step, prefix,
                               g.shared_prefix_len if prefix else 0))
    return out


def arrivals(w: Workload) -> list[Arrival]:
    """Every `add_request` in engine-step order (stable: a session's chunks in their order, its end last)."""
    out = []
    for r in w.request_list():
        out.append(Arrival(r.arrival_step, r.req_id, prompt_tokens(w, r), r.max_tokens, bool(r.chunks)))
        at = r.arrival_step
        for i, c in enumerate(r.chunks):
            at = c.arrival_step if c.arrival_step is not None else at
            rng = random.Random(f"{w.seed}/{r.req_id}/chunk{i + 1}")
            out.append(Arrival(at, r.req_id, [rng.randrange(1, w.vocab_size) for _ in range(c.prompt_len)],
                               c.max_tokens, True))
        if r.chunks:
            out.append(Arrival(at, r.req_id, [], 1, False, end=True))
    return sorted(out, key=lambda a: a.step)


def prompt_tokens(w: Workload, r: RequestSpec) -> list[int]:
    """Deterministic prompt ids; requests with the same prefix name share their first `prefix_len` ids."""
    rng = random.Random(f"{w.seed}/{r.req_id}")
    toks = [rng.randrange(1, w.vocab_size) for _ in range(r.prompt_len)]
    if r.prefix:
        prng = random.Random(f"{w.seed}/prefix/{r.prefix}")
        toks[: r.prefix_len] = [prng.randrange(1, w.vocab_size) for _ in range(r.prefix_len)]
    return toks


# ------------------------------------------------------------------------------------------- loading


def _fail(path: str, key: str, msg: str) -> KvmapError:
    return KvmapError(msg, path=path, field=key or None)


def _build(cls, raw: object, path: str, key: str):
    if not isinstance(raw, dict):
        what = "an empty file" if raw is None and not key else type(raw).__name__
        raise _fail(path, key, f"expected a mapping, got {what}")
    names = {f.name: f for f in fields(cls) if f.metadata.get("key", True)}
    unknown = [k for k in raw if k not in names]
    if unknown:
        raise _fail(path, f"{key}.{unknown[0]}" if key else str(unknown[0]),
                    f"unknown key; expected one of: {', '.join(names)}")
    missing = [n for n, f in names.items() if n not in raw and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise _fail(path, key, f"missing key {missing[0]}")
    return cls(**{k: _value(names[k], v, path, f"{key}.{k}" if key else k) for k, v in raw.items()})


def _value(f, v, path: str, key: str):
    t = f.type
    if v is None and "None" in str(t):
        return None  # null: not given (the key's default is none)
    if f.name == "kv_cache_groups":
        if not isinstance(v, list) or not v:
            raise _fail(path, key, "expected a non-empty list of groups")
        return tuple(_build(GroupSpec, g, path, f"{key}[{i}]") for i, g in enumerate(v))
    if f.name == "requests":
        if not isinstance(v, list):
            raise _fail(path, key, "expected a list of requests")
        return tuple(_build(RequestSpec, r, path, f"{key}[{i}]") for i, r in enumerate(v))
    if f.name == "chunks":
        if not isinstance(v, list):
            raise _fail(path, key, "expected a list of chunks")
        return tuple(_build(ChunkSpec, c, path, f"{key}[{i}]") for i, c in enumerate(v))
    if f.name == "generate":
        return _build(GenerateSpec, v, path, key)
    if f.name == "eos_token_id":
        if type(v) is not int or v < 0:
            raise _fail(path, key, f"expected a token id (int >= 0) or null, got {v!r}")
        return v
    if f.name == "cudagraph_capture_sizes":
        if not (isinstance(v, list) and v and all(type(x) is int and x > 0 for x in v)):
            raise _fail(path, key, f"expected a list of token counts (ints > 0), got {v!r}")
        return tuple(sorted(set(v)))
    if f.name == "stop_token_ids":
        if not (isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)):
            raise _fail(path, key, f"expected a list of token ids, got {v!r}")
        return tuple(v)
    if "tuple[int, int]" in str(t):
        if not (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v) and 0 < v[0] <= v[1]):
            raise _fail(path, key, f"expected [lo, hi] with 0 < lo <= hi, got {v!r}")
        return tuple(v)
    want = {"int": int, "float": (int, float), "bool": bool, "str": str}
    for name, typ in want.items():
        if str(t).startswith(name):
            if isinstance(v, bool) and name != "bool":
                raise _fail(path, key, f"expected {name}, got a boolean")
            if not isinstance(v, typ):
                raise _fail(path, key, f"expected {name}, got {type(v).__name__} {v!r}")
            return v
    raise _fail(path, key, f"unexpected value {v!r}")


def least_blocks(w: Workload, r: RequestSpec) -> tuple[int, int]:
    """(tokens, blocks): the fewest tokens request `r` has computed at its last step, and the fewest blocks it then
    holds at once. Every turn runs to its max_tokens unless a stop token can end it early; a turn's last sampled
    token is never computed. A full-attention group keeps the whole sequence (one block per block_size * DCP
    tokens); any other group (a window, a local chunk, a state) holds at least one block."""
    turns = [(r.prompt_len, r.max_tokens), *((c.prompt_len, c.max_tokens) for c in r.chunks)]
    stops = w.eos_token_id is not None or bool(w.stop_token_ids)
    tokens = sum(p if stops else p + m - 1 for p, m in turns)
    per = w.block_size * w.decode_context_parallel_size
    return tokens, sum(-(-tokens // per) if g.kind == "full_attention" else 1 for g in w.kv_cache_groups)


def _needs(path: str):
    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise _fail(path, key, msg)
    return need


def _check_engine(w: Workload, need) -> None:
    need(w.protocol in ("v1", "v2"), "protocol", f"must be v1 or v2, got {w.protocol!r}")
    for key in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "max_steps"):
        need(getattr(w, key) > 0, key, "must be > 0")
    need(w.block_size % 16 == 0 or w.block_size in (1, 2, 4, 8), "block_size", "must be 1-8 or a multiple of 16")
    need(0 <= w.num_speculative_tokens <= 8, "num_speculative_tokens", "must be 0..8")
    need(0.0 <= w.draft_error_rate <= 1.0, "draft_error_rate", "must be within [0, 1]")
    need(w.vocab_size >= 2, "vocab_size",
         f"must be >= 2 (token id 0 is reserved; prompts and outputs draw ids 1 .. vocab_size - 1), got {w.vocab_size}")
    cp, inter, tp = w.decode_context_parallel_size, w.cp_kv_cache_interleave_size, w.tensor_parallel_size
    need(cp >= 1, "decode_context_parallel_size", "must be >= 1")
    need(tp >= 1 and tp % cp == 0, "tensor_parallel_size",
         f"must be >= 1 and a multiple of decode_context_parallel_size {cp} (vLLM: DCP reuses the TP ranks)")
    need(inter >= 1 and w.block_size % inter == 0, "cp_kv_cache_interleave_size",
         f"must be >= 1 and divide block_size {w.block_size}")
    need(w.runner in (None, "mrv2", "v1"), "runner", f"must be mrv2 or v1, got {w.runner!r}")
    need(w.cudagraph_mode in (None, *CUDAGRAPH_MODES), "cudagraph_mode",
         f"must be one of {', '.join(CUDAGRAPH_MODES)}, got {w.cudagraph_mode!r}")
    need(w.cudagraph_mode in (None, "NONE") or bool(w.cudagraph_capture_sizes), "cudagraph_capture_sizes",
         f"cudagraph_mode {w.cudagraph_mode} needs the capture sizes")
    need(0.0 <= w.stop_rate <= 1.0, "stop_rate", "must be within [0, 1]")
    need(w.stop_rate == 0 or w.eos_token_id is not None or bool(w.stop_token_ids), "stop_rate",
         "needs eos_token_id or stop_token_ids")
    for key, ids in (("eos_token_id", [w.eos_token_id] if w.eos_token_id is not None else []),
                     ("stop_token_ids", list(w.stop_token_ids))):
        need(all(t < w.vocab_size for t in ids), key, f"must be below vocab_size {w.vocab_size}")


def _check_groups(w: Workload, need) -> None:
    cp = w.decode_context_parallel_size
    for i, g in enumerate(w.kv_cache_groups):
        key = f"kv_cache_groups[{i}]"
        need(g.kind in ("full_attention", "sliding_window", "chunked_local", "mamba"), f"{key}.kind",
             "must be full_attention, sliding_window, chunked_local or mamba")
        need(g.num_layers >= 1, f"{key}.num_layers", f"must be >= 1, got {g.num_layers}")
        b = g.attention_backend
        need(b is None or (b.isupper() and b.replace("_", "").isalnum()), f"{key}.attention_backend",
             f"expected vLLM's attention backend enum name (FLASH_ATTN, FLASHINFER, TRITON_ATTN), got {b!r}")
        c = g.attention_chunk_size
        need(g.kind != "chunked_local" or (c or 0) > 0 and c % w.block_size == 0, f"{key}.attention_chunk_size",
             f"a chunked_local group needs a chunk of a positive multiple of block_size {w.block_size} tokens")
        need(g.kind != "chunked_local" or cp == 1, f"{key}.kind",
             "chunked_local groups are recorded without decode context parallelism")
        need(g.kind != "sliding_window" or (g.sliding_window or 0) > 0, f"{key}.sliding_window",
             "a sliding_window group needs a window > 0 tokens")
        need(g.kind != "sliding_window" or cp == 1, f"{key}.kind",
             "vLLM 0.33 does not support sliding window groups with decode_context_parallel_size > 1")
        k = g.kernel_block_size
        need(k is None or (k > 0 and w.block_size % k == 0), f"{key}.kernel_block_size",
             f"must be > 0 and divide block_size {w.block_size}")
        need(k is None or g.kind != "mamba", f"{key}.kernel_block_size", "a mamba group has no kernel blocks")
    if any(g.kind == "mamba" for g in w.kv_cache_groups):
        need(not w.enable_prefix_caching, "enable_prefix_caching",
             "mamba groups are recorded without prefix caching (mamba_cache_mode none)")
        need(w.num_speculative_tokens == 0, "num_speculative_tokens",
             "mamba groups are recorded without speculative decoding (no speculative state blocks)")


def _check_generate(g: GenerateSpec, need) -> None:
    need(g.num_requests >= 0, "generate.num_requests", f"must be >= 0, got {g.num_requests}")
    need(g.arrival_rate >= 0, "generate.arrival_rate",
         f"must be >= 0 (0: every request at step 0), got {g.arrival_rate}")
    need(g.shared_prefix_len >= 0, "generate.shared_prefix_len", f"must be >= 0, got {g.shared_prefix_len}")
    need(g.num_prefixes >= 1, "generate.num_prefixes", f"must be >= 1, got {g.num_prefixes}")
    need(0.0 <= g.prefix_fraction <= 1.0, "generate.prefix_fraction", f"must be within [0, 1], got {g.prefix_fraction}")


def _check_requests(w: Workload, reqs: list[RequestSpec], need) -> None:
    seen, pool = set(), w.num_gpu_blocks - 1  # vLLM's block pool keeps block 0 as its null block
    for i, r in enumerate(reqs):
        key = f"requests[{i}]"
        need(r.req_id not in seen, f"{key}.req_id", f"duplicate request id {r.req_id!r}")
        seen.add(r.req_id)
        need(r.prompt_len > 0 and r.max_tokens > 0, key, "prompt_len and max_tokens must be > 0")
        need(r.arrival_step >= 0, f"{key}.arrival_step", f"must be >= 0, got {r.arrival_step}")
        total = r.prompt_len + r.max_tokens + sum(c.prompt_len + c.max_tokens for c in r.chunks)
        need(total <= w.max_model_len, key,
             f"prompt_len + max_tokens (every chunk's) exceeds max_model_len {w.max_model_len}")
        at = r.arrival_step
        for j, c in enumerate(r.chunks):
            need(c.prompt_len > 0 and c.max_tokens > 0, f"{key}.chunks[{j}]", "prompt_len and max_tokens must be > 0")
            need(c.arrival_step is None or c.arrival_step >= at, f"{key}.chunks[{j}].arrival_step",
                 f"must not come before the chunk before it (step {at})")
            at = c.arrival_step if c.arrival_step is not None else at
        need(r.prefix_len >= 0, f"{key}.prefix_len", f"must be >= 0, got {r.prefix_len}")
        need(r.prefix is not None or r.prefix_len == 0, f"{key}.prefix_len",
             "needs `prefix` (the name the requests sharing these tokens give)")
        need(r.prefix_len < r.prompt_len, f"{key}.prefix_len", "must be shorter than the prompt")
        tokens, blocks = least_blocks(w, r)
        need(blocks <= pool, key,
             f"can never be scheduled: its {tokens} tokens need at least {blocks} KV cache "
             f"block{'s' if blocks != 1 else ''} at once, and "
             f"num_gpu_blocks {w.num_gpu_blocks} gives one request at most {pool} (block 0 is vLLM's null block)")


def _check(w: Workload, path: str) -> Workload:
    need = _needs(path)
    _check_engine(w, need)
    _check_groups(w, need)
    if w.generate:
        _check_generate(w.generate, need)
    reqs = w.request_list()
    need(bool(reqs), "requests", "no requests: give `requests:` or `generate:`")
    _check_requests(w, reqs, need)
    return w


def load_workload(path: str | Path) -> Workload:
    p = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KvmapError("no such file", path=p) from None
    except IsADirectoryError:
        raise KvmapError("is a folder, not a workload file", path=p) from None
    except OSError as e:
        raise KvmapError(f"cannot read: {e.strerror or e}", path=p) from None
    except UnicodeDecodeError as e:
        raise KvmapError(f"not a text file (UTF-8): byte {e.object[e.start]:#04x} at offset {e.start}",
                         path=p) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise KvmapError(f"not valid YAML: {getattr(e, 'problem', e)}", path=p,
                         line=mark.line + 1 if mark else None) from None
    w = _build(Workload, raw, p, "")
    return _check(replace(w, name=Path(path).stem.split(".")[0] if w.name == "workload" else w.name, source=p), p)
