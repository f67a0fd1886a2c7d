"""Every bundled trace, every built-in backend, both batch orders: the `--dump-mappings` bytes equal the ones
recorded in tests/data/golden_dumps.json (scripts/golden_dumps.py, which says how each case runs and why Triton
replays a step window). A refusal recorded there must stay the same refusal."""

from __future__ import annotations

from .conftest import load_script


def test_every_dump_is_byte_identical_to_the_golden_one():
    g = load_script("golden_dumps")
    g.setup_env()
    want = g.load_golden()
    assert {g.case_key(*c) for c in g.all_cases()} == set(want) - {"_about"}, "the cases changed: rerun --write?"
    cases = [c for c in g.all_cases() if g.installed(c[1])]  # a backend whose package is missing: not its cases
    got = g.compute(cases)
    diffs = g.differences({k: v for k, v in want.items() if k in got}, got)
    assert not diffs, f"{len(diffs)} of {len(cases)} dumps differ from the golden ones:\n" + "\n".join(diffs)
