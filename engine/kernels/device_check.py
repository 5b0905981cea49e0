"""A CUDA kernel used only where its switch allows it and it gave its reference's output on this
device, per dtype."""

from __future__ import annotations

import logging
from typing import Any, Callable

import mlx.core as mx

log = logging.getLogger(__name__)


class CheckedPerDtype:
    """`passed(dtype)`: whether the kernel may run on activations of `dtype`. The first ask for a
    dtype runs `check(dtype)` on this device (a dict with `kept`, and `error` or `rel_diff`); a
    kernel that does not compile or run, or that differs from its reference, is not used, and
    the log says so after `falls_back` (what runs instead). `mode()`: the kernel's switch, as
    `switch()` reads it, once. Both are kept for the process; `reset()` forgets them (tests)."""

    def __init__(self, check: Callable[[mx.Dtype], dict[str, Any]], falls_back: str,
                 switch: Callable[[], str]):
        self._check, self._falls_back, self._switch = check, falls_back, switch
        self._kept: dict[mx.Dtype, bool] = {}
        self._mode: str | None = None

    def mode(self) -> str:
        if self._mode is None:
            self._mode = self._switch()
        return self._mode

    def passed(self, dtype: mx.Dtype) -> bool:
        if dtype not in self._kept:
            result = self._check(dtype)
            self._kept[dtype] = result["kept"]
            if not result["kept"]:
                log.warning("%s: its kernel %s", self._falls_back,
                            f"failed ({result['error']})" if "error" in result else
                            f"parts from its reference by {result['rel_diff']:.3g}")
        return self._kept[dtype]

    def reset(self) -> None:
        self._kept.clear()
        self._mode = None
