"""A mypy plugin: a task call accepts an upstream's XComArg for any argument, as Airflow does.

Airflow's `@task` gives the call the task function's own signature (`Task.__call__: Callable[FParams, XComArg]`),
so a task function typed with its payloads (include/dflash_regen/payloads.py) could not be called with the XComArg
that becomes that payload at run time. This widens each parameter of the call to "its type or an XComArg", a list's
items too (Airflow resolves the XComArgs in a list argument); the function's body is still checked against the
payload types, and a wrong literal argument is still an error.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.plugin import MethodSigContext, Plugin
from mypy.types import CallableType, Instance, Type, UnionType, get_proper_type

CONTAINERS = {"builtins.list", "typing.Sequence"}  # Airflow resolves the XComArgs in a list argument
TASK_CALLS = {"airflow.sdk.bases.decorator.Task.__call__", "airflow.sdk.bases.decorator._TaskDecorator.__call__"}


def _or_xcomarg(param: Type, xcomarg: Type) -> Type:
    proper = get_proper_type(param)
    if isinstance(proper, Instance) and proper.type.fullname in CONTAINERS and proper.args:
        param = proper.copy_modified(args=[_or_xcomarg(proper.args[0], xcomarg)])
    return UnionType.make_union([param, xcomarg])


def _admit_xcomarg(ctx: MethodSigContext) -> CallableType:
    call = ctx.default_signature
    xcomarg = call.ret_type  # a task call returns its XComArg
    return call.copy_modified(arg_types=[_or_xcomarg(t, xcomarg) for t in call.arg_types])


class TaskflowPlugin(Plugin):
    def get_method_signature_hook(self, fullname: str) -> Callable[[MethodSigContext], CallableType] | None:
        return _admit_xcomarg if fullname in TASK_CALLS else None


def plugin(version: str) -> type[Plugin]:
    return TaskflowPlugin
