"""Numeric assertions that record how close they came to failing.

Every comparison of the suite against a tolerance goes through here: `assert_close` (torch's,
same arguments), `approx` (pytest's, same arguments) and `check` (a measured error against its
tolerance, for the helpers that compute their own error, e.g. a relative norm). Each records
the comparison's *use* of its tolerance, the measured error over the error allowed (1.0 fails),
and `pytest_terminal_summary` in tests/conftest.py lists every comparison that used more than
half of its tolerance on the machine that ran it. A tolerance that holds only with the margin
one CPU gives shows there before it fails on another CPU.

Comparisons inside spawned gloo ranks (tests/distributed.py) are recorded there and handed
back to the test that made the call with its results.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import pytest
import torch

# A comparison above this share of its tolerance is listed in the suite's summary.
NEAR = 0.5

# The override of every whole training run whose final parameters are compared with another
# layout's (losses, means over every token, need none): AdamW's eps raised from 1e-8. AdamW
# divides each element's update by its own gradient scale, and on these tiny models many
# gradient elements are ~1e-4 or smaller (embedding rows of tokens seen once): there
# m / (sqrt(v) + eps) turns fp32 summation-order noise, which differs between layouts and
# between CPUs, into update differences of 1e-5 and more (a pipeline run's embedding was
# 1.24e-5 off on one CPU and 0.96e-5 on another, against 1e-5). At 1e-3 those elements stay in
# AdamW's linear regime, so the comparison checks the data flow, not AdamW's conditioning: a
# wrong m or v shard still moves elements by ~1e-2 of their update.
WELL_CONDITIONED = ("optim.eps=1e-3",)


@dataclass(frozen=True)
class Comparison:
    test: str      # the pytest node id ("?" outside a test)
    what: str      # what was compared: the caller's message, or the call site
    error: float   # the measured error, in the tolerance's units
    allowed: float  # the tolerance it was held to

    @property
    def used(self) -> float:
        """The share of the tolerance the error used: 1.0 or more fails."""
        if self.allowed > 0:
            return self.error / self.allowed
        return 0.0 if self.error == 0 else math.inf


# This process's comparisons since the last `take()`.
_RECORDS: list[Comparison] = []


def current_test() -> str:
    """The running test's node id, as pytest sets it for the process that runs the test."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def _call_site() -> str:
    import inspect

    for frame in inspect.stack()[2:]:
        if os.path.basename(frame.filename) != "closeness.py":
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


def record(what: str, error: float, allowed: float, test: Optional[str] = None) -> Comparison:
    comparison = Comparison(test or current_test(), what, float(error), float(allowed))
    _RECORDS.append(comparison)
    return comparison


def take() -> list[Comparison]:
    """This process's records so far, handed over and forgotten (for tests/distributed.py)."""
    taken = list(_RECORDS)
    _RECORDS.clear()
    return taken


def adopt(comparisons: Iterable[Comparison]) -> None:
    """Records made elsewhere (a spawned rank) for the running test."""
    test = current_test()
    _RECORDS.extend(Comparison(test, c.what, c.error, c.allowed) for c in comparisons)


def check(what: str, error: float, allowed: float) -> None:
    """Assert `error <= allowed`, recording the comparison. NaN fails."""
    record(what, error, allowed)
    assert error <= allowed, f"{what}: {error:.4g} exceeds the tolerance {allowed:.4g}"


def relative_error(actual: Any, expected: Any) -> float:
    """|actual - expected| / |expected| for numbers, the same with norms for tensors."""
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        a = torch.as_tensor(actual, dtype=torch.float64)
        e = torch.as_tensor(expected, dtype=torch.float64)
        scale = e.norm().item()
        diff = (a - e).norm().item()
    else:
        scale, diff = abs(expected), abs(actual - expected)
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / scale


def check_relative(what: str, actual: Any, expected: Any, rel: float) -> None:
    """Assert |actual - expected| <= rel |expected| (norms for tensors), recording it."""
    error = relative_error(actual, expected)
    record(what, error, rel)
    assert error <= rel, f"{what}: {actual} vs {expected}: relative error {error:.4g} exceeds {rel:.4g}"


def _default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    # torch.testing.assert_close's defaults by dtype, for the record (it applies its own).
    return {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
            torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5)}.get(dtype, (0.0, 0.0))


