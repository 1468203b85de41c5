"""Griffe extension for the API reference: ``GpuCommandBatch``'s elementwise ops are class attributes built
by ``_unary("exp")`` / ``_binary("add")`` (batchgpu/batch.py), so static analysis sees assignments without
docstrings. Each becomes a method in the reference with the signature and docstring it has at runtime."""

from __future__ import annotations

import inspect
from typing import Any

import griffe

FACTORIES = ("_unary(", "_binary(")


class RecordedOps(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.path != "batchgpu.batch.GpuCommandBatch":
            return
        import batchgpu

        for name, member in list(cls.members.items()):
            if not isinstance(member, griffe.Attribute) or not str(member.value).startswith(FACTORIES):
                continue
            method = getattr(batchgpu.GpuCommandBatch, name)
            parameters = [
                griffe.Parameter(
                    p.name,
                    annotation=None if p.annotation is p.empty else str(p.annotation),
                    kind=griffe.ParameterKind(p.kind.description),
                    default=None if p.default is p.empty else repr(p.default),
                )
                for p in inspect.signature(method).parameters.values()
            ]
            function = griffe.Function(
                name,
                lineno=member.lineno,
                endlineno=member.endlineno,
                parameters=griffe.Parameters(*parameters),
                returns="Tensor",
                docstring=griffe.Docstring(inspect.cleandoc(method.__doc__ or ""), lineno=member.lineno),
            )
            cls.set_member(name, function)
