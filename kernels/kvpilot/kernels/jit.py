"""`triton.jit`, typed for how kernels launch: `kernel[grid](*args, BLOCK=..., num_warps=...)`.

Triton's hints make `kernel[grid]` the decorated function itself, so to a type checker a
launch option (`num_warps`, `num_stages`) is an unknown parameter, and a plain int passed
to a `tl.constexpr` parameter has the wrong type, though Triton takes both. The kernels
here use this `jit`: at run time it is `triton.jit` with the same options, only its type
differs, and a launch's arguments are checked by Triton when it binds them, not statically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast, overload

import triton


class Kernel(Protocol):
    """A jitted function: launched as `kernel[grid](...)`, or called from another kernel."""

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ...


@overload
def jit(fn: Callable[..., Any], /) -> Kernel:
    ...


@overload
def jit(*, do_not_specialize: Iterable[str] = ...,
        do_not_specialize_on_alignment: Iterable[str] = ...,
        ) -> Callable[[Callable[..., Any]], Kernel]:
    ...


def jit(fn: Callable[..., Any] | None = None, /,
        **options: Any) -> Kernel | Callable[[Callable[..., Any]], Kernel]:
    """Gives `triton.jit(fn, **options)`, or the decorator applying it when `fn` is omitted."""
    if fn is None:
        return lambda kernel: cast(Kernel, triton.jit(kernel, **options))
    return cast(Kernel, triton.jit(fn, **options))
