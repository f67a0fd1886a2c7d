"""Start-up stays light: `kvmap --help` and `kvmap validate` import neither torch (~2 s) nor numba; a host replay
imports no torch (the KV cache is numpy memory), and no numba when its kernels were compiled ahead of time at
install (kvmap.aot), else numba for its JIT."""

from __future__ import annotations

import subprocess
import sys

from .conftest import TRACES

PROBE = """
import sys
from kvmap.cli.app import app
try:
    app(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
print(sorted(m for m in ("torch", "numba", "triton") if m in sys.modules))
"""


def heavy_modules(*args: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_help_imports_nothing_heavy():
    assert heavy_modules("--help") == "[]"


def test_validate_imports_nothing_heavy():
    assert heavy_modules("validate", str(TRACES / "worked_example.jsonl")) == "[]"


def aot_built() -> bool:
    from kvmap.aot import twins_on_disk

    return twins_on_disk()


def test_host_replay_imports_no_torch():
    assert heavy_modules("replay", str(TRACES / "worked_example.jsonl"), "--no-progress", "--verify-kv") == \
        ("[]" if aot_built() else "['numba']")
    assert heavy_modules("replay", str(TRACES / "worked_example.jsonl"), "--no-progress", "-b", "numpy") == "[]"


def test_torch_backend_does_import_torch():  # the probe can see an import
    assert "torch" in heavy_modules("replay", str(TRACES / "worked_example.jsonl"), "--no-progress", "-b", "torch")


NUMPY_PROBE = PROBE.replace('("torch", "numba", "triton")', '("numpy",)')


def test_validate_of_a_valid_trace_imports_no_numpy():  # the checked parser imports it only when it must look
    out = subprocess.run([sys.executable, "-c", NUMPY_PROBE, "validate", str(TRACES / "worked_example.jsonl")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_fast_exit_keeps_output_files_and_exit_codes(tmp_path):
    """`main()` ends replay/validate without Python's teardown: output is flushed, files complete, codes kept."""
    out = tmp_path / "r.json"
    ok = subprocess.run([sys.executable, "-m", "kvmap", "replay", str(TRACES / "worked_example.jsonl"), "--json",
                         str(out), "--no-progress"], capture_output=True, text=True)
    assert ok.returncode == 0 and "time per measured step" in ok.stdout
    assert '"kvmap-replay-result/1"' in out.read_text()
    bad = subprocess.run([sys.executable, "-m", "kvmap", "replay", str(tmp_path / "missing.jsonl")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr
    assert subprocess.run([sys.executable, "-m", "kvmap", "validate", str(TRACES / "worked_example.jsonl")],
                          capture_output=True, text=True).returncode == 0


def test_root_help_lists_every_command_without_typers_markdown_stack():
    """`kvmap --help` is drawn by kvmap (rich panel + table), not typer's rich formatter (which imports
    rich.markdown, markdown_it and pygments): the same usage, options and commands."""
    from kvmap.cli.app import app

    probe = PROBE.replace('("torch", "numba", "triton")', '("markdown_it", "pygments", "typer.rich_utils")')
    out = subprocess.run([sys.executable, "-c", probe, "--help"], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "COLUMNS": "200"})
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "Usage:" in out.stdout and "--version" in out.stdout and "Print the version and exit." in out.stdout
    for cmd in app.registered_commands:
        name = cmd.name or cmd.callback.__name__
        first = " ".join((cmd.callback.__doc__ or "").split("\n\n")[0].split())
        assert f"{name}  " in out.stdout and first[:60] in out.stdout, name


ENTRY = """
import sys
sys.argv = ["kvmap", *sys.argv[1:]]
from kvmap.cli import main
main()
print(sorted(m for m in ("typer", "numpy", "kvmap.cli.app") if m in sys.modules), file=sys.stderr)
"""


def test_kvmap_help_is_drawn_before_typer_loads_and_equals_the_apps_help():
    """`kvmap --help` (the entry point) imports neither typer nor numpy nor the app, and prints byte for byte
    what the Typer app prints for `--help` (root_help's lists are held to the app here), at a set width and
    piped."""
    import os

    for env in ({"COLUMNS": "100"}, {}):
        env = {k: v for k, v in {**os.environ, **env}.items() if k != "COLUMNS" or env}
        fast = subprocess.run([sys.executable, "-c", ENTRY, "--help"], capture_output=True, text=True, check=True,
                              env=env)
        assert fast.stderr.strip().splitlines()[-1] == "[]"
        typer_help = subprocess.run([sys.executable, "-c", "from kvmap.cli.app import app\ntry:\n    app(['--help'], "
                                     "prog_name='kvmap')\nexcept SystemExit:\n    pass"], capture_output=True,
                                    text=True, check=True, env=env)
        assert fast.stdout == typer_help.stdout and "Commands" in fast.stdout


def test_building_one_command_gives_the_command_the_whole_app_gives():
    """`main` builds only the command on the command line (cli/app.py): its parameters and help are those the
    whole app builds for it."""
    import typer.main

    from kvmap.cli.app import app, command_name

    whole = typer.main.get_command(app)
    saved = app.registered_commands
    try:
        for cmd in saved:
            app.registered_commands = [cmd]
            one = typer.main.get_command(app).commands[command_name(cmd)]
            full = whole.commands[command_name(cmd)]
            assert [(p.name, p.opts, p.default, p.help if hasattr(p, "help") else None) for p in one.params] == \
                [(p.name, p.opts, p.default, p.help if hasattr(p, "help") else None) for p in full.params]
            assert one.help == full.help
    finally:
        app.registered_commands = saved


BLAS_PROBE = """
import os, sys
sys.argv = ["kvmap", "--help"]
from kvmap.cli import main
main()
import numpy  # after main, as every command imports it
print("BLAS", os.environ.get("OPENBLAS_NUM_THREADS"), os.environ.get("OMP_NUM_THREADS"))
"""


def test_openblas_gets_one_thread_unless_the_user_chose_a_count():
    """numpy's OpenBLAS starts a thread pool at import that spins on the other core; kvmap makes no BLAS call,
    so its entry point sets one thread before numpy loads, and leaves a count the user chose alone."""
    import os

    def run(**env: str) -> str:
        e = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
        out = subprocess.run([sys.executable, "-c", BLAS_PROBE], capture_output=True, text=True, check=True,
                             env={**e, **env})
        return out.stdout.strip().splitlines()[-1]

    assert run() == "BLAS 1 None"
    assert run(OPENBLAS_NUM_THREADS="3") == "BLAS 3 None"
    assert run(OMP_NUM_THREADS="2") == "BLAS None 2"
