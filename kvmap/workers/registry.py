"""The registry of backends: names to lazy creators, plus user backends from entry points or `module:Class`.

Rules:
- Each built-in backend is a (module, class) pair imported only when asked for, so `kvmap --help` and
  `kvmap validate` import neither torch nor numba; a creator's import error becomes one clear message.
- User backends: `--backend package.module:Class` or `--backend path/to/file.py:Class`, or a name registered
  under the `kvmap.backends` entry-point group (`name = "package.module:Class"`). The class must subclass
  `kvmap.workers.contract.Worker`; it is constructed as `Class(header, device)`.
- Device rules (host backends on `--device cpu` only; Triton on CPU tensors needs TRITON_INTERPRET=1) live
  here, once.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from kvmap.errors import KvmapError

if TYPE_CHECKING:  # the registry is imported for --help: it imports no numpy, torch or numba
    from kvmap.trace import TraceHeader

ENTRY_POINT_GROUP = "kvmap.backends"


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    target: str  # "module:Class"
    summary: str
    device_backend: bool = False  # runs on a torch device (cpu or cuda); host backends run on the host only
    needs: str | None = None  # pip package that the import needs, for the error message
    optional: bool = False  # runs an installed vLLM's own code: only when named (never in the default deep check)


BUILTIN: dict[str, Backend] = {b.name: b for b in (
    Backend("numba", "kvmap.workers.numba_worker:NumbaWorker", "compiled host kernels (the default)", needs="numba"),
    Backend("numpy", "kvmap.workers.host:NumpyWorker", "vectorized numpy, needs nothing more"),
    Backend("reference", "kvmap.workers.reference:ReferenceWorker", "plain Python, one token at a time: the oracle"),
    Backend("torch", "kvmap.workers.torch_worker:TorchWorker", "state on a torch device, tensor ops",
            device_backend=True, needs="torch"),
    Backend("triton", "kvmap.workers.triton_worker:TritonWorker", "the torch worker with Triton kernels",
            device_backend=True, needs="triton"),
    Backend("vllm-mrv2", "kvmap.workers.vllm_mrv2:VllmMRV2Worker", "vLLM's own Model Runner V2 code (needs vLLM)",
            device_backend=True, optional=True),
    Backend("vllm-v1", "kvmap.workers.vllm_v1:VllmV1Worker", "vLLM's own V1 runner code (needs vLLM)",
            device_backend=True, optional=True),
)}
BACKENDS = tuple(b.name for b in BUILTIN.values() if not b.optional)  # the listed and checked ones, in order
OPTIONAL_BACKENDS = tuple(b.name for b in BUILTIN.values() if b.optional)  # run an installed vLLM: named only


def default_backend() -> str:
    """The compiled host worker when its kernels can load (built at install, or numba to compile them), else
    vectorized numpy (imports neither numba nor the kernels)."""
    from kvmap.aot import available

    return "numba" if available() else "numpy"


def entry_point_backends() -> dict[str, str]:
    """User backends registered by installed packages: name -> "module:Class"."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load_class(target: str):
    """Import "module:Class" or "path/to/file.py:Class"."""
    mod_name, sep, cls_name = target.rpartition(":")
    if not sep or not mod_name or not cls_name:
        raise KvmapError(f"unknown backend {target!r}; choose one of {', '.join(BUILTIN)}, or give "
                         "module:Class", field="--backend")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise KvmapError(f"no such file {mod_name!r}", field="--backend")
            name = f"kvmap_user_backend_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except KvmapError:
        raise
    except Exception as e:  # a user module may fail in any way: say which and how, in one line
        raise KvmapError(f"cannot import {mod_name!r} ({type(e).__name__}: {e})", field="--backend") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise KvmapError(f"{mod_name!r} has no attribute {cls_name!r}", field="--backend")
    return cls


def resolve(backend: str) -> tuple[Backend | None, type]:
    """A backend name or target -> (built-in entry or None, worker class). Imports the class."""
    from kvmap.workers.contract import Worker

    entry = BUILTIN.get(backend)
    if entry is not None:
        try:
            cls = _load_class(entry.target)
        except KvmapError as e:
            hint = f"; pip install {entry.needs}" if entry.needs else ""
            raise KvmapError(f"the {backend} backend cannot load: {e.message}{hint}"
                             + ("; --backend numpy needs nothing" if backend == "numba" else ""),
                             field="--backend") from None
        return entry, cls
    target = entry_point_backends().get(backend, backend)
    cls = _load_class(target)
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise KvmapError(f"{target!r} is not a subclass of kvmap.workers.contract.Worker", field="--backend")
    return None, cls


def make_worker(backend: str | None, header: TraceHeader, device: str = "cpu", batch_order: str = "mrv2",
                reorder_batch_threshold: int | None = None):
    """Create the named backend's worker for `header` on `device` (None: the default backend), with the batch
    order of Model Runner V2 (`mrv2`) or V1's persistent batch (`v1`)."""
    backend = backend or default_backend()
    entry = BUILTIN.get(backend)
    if device != "cpu" and entry is not None and not entry.device_backend:
        raise KvmapError(f"--device {device} needs --backend torch or triton (the {backend} worker runs on the "
                         "host)", field="--device")
    if backend == "triton" and device == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        raise KvmapError("the triton backend on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                         "(set before kvmap starts; about 2 ms a kernel program)", field="--backend")
    _, cls = resolve(backend)
    worker = cls(header, device)
    if batch_order != "mrv2" or reorder_batch_threshold is not None:
        if batch_order == "mrv2":
            raise KvmapError("--reorder-threshold applies to --runner v1", field="--reorder-threshold")
        worker.use_batch_order(batch_order, reorder_batch_threshold)  # an unknown order names --batch-order
    return worker


def describe() -> list[tuple[str, str]]:
    """(name, summary) of every backend this installation knows, built-in first."""
    return [(b.name, b.summary) for b in BUILTIN.values()] + [
        (name, target) for name, target in entry_point_backends().items()]
