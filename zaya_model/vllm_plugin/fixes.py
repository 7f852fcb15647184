"""Which of vLLM's functions are this plugin's fixed versions, so each per-process fix replaces them only once."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

_Function = TypeVar("_Function", bound=Callable[..., Any])
_fixed: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def mark_fixed(function: _Function) -> _Function:
    """Record `function` as a fixed version; returns it."""
    _fixed.add(function)
    return function


def is_fixed(function: object) -> bool:
    return function in _fixed
