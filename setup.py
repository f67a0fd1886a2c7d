"""Install-time build of the compiled CPU kernels (everything else is in pyproject.toml).

`pip install` compiles the numba kernels of the default backend ahead of time (kvmap/aot.py, numba.pycc) into
extension modules beside their sources (aot.KERNEL_MODULES: the CPU worker's, the KV cache's, the forward
parts', the KV occupancy's), so no run imports numba or loads its JIT (docs/performance.md, "Start-up"). It is
optional: if it fails (no C compiler, numba too old or too new for this Python), the install goes on without it
and numba's JIT compiles the kernels on first use, as before.
`KVMAP_NO_AOT=1` skips it; `python -m kvmap.aot` rebuilds the modules in place after a kernel is edited (until
then a stale module is detected and not used).

An editable install (`pip install -e .`) also compiles kvmap's Python files to bytecode, as pip does for a
regular install: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) Python would otherwise
compile every kvmap module from source on every run. Python still checks each .pyc against its source, so an
edited file is never run stale.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kvmap.aot import KERNEL_MODULES, twin_name  # noqa: E402 - kvmap.aot imports only the standard library

sys.path.pop(0)
MODULES = {twin_name(m): m for m in KERNEL_MODULES}  # extension -> the kernel module it is compiled from


class BuildKernels(build_ext):
    """Each extension is built by kvmap.aot.build from its kernel module; a failure is a warning. In place (an
    editable install), the package's bytecode is compiled too."""

    def run(self) -> None:
        super().run()
        if self.inplace or self.editable_mode:
            import compileall

            compileall.compile_dir(os.path.join(HERE, "kvmap"), quiet=1)

    def build_extension(self, ext: Extension) -> None:
        if os.environ.get("KVMAP_NO_AOT"):
            self.announce("kvmap: KVMAP_NO_AOT is set, the kernels will be compiled by numba's JIT", 2)
            return
        target = self.get_ext_fullpath(ext.name)
        sys.path.insert(0, HERE)
        try:
            from kvmap import aot

            built = aot.build(MODULES[ext.name], os.path.dirname(target))
            if os.path.abspath(built) != os.path.abspath(target):
                os.replace(built, target)
        except Exception as e:  # noqa: BLE001 - any failure leaves the JIT path, which is complete
            print(f"kvmap: the ahead-of-time kernels ({ext.name}) were not built ({type(e).__name__}: {e}); "
                  "numba's JIT will compile them on first use", file=sys.stderr)
        finally:
            sys.path.pop(0)
            for name in [m for m in sys.modules if m == "kvmap" or m.startswith("kvmap.")]:
                del sys.modules[name]  # the build imported kvmap from the source tree: forget it


class BuildWithTraces(build_py):
    """The bundled traces/ (traces, workload files, README) shipped inside the package as kvmap/traces, where
    kvmap/files.py `bundled_traces_dir` finds them when no source checkout is beside kvmap (`pip install .`). An
    editable install reads the checkout's traces/ itself."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        source = os.path.join(HERE, "traces")
        target = os.path.join(self.build_lib, "kvmap", "traces")
        for folder, _, files in os.walk(source):
            for name in files:
                if name.endswith((".jsonl", ".jsonl.gz", ".yaml", ".md")):
                    path = os.path.join(folder, name)
                    out = os.path.join(target, os.path.relpath(path, source))
                    self.mkpath(os.path.dirname(out))
                    self.copy_file(path, out)


setup(
    ext_modules=[Extension(name, sources=[], optional=True) for name in MODULES],  # optional: may be absent
    cmdclass={"build_ext": BuildKernels, "build_py": BuildWithTraces},
)
