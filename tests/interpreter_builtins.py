"""Triton's CPU interpreter, with each module's list of builtins made once instead of on every
call.

Under TRITON_INTERPRET=1, every kernel launch, and every call of a @triton.jit helper from
inside a kernel (once per program), swaps triton.language's builtins for interpreted ones.
To find them, `_patch_builtin` lists the whole module with `inspect.getmembers` (a dir(), a
getattr of every member, a sort) and keeps the builtins. A module's builtins never change, so
the listing is the same every time; it was a quarter to a third of the CPU time of the
interpreted engine runs in tests/test_deterministic.py (2026-12-07, this 2-core VM).

`list_builtins_once()` keeps the names of each module's builtins from its first listing and
patches what `getattr` finds under those names, with the same `is_builtin` test: the same
patches as before, in the same order (getmembers sorts by name; so does the kept list). A
launch swaps all of a module's builtins and restores all of them, so one swapped builtin
means the listing would find none.

Nothing changes where the interpreter is off or where its internals are not the ones this
was written against (triton 3.x's `_patch_builtin(pkg, builder, scope)` and `_patch_attr`).
"""

from __future__ import annotations

import inspect
import os


def list_builtins_once() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or getattr(original, "lists_once", False):
        return
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return
    is_builtin = tl.core.is_builtin
    names: dict[int, tuple[object, list[str]]] = {}  # id(pkg) -> (pkg, kept alive so the id stays its own)

    def _patch_builtin(pkg, builder, scope) -> None:
        kept = names.get(id(pkg))
        if kept is None or kept[0] is not pkg:
            kept = names[id(pkg)] = (pkg, [name for name, member in inspect.getmembers(pkg) if is_builtin(member)])
        # Inside a kernel (a helper's call) the launch has swapped every one of them already, and
        # the listing would find none: skip as soon as the first is seen swapped.
        if kept[1] and not is_builtin(getattr(pkg, kept[1][0])):
            return
        for name in kept[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.lists_once = True  # type: ignore[attr-defined]
    interpreter._patch_builtin = _patch_builtin
