"""How a check compares a student's result with the textbook's, and what a failure says.

A failure (:class:`Failed`) names the case (what was called, with the shapes and dtypes of its
arrays), what differs (the shape, the dtype, or the first index that differs and the largest error)
and, when the student's result equals a known mistake's on that case, the mistake (the hint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class Failed(Exception):
    """A unit's result is wrong on one case.

    case: what was called (``causal_mask(seq=1, ctx=5, offset=4)``); message: what differs; hint: the
    known mistake the result matches, or None.
    """

    def __init__(self, case: str, message: str, hint: str | None = None):
        super().__init__(f"{case}: {message}" + (f" (hint: {hint})" if hint else ""))
        self.case, self.message, self.hint = case, message, hint


#: A known mistake: (the hint, a function computing the mistaken result of the failing case).
Mistake = tuple[str, Callable[[], object]]


def shown(value) -> str:
    """An argument as a case shows it: an array as ``[2, 5] float32``, other values by ``repr``."""
    if isinstance(value, np.ndarray):
        return f"[{', '.join(map(str, value.shape))}] {value.dtype}"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"{type(value).__name__} of {len(value)}"
    return repr(value)


def case(name: str, *args, **kwargs) -> str:
    """``name(arg, key=value)`` with each argument :func:`shown`."""
    parts = [shown(a) for a in args] + [f"{k}={shown(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def frozen(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Read-only copies: what a student's function is handed (writing into one raises ValueError)."""
    out = []
    for a in arrays:
        copy = np.array(a)
        copy.flags.writeable = False
        out.append(copy)
    return tuple(out)


def _same(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Elementwise agreement: equal (infinities included), or within ``atol + rtol * |want|``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (got == want) | np.isclose(got, want, atol=atol, rtol=rtol)


def _matches(got, wrong, atol: float, rtol: float) -> bool:
    try:
        got, wrong = np.asarray(got, dtype=np.float64), np.asarray(wrong, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    if got.shape != wrong.shape:
        return False
    with np.errstate(invalid="ignore", over="ignore"):  # NaN where the mistake gives NaN is a match
        return bool((_same(got, wrong, atol, rtol) | (np.isnan(got) & np.isnan(wrong))).all())


def hint_for(got, mistakes: Sequence[Mistake], atol: float = 1e-6, rtol: float = 1e-5) -> str | None:
    """The first known mistake whose result ``got`` equals, or None."""
    for hint, wrong in mistakes:
        try:
            value = wrong()
        except Exception:  # a mistake that cannot even run on this case is not the one
            continue
        if _matches(got, value, atol, rtol):
            return hint
    return None


def expect_array(
    where: str,
    got,
    want: np.ndarray,
    *,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    mistakes: Sequence[Mistake] = (),
    what: str = "the result",
) -> None:
    """Raise :class:`Failed` unless ``got`` is an array of ``want``'s shape and dtype, every element
    equal or within ``atol + rtol * |want|`` (-inf must be -inf).

    The message gives the first index that differs, both values there, and the largest error."""
    if not isinstance(got, np.ndarray):
        raise Failed(where, f"{what} is a {type(got).__name__}, expected a NumPy array {shown(want)}")
    if got.shape != want.shape:
        raise Failed(where, f"{what} has shape {list(got.shape)}, expected {list(want.shape)}", hint_for(got, mistakes))
    if got.dtype != want.dtype:
        raise Failed(where, f"{what} has dtype {got.dtype}, expected {want.dtype} (cast with .astype(np.{want.dtype}))")
    same = _same(got, want, atol, rtol)
    if same.all():
        return
    first = tuple(int(i) for i in np.argwhere(~same)[0])
    with np.errstate(invalid="ignore", over="ignore"):
        errors = np.abs(got.astype(np.float64) - want.astype(np.float64))
    errors = np.where(same, 0.0, np.nan_to_num(errors, nan=np.inf))
    message = (
        f"{what} differs first at index {list(first)}: {got[first]!r} where the textbook gives {want[first]!r}; "
        f"{int((~same).sum())} of {same.size} elements differ, the largest error is {float(errors.max()):.3g}"
    )
    raise Failed(where, message, hint_for(got, mistakes, atol, rtol))


def expect_equal(where: str, got, want, *, mistakes: Sequence[Mistake] = (), what: str = "the result") -> None:
    """Raise :class:`Failed` unless ``got == want`` (numbers, text, bytes, lists of them)."""
    if isinstance(want, float):
        ok = isinstance(got, (int, float, np.floating, np.integer)) and abs(float(got) - want) <= 1e-9 + 1e-7 * abs(
            want
        )
    else:
        ok = (
            type(got) is type(want) and got == want
            if not isinstance(want, int)
            else (isinstance(got, (int, np.integer)) and not isinstance(got, bool) and int(got) == want)
        )
    if not ok:
        hint = None
        for text, wrong in mistakes:
            try:
                if wrong() == got:
                    hint = text
                    break
            except Exception:
                continue
        raise Failed(where, f"{what} is {got!r}, the textbook gives {want!r}", hint)
