"""Names that left a package's public API, kept importable for one release with a warning.

A package lists only what users need in ``__all__``; a name it drops stays reachable
through its module ``__getattr__`` (built here), which warns with a
:class:`DeprecationWarning` naming where the object lives now.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved_names(package: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """Returns a module ``__getattr__`` that resolves names dropped from ``package``.

    Args:
        package (str): The package's dotted name, for messages.
        moved (Mapping[str, str]): Dropped name -> ``"module.path:attribute"`` of the
            object now.

    Returns:
        callable: The ``__getattr__`` to assign in the package's ``__init__``.
    """

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, _, attribute = target.partition(":")
        warnings.warn(f"{package}.{name} is no longer part of the public API and goes in the "
                      f"next release; import it from {module_name} ({module_name}.{attribute})",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module_name), attribute)

    return __getattr__
