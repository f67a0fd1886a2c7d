"""Item 1 of the forward pass (kvmap/forward/sampler.py): the numpy form against the scalar spec, bit for bit, on
every bundled trace under both runners and on fuzzed batches; the spec against hand arithmetic; the forward keys
of a replay's dump (reference = numpy = numba) and the dump of a replay without --forward unchanged."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kvmap.forward import sampler as S
from kvmap.forward.config import resolve
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.workers.registry import make_worker

TRACES = Path(__file__).resolve().parent.parent / "traces"
SMALL = sorted(p.name for p in TRACES.glob("*.jsonl"))


def rows(qs, nc, d, pre, prompt=None, idx=None, last=None, ids=None) -> tuple[S.SamplerRows, np.ndarray]:
    """(rows, last_sampled_tokens) of a batch; per-request lists in batch order, spread over request-state rows
    `idx` (default 0..R-1) of a pool of max(idx) + 1 rows."""
    R = len(qs)
    qsl = np.zeros(R + 1, np.int32)
    np.cumsum(qs, out=qsl[1:])
    T = int(qsl[-1])
    nc = np.array(nc, np.int32)
    idx = np.array(idx if idx is not None else range(R), np.int32)
    N = int(idx.max()) + 1 if R else 1

    def by_row(values):
        out = np.zeros(N, np.int32)
        out[idx] = values
        return out

    r = S.SamplerRows(idx, qsl, nc + np.array(qs, np.int32), nc, np.array(d, np.int32), by_row(pre),
                      by_row(prompt if prompt is not None else pre),
                      np.array(ids if ids is not None else range(100, 100 + T), np.int32), any(d))
    return r, by_row(last if last is not None else [9000 + b for b in range(R)])


def same(a, b) -> None:
    for k in a.__slots__:
        x, y = getattr(a, k), getattr(b, k)
        if x is None or y is None:
            assert x is None and y is None, k
            continue
        assert x.dtype == y.dtype, (k, x.dtype, y.dtype)
        assert np.array_equal(x, y), (k, x, y)


def check_forms(r: S.SamplerRows, k: int, last: np.ndarray) -> np.ndarray:
    """Both forms of every rule equal, bit for bit; MRV2's input ids (the spec's) returned."""
    R, T = len(r.idx_mapping), len(r.input_ids)
    buf = S.SamplerBuffers(max(R, len(last)), k, max(T, 1))
    same(S.mrv2_spec(r), S.mrv2_numpy(r, buf))
    same(S.v1_spec(r, k), S.v1_numpy(r, k, buf))
    ids = S.mrv2_input_ids_spec(r, last)
    got = S.mrv2_input_ids_numpy(r, last, buf)
    assert got.dtype == ids.dtype == np.int32 and np.array_equal(got, ids), (got, ids)
    return ids


def test_mrv2_by_hand():
    # forward-pass.md 3.1's probe: B (row 7, 3 tokens, 2 drafts), C (row 5, 1 token), A (row 6, 8-token chunk)
    r, last = rows([3, 1, 8], nc=[40, 20, 0], d=[2, 0, 0], pre=[30, 10, 50], idx=[7, 5, 6], last=[1111, 5555, 6666])
    m = S.mrv2_spec(r)
    assert m.cu_num_logits.tolist() == [0, 3, 4, 4 + 1]
    assert m.logits_indices.tolist() == [3 - 3 + 0, 3 - 3 + 1, 3 - 3 + 2, 4 - 1, 12 - 1]
    assert m.logits_indices.dtype == np.int64 and m.expanded_idx_mapping.dtype == np.int64
    assert m.expanded_idx_mapping.tolist() == [7, 7, 7, 5, 6]
    assert m.expanded_local_pos.tolist() == [0, 1, 2, 0, 0]
    # B: last sampled at its first logit row, its drafts (staged ids 101, 102) after; C: last sampled; A: prefill
    ids = check_forms(r, 3, last)
    assert ids.tolist()[:4] == [1111, 101, 102, 5555]
    assert ids.tolist()[4:] == list(range(104, 112))


def test_mrv2_prompt_tail_and_stale():
    # one request whose step ends 2 past its prefill without drafts: the first logit row is the last token,
    # position nc + 2 = 12 >= prefill 11, so last_sampled goes there; position 11 is written by nobody (stale)
    r, last = rows([3], nc=[10], d=[0], pre=[11])
    assert check_forms(r, 0, last).tolist() == [100, S.STALE_INPUT_ID, 9000]


def test_v1_docstring_example():
    # vLLM's _calc_spec_decode_metadata docstring: cu_num_scheduled_tokens [4, 104, 107, 207, 209]
    r, last = rows([4, 100, 3, 100, 2], nc=[10, 0, 20, 0, 30], d=[3, 0, 2, 0, 1], pre=[10, 200, 20, 200, 30])
    v = S.v1_spec(r, 3)
    assert v.logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert v.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert v.cu_num_sampled_tokens.tolist() == [4, 5, 8, 9, 11]
    assert v.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert v.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert v.draft_token_ids.tolist() == [100 + 1, 100 + 2, 100 + 3, 100 + 105, 100 + 106, 100 + 208]
    assert v.num_decode_draft_tokens.tolist() == [3, -1, 2, -1, 1]
    assert S.v1_spec(r, 0).logits_indices.tolist() == [3, 103, 106, 206, 208]
    assert S.v1_spec(r, 0).logits_indices.dtype == np.int32
    check_forms(r, 3, last)


def test_fuzzed_batches():
    rng = np.random.default_rng(26)
    for _ in range(300):
        R = int(rng.integers(0, 12))
        k = int(rng.integers(0, 5))
        d = rng.integers(0, k + 1, R) if k else np.zeros(R, int)
        d = d * (rng.random(R) < 0.6)
        qs = d + 1 + rng.integers(0, 3, R) * (rng.random(R) < 0.3) * rng.integers(1, 40, R)
        nc = rng.integers(0, 200, R)
        pre = np.maximum(nc + rng.integers(-30, 30, R), 1)
        r, last = rows(qs.tolist(), nc.tolist(), d.tolist(), pre.tolist(),
                       prompt=np.maximum(pre - rng.integers(0, 5, R), 1).tolist(),
                       idx=rng.permutation(max(R, 1))[:R].tolist(), last=rng.integers(0, 5000, R).tolist(),
                       ids=rng.integers(0, 5000, int(qs.sum())).tolist())
        check_forms(r, k, last)


def _forms_on_trace(path: Path, runner: str, stop: int | None = None) -> int:
    t = Trace(path)
    w = make_worker("numpy", t.header, batch_order=runner)
    cfg = resolve(t.header, runner)
    k = t.header.num_speculative_tokens
    n = 0
    for step in t.steps(0, stop):
        w.run_step(step)
        fs = w.forward_step()
        ids = check_forms(fs.rows, k, fs.last_sampled_tokens())
        # MRV2's input ids after the combine kernel are the token rows' own (no stale position in a vLLM trace)
        assert np.array_equal(ids, fs.rows.input_ids), step.step
        assert cfg.runner == runner
        w.append_sampled()
        n += 1
    return n


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
@pytest.mark.parametrize("name", SMALL)
def test_forms_on_bundled_traces(name, runner):
    assert _forms_on_trace(TRACES / name, runner) > 0


def test_forms_on_long_trace_slice():
    assert _forms_on_trace(TRACES / "long_mixed.jsonl.gz", "mrv2", stop=300) == 300


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
@pytest.mark.parametrize("name", ["spec_decode.jsonl", "async_spec_decode.jsonl", "chunked_prefill.jsonl"])
def test_forward_dump_backends_agree(name, runner):
    """Every host worker (the torch worker: on host copies of its tensors) dumps the reference's forward keys."""
    pytest.importorskip("torch")
    dumps = {}
    for b in ("reference", "numpy", "numba", "torch"):
        got: list[dict] = []
        replay(Trace(TRACES / name), ReplayConfig(backend=b, forward=True, batch_order=runner, nvtx=False, warmup=0,
                                                  write_kv=False), on_mappings=got.append)
        dumps[b] = got
    assert dumps["numpy"] == dumps["reference"] == dumps["numba"] == dumps["torch"]
    keys = {"cu_num_logits", "expanded_local_pos"} if runner == "mrv2" else {"logits_indices"}
    assert keys <= set(dumps["numpy"][0])


