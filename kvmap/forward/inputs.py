"""Every input a vLLM 0.33 forward pass consumes beyond the core mappings, as a list of parts.

Rules:
- A part is one item of the forward pass (issue 26): a name, a host form (numpy, over preallocated buffers), a
  scalar spec (plain Python, the reference worker's) and the buffers its host form writes. `PARTS` lists them
  in dump order; adding a part is one line there. Each part returns an object with `to_dict()`, whose keys are
  vLLM's own field names (per KV-cache group where vLLM keeps them per group) and go into the dump record.
- A part reads only `ForwardConfig` (config.py) and the step (`ForwardStep`: the per-row extras in batch order
  and the step's core `BatchMappings`, or the four of them in `core`: core.py), never the worker: the parts
  are pure functions, so a device form can be added beside the host one later (not written yet: device
  backends compute the forward inputs on host copies of their mappings).
- A part may read the results of the parts before it in `PARTS` (`step.parts[name]`): `cudagraph` (the
  step's graph choice and padded tails), `attention` (CommonAttentionMetadata per group, chunked_local virtual
  batches, the decode/prefill split) and `backends` (each group's backend metadata) chain so
  (kvmap/forward/graph_parts.py).
- The results are slots dataclasses, not frozen (a frozen dataclass's `__init__` sets each field through
  `object.__setattr__`, in the timed phase: docs/performance.md); nothing writes a result after its part. A
  part may return `Deferred` (deferred.py): its objects are made on the first read, and a later part's host
  function reads only its `payload`.
- The numba worker builds every part in one pass instead (forward/compiled.py `NumbaForward`), with the same
  values; the numpy forms here are its oracle and its fallback where a part needs objects in the phase.
- A backend that builds a part with its own code (the vLLM backends: the sampler from vLLM's input
  preparation) puts that result in `step.parts` before `ForwardBuilder.host`, which computes only the parts not
  yet there; the worker names those parts in `native_forward_parts` (workers/contract.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmap.forward import graph_parts as gp
from kvmap.forward import sampler
from kvmap.forward.config import ForwardConfig
from kvmap.forward.core import CoreArrays
from kvmap.forward.deferred import Deferred
from kvmap.forward.sampler import SamplerBuffers, SamplerRows


@dataclass(slots=True)
class ForwardStep:
    """One step as the parts see it."""

    rows: SamplerRows  # the core per-request arrays (batch order) and the per-row state the rules read
    mappings: Callable[[], Any]  # () -> the step's BatchMappings (workers/mappings.py): tables, slot_mapping
    last_sampled_tokens: Callable[[], Any]  # () -> [max_num_seqs] req_state_idx -> last sampled id (explain)
    parts: dict[str, Any] = field(default_factory=dict)  # the results of the parts computed so far this step
    core: CoreArrays | None = None  # the host workers' own core arrays (None: from `mappings()`; core.py)


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    host: Callable[[ForwardConfig, ForwardStep, Any], Any]  # (config, step, buffers) -> result (numpy form)
    spec: Callable[[ForwardConfig, ForwardStep], Any]  # (config, step) -> result (scalar spec)
    buffers: Callable[[ForwardConfig, int], Any]  # (config, max_num_tokens) -> the host form's buffers


def _sampler_host(cfg: ForwardConfig, step: ForwardStep, buf: SamplerBuffers):
    if cfg.runner == "mrv2":
        return sampler.mrv2_numpy(step.rows, buf)
    return sampler.v1_numpy(step.rows, cfg.num_speculative_tokens, buf)


def _sampler_spec(cfg: ForwardConfig, step: ForwardStep):
    if cfg.runner == "mrv2":
        return sampler.mrv2_spec(step.rows)
    return sampler.v1_spec(step.rows, cfg.num_speculative_tokens)


PARTS: tuple[Part, ...] = (
    Part("sampler", _sampler_host, _sampler_spec,
         lambda cfg, T: SamplerBuffers(cfg.max_num_seqs, cfg.num_speculative_tokens, T)),
    Part("cudagraph", gp.cudagraph_host, gp.cudagraph_spec, lambda cfg, T: gp.PaddingBuffers(cfg)),
    Part("attention", gp.attention_host, gp.attention_spec, lambda cfg, T: gp.SplitRules(cfg)),
    Part("backends", gp.backends_host, gp.backends_spec, lambda cfg, T: None),
)


@dataclass(slots=True)
class ForwardInputs:
    """One step's forward inputs: each part's result by name, in `PARTS` order."""

    runner: str
    parts: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str):  # forward.sampler, forward.cudagraph, ...
        try:
            p = self.parts[name]
        except KeyError:
            raise AttributeError(name) from None
        if type(p) is Deferred:  # made on first read (deferred.py)
            p = self.parts[name] = p.get()
        return p

    def to_dict(self) -> dict:
        """The dump keys of every part, in `PARTS` order (vLLM's names; docs/trace-format.md)."""
        out: dict = {}
        for name in self.parts:
            out.update(getattr(self, name).to_dict())
        return out


class ForwardBuilder:
    """Computes a step's `ForwardInputs` with the host forms, into buffers allocated once."""

    def __init__(self, config: ForwardConfig, max_num_tokens: int) -> None:
        self.config = config
        self.buffers = [p.buffers(config, max_num_tokens) for p in PARTS]  # [parts] each form's buffers
        self.forms = [(p.name, p.host, b) for p, b in zip(PARTS, self.buffers)]

    def host(self, step: ForwardStep) -> ForwardInputs:
        """Every part the backend has not already put in `step.parts`, in `PARTS` order."""
        cfg, done = self.config, step.parts
        native = bool(done)  # parts the backend built: `done` is then not in PARTS order
        for name, host, b in self.forms:
            if name not in done:
                done[name] = host(cfg, step, b)
        return ForwardInputs(cfg.runner, {name: done[name] for name, _, _ in self.forms} if native else done)


def forward_spec(config: ForwardConfig, step: ForwardStep) -> ForwardInputs:
    """A step's `ForwardInputs` with the scalar specs (the reference worker)."""
    done = step.parts
    for p in PARTS:
        done[p.name] = p.spec(config, step)
    return ForwardInputs(config.runner, dict(done))
