"""Emitter registries: IR op type -> function that writes its Triton lines.

Code generators look emitters up by the op's type (never a chain of ifs on variant names), so a
new op is one registered function.
"""
from __future__ import annotations

from typing import Callable

from ..errors import CompileError


class EmitterRegistry:
    def __init__(self, what: str):
        self._what = what
        self._emitters: dict[type, Callable] = {}

    def register(self, op_type: type) -> Callable:
        def decorate(fn: Callable) -> Callable:
            if op_type in self._emitters:
                raise ValueError(f"{self._what}: {op_type.__name__} already has an emitter")
            self._emitters[op_type] = fn
            return fn

        return decorate

    def emit(self, op, *args, **kwargs):
        emitter = self._emitters.get(type(op))
        if emitter is None:
            raise CompileError(f"{self._what}: no emitter for IR op {type(op).__name__}")
        return emitter(op, *args, **kwargs)
