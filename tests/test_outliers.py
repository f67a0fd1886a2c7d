"""The outlier rule (kvmap/run/stats.py): steps are slow against a per-step cost model of their scheduled tokens
and requests, not against the median step, so big prefill steps are not flagged and a truly slow step is; slow
reads are reported as I/O."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.run.stats import slow_steps, warnings
from kvmap.trace import Trace

from .conftest import ROOT, TRACES

runner = CliRunner()
SLOW = f"{ROOT / 'tests' / 'backends' / 'slow_step_backend.py'}:SlowStepWorker"


def test_the_cost_model_flags_the_step_it_does_not_explain_not_the_big_ones():
    rng = np.random.default_rng(0)
    tokens = rng.choice([1, 16, 1024], size=400)
    reqs = rng.integers(1, 64, size=400)
    ns = (5_000 + 100 * tokens + 300 * reqs) * rng.uniform(0.95, 1.05, size=400)
    ns[123] *= 3  # the one slow step: three times what its work explains
    got = slow_steps(ns.astype(np.int64), tokens, reqs)
    assert got.index.tolist() == [123]


def test_flat_times_flag_nothing():
    n = np.full(20, 1000, dtype=np.int64)
    assert not len(slow_steps(n, np.arange(20), np.ones(20, dtype=np.int64)).index)


def test_the_long_traces_prefill_steps_are_not_outliers():
    r = replay(Trace(TRACES / "long_mixed.jsonl.gz"), ReplayConfig())
    m = r.measured()
    nr, nt = r.measured_counts()
    work = m.sum(axis=1) - m[:, r.phases.index("read_step")]
    total = m.sum(axis=1).astype(np.float64)
    med = np.median(total)
    old = 0.6745 * (total - med) / np.median(np.abs(total - med)) > 14  # the median-step rule this replaces
    slow = slow_steps(work, nt, nr)
    # what it flagged: the big prefill steps (about 70 on a quiet machine; fewer when other work widens the
    # spread: 25 with the test suite running beside it)
    assert old.sum() >= 10 and np.median(nt[old]) > 500
    assert len(slow.index) <= len(m) // 100  # a busy machine may still slow a few steps, not the big ones
    assert not any("--warmup" in w for w in warnings(r))


def test_a_truly_slow_step_is_named():
    res = runner.invoke(app, ["replay", str(TRACES / "chunked_prefill.jsonl"), "--backend", SLOW, "--warmup", "0",
                              "--no-progress"])
    assert res.exit_code == 0, res.output
    said = [w for w in res.output.splitlines() if "slower than their scheduled tokens" in w]
    assert len(said) == 1 and "the worst step 7 at " in said[0], res.output
