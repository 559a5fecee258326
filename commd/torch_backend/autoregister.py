"""Register the "commd" backend with torch.distributed without importing torch.

``import commd`` must make ``dist.init_process_group("commd")`` work, but the
CLI and the daemon import ``commd`` too and must not pay for torch (about 2 s
of imports).  So ``register_when_torch_loads`` registers at once when
``torch.distributed`` is already loaded, and otherwise installs a finder on
``sys.meta_path`` that registers right after ``torch`` (and
``torch.distributed``) finish loading, whenever the user imports them.  This
works whatever the import order and whether torch's backend autoloading
(``TORCH_DEVICE_BACKEND_AUTOLOAD``) is on or off.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

#: Modules whose completed import may make torch.distributed usable.
_TRIGGERS = ("torch", "torch.distributed")

_lock = threading.Lock()


def _loaded(name: str, just_loaded: str | None) -> bool:
    """Whether module ``name`` is imported completely (``just_loaded`` has just finished executing)."""
    if name == just_loaded:
        return True
    module = sys.modules.get(name)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _register(just_loaded: str | None = None) -> bool:
    """Register now if torch.distributed is usable; True when done (or impossible to do later)."""
    if not _loaded("torch.distributed", just_loaded):
        return False
    if just_loaded is not None and not _loaded("torch", just_loaded):
        return False  # torch.distributed finished inside torch's own import: wait for torch
    try:
        from commd.torch_backend.registration import register_backend

        register_backend()
    except Exception as exc:  # a broken torch must not break the user's import of it
        warnings.warn(f"commd: could not register the torch.distributed backend 'commd': {exc!r}",
                      RuntimeWarning, stacklevel=2)
    return True


class _ThenRegister:
    """Runs the real loader, then registers the backend if torch is now usable.

    (The import system only needs ``create_module`` and ``exec_module``; importlib.abc
    is not imported for a base class, to keep ``import commd`` light.)"""

    def __init__(self, loader: Any, finder: _RegisterAfterTorch) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # torch's own code sees its real loader, as if this hook did not exist.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._finder.loaded(module.__name__)


class _RegisterAfterTorch:
    """A finder that finds nothing itself: it wraps the loaders of torch and torch.distributed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _TRIGGERS:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenRegister(spec.loader, self)
                return spec
        return None

    def loaded(self, name: str) -> None:
        with _lock:
            if self not in sys.meta_path:
                return
            if not _loaded("torch.distributed", name) or not _loaded("torch", name):
                return
            sys.meta_path.remove(self)
        _register(name)


def register_when_torch_loads() -> None:
    """Register the backend now if torch.distributed is loaded, else as soon as it is."""
    with _lock:
        if any(isinstance(f, _RegisterAfterTorch) for f in sys.meta_path):
            return
        if not _register():
            sys.meta_path.insert(0, _RegisterAfterTorch())