def test_dump_without_forward_unchanged(tmp_path):
    from kvmap.workers.mappings import DUMP_KEYS, dump_line

    got: list[dict] = []
    replay(Trace(TRACES / "spec_decode.jsonl"), ReplayConfig(nvtx=False, warmup=0, write_kv=False),
           on_mappings=got.append)
    assert all(set(d) <= set(DUMP_KEYS) for d in got)
    line = json.loads(dump_line({**got[0], "logits_indices": [1]}))
    assert list(line)[-1] == "logits_indices"
    assert list(itertools.islice(line, 3)) == ["step", "req_ids", "idx_mapping"]


WRONG_BONUS = '''
from kvmap.workers.host import NumpyWorker


class LastRowLogits(NumpyWorker):
    """Samples every request's first scheduled token instead of its last (a wrong logits_indices)."""

    def prepare_forward(self):
        super().prepare_forward()
        s = self.forward.sampler
        s.logits_indices[: len(s.logits_indices)] = self.mappings().query_start_loc[:-1][: len(s.logits_indices)]
'''


def test_deep_validate_compares_forward_inputs(tmp_path):
    from kvmap.validate.deep import deep_check

    path = tmp_path / "wrong_logits.py"
    path.write_text(WRONG_BONUS)
    r = deep_check(Trace(TRACES / "chunked_prefill.jsonl"), [f"{path}:LastRowLogits", "numpy"])
    bad, good = r["backends"][f"{path}:LastRowLogits"], r["backends"]["numpy"]
    assert good["differing_steps"] == 0 and bad["differing_steps"] > 0
    first = next(p for p in r["problems"] if p["kind"] == "conformance")
    assert first["field"] == "logits_indices", first


