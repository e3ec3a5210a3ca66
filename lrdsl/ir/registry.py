"""Functions looked up by the type of an IR object: Triton emitters per op, adjoint rules per
chunk op, verifiers per IR stage. A new op or stage is one registered function, never a chain of
ifs; a missing entry is a one-line lrdsl error, not a KeyError from deep inside."""
from __future__ import annotations

from typing import Callable

from ..errors import LrdslError


class TypeRegistry:
    def __init__(self, what: str, error: type[LrdslError] = LrdslError):
        self._what = what  # "chunk kernel emitter", "adjoint rule", ...: names a missing entry
        self._error = error
        self._functions: dict[type, Callable] = {}

    def register(self, ir_type: type) -> Callable:
        def decorate(fn: Callable) -> Callable:
            if ir_type in self._functions:
                raise ValueError(f"a second {self._what} for {ir_type.__name__}")
            self._functions[ir_type] = fn
            return fn

        return decorate

    def lookup(self, ir) -> Callable:
        function = self._functions.get(type(ir))
        if function is None:
            raise self._error(f"no {self._what} for {type(ir).__name__}")
        return function
