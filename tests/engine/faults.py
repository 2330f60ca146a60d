"""Fault injection shared by the engine's failure tests (imported by module name: pytest puts
this folder on the import path)."""

from __future__ import annotations


class Boom(RuntimeError):
    """The error the tests inject."""


def fail_on_call(n: int, exc: BaseException):
    """A wrapper factory: the n-th call (1-based) raises ``exc``, the others pass through."""
    calls = [0]

    def wrap(fn):
        def inner(*a, **k):
            calls[0] += 1
            if calls[0] == n:
                raise exc
            return fn(*a, **k)

        return inner

    return wrap