def test_triton_worker_forward_on_host_copies():
    """The Triton worker (CPU tensors under TRITON_INTERPRET=1) computes the forward keys on host copies."""
    pytest.importorskip("triton")
    dumps = {}
    for b in ("reference", "triton"):
        got: list[dict] = []
        replay(Trace(TRACES / "worked_example.jsonl"), ReplayConfig(backend=b, forward=True, nvtx=False, warmup=0,
                                                                    write_kv=False), on_mappings=got.append)
        dumps[b] = got
    assert dumps["triton"] == dumps["reference"] and "logits_indices" in dumps["triton"][1]


CORE_ONLY = '''
from kvmap.workers.reference import ReferenceWorker


class CoreOnly(ReferenceWorker):
    """A backend of the core mappings only (as a user's Worker subclass is unless it implements prepare_forward)."""

    name = "core_only"
    computes_forward = False
'''


def test_a_backend_without_forward_inputs(tmp_path):
    from kvmap.errors import KvmapError
    from kvmap.validate.deep import deep_check

    path = tmp_path / "core_only.py"
    path.write_text(CORE_ONLY)
    with pytest.raises(KvmapError) as e:
        replay(Trace(TRACES / "worked_example.jsonl"), ReplayConfig(backend=f"{path}:CoreOnly", forward=True))
    assert e.value.field == "--forward"
    r = deep_check(Trace(TRACES / "spec_decode.jsonl"), [f"{path}:CoreOnly"])
    assert r["backends"][f"{path}:CoreOnly"]["differing_steps"] == 0 and not r["problems"]