def _tensor_pairs(actual: Any, expected: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(actual, dict) and isinstance(expected, dict):
        return [pair for key in expected if key in actual for pair in _tensor_pairs(actual[key], expected[key])]
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return [pair for a, e in zip(actual, expected) for pair in _tensor_pairs(a, e)]
    try:
        return [(torch.as_tensor(actual), torch.as_tensor(expected))]
    except (TypeError, ValueError, RuntimeError):
        return []


def _use_of(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[float, float]:
    """(largest |a - e| - atol - rtol |e| over elements, taken as the error against the
    allowed atol + rtol |e| of that element): returned as (error, allowed) of the element that
    used most of its tolerance."""
    if actual.shape != expected.shape or actual.numel() == 0:
        return 0.0, 1.0
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    diff = (a - e).abs()
    equal = (a == e) | (a.isnan() & e.isnan())
    diff = torch.where(equal, torch.zeros_like(diff), diff)
    allowed = atol + rtol * e.abs()
    if (allowed == 0).all():
        return float(diff.max()), 0.0
    use = torch.where(allowed > 0, diff / allowed.clamp_min(1e-300), torch.where(diff > 0, math.inf, 0.0))
    i = int(use.reshape(-1).argmax())
    return float(diff.reshape(-1)[i]), float(allowed.reshape(-1)[i])


def assert_close(actual: Any, expected: Any, *, rtol: Optional[float] = None, atol: Optional[float] = None,
                 msg: Any = None, **kwargs: Any) -> None:
    """torch.testing.assert_close, recording how much of its tolerance the worst element used."""
    what = msg if isinstance(msg, str) else _call_site()
    for a, e in _tensor_pairs(actual, expected):
        r, t = (rtol, atol) if rtol is not None else _default_tolerances(e.dtype if e.is_floating_point() else a.dtype)
        if e.is_floating_point() or a.is_floating_point():
            error, allowed = _use_of(a, e, r, t)
            record(what, error, allowed)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg, **kwargs)


class _RecordingApprox:
    """pytest.approx(expected, ...) whose == records the comparison before answering."""

    def __init__(self, expected: Any, rel: Optional[float], abs_: Optional[float], what: str) -> None:
        self.inner = pytest.approx(expected, rel=rel, abs=abs_)
        self.expected, self.rel, self.abs, self.what = expected, rel, abs_, what

    def _scalars(self, actual: Any) -> list[tuple[float, float]]:
        expected = self.expected
        if isinstance(expected, dict) and isinstance(actual, dict):
            pairs = [(actual[k], expected[k]) for k in expected if k in actual]
        elif isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
            pairs = list(zip(actual, expected))
        else:
            pairs = [(actual, expected)]
        return [(a, e) for a, e in pairs if isinstance(a, (int, float)) and isinstance(e, (int, float))]

    def __eq__(self, actual: Any) -> bool:
        worst: Optional[tuple[float, float]] = None
        for a, e in self._scalars(actual):
            allowed = pytest.approx(e, rel=self.rel, abs=self.abs).tolerance
            error = 0.0 if a == e else abs(a - e)
            use = error / allowed if allowed > 0 else (0.0 if error == 0 else math.inf)
            if worst is None or use > (worst[0] / worst[1] if worst[1] > 0 else math.inf):
                worst = (error, allowed)
        if worst is not None:
            record(self.what, *worst)
        return self.inner == actual

    def __ne__(self, actual: Any) -> bool:
        return not self.__eq__(actual)

    def __repr__(self) -> str:
        return repr(self.inner)

    __hash__ = None  # type: ignore[assignment]


def approx(expected: Any, rel: Optional[float] = None, abs: Optional[float] = None) -> Any:  # noqa: A002
    """pytest.approx, recording the comparison when it is made."""
    return _RecordingApprox(expected, rel, abs, _call_site())


def near_tolerance(comparisons: Iterable[Comparison], near: float = NEAR) -> list[Comparison]:
    """The comparisons that passed using more than `near` of their tolerance, worst first. One
    that failed is its test's failure, or a failure the test expected (pytest.raises)."""
    return sorted((c for c in comparisons if near < c.used <= 1), key=lambda c: -c.used)
