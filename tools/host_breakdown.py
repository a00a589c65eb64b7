"""Where the host time of one eager `MoKExperts` forward + backward goes, per function.

    python -m tools.host_breakdown [--shape qwen3-30b-a3b] [--tokens 4096] [--steps 30]

Every Python function of mok's modules (and the classes they define), plus torch's tensor
factories, is wrapped with a timer: inclusive and exclusive microseconds per step and calls per
step (over both of `measure`'s loops), sorted by exclusive time. The wrappers add about half a microsecond a call, so the step's
unwrapped host time (measured first, as benchmarks.host_time does) is printed beside it.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections import defaultdict

import torch

from benchmarks.host_time import measure

_STATS: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # calls, incl, excl
_STACK: list[list[float]] = []
_WRAPPED: dict[int, object] = {}


def _timed(name: str, fn):
    clock = time.perf_counter

    def wrapper(*args, **kwargs):
        frame = [clock(), 0.0]
        _STACK.append(frame)
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = clock() - frame[0]
            _STACK.pop()
            if _STACK:
                _STACK[-1][1] += elapsed
            entry = _STATS[name]
            entry[0] += 1
            entry[1] += elapsed
            entry[2] += elapsed - frame[1]

    wrapper.__wrapped__ = fn
    return wrapper


def _wrap_function(fn, name: str):
    wrapped = _WRAPPED.get(id(fn))
    if wrapped is None:
        wrapped = _timed(name, fn)
        _WRAPPED[id(fn)] = wrapped
    return wrapped


def _modules():
    """mok's modules the measured step imported (a plain run comes first)."""
    return [m for name, m in list(sys.modules.items())
            if (name == "mok" or name.startswith("mok.")) and ".dsl_kernels" not in name]  # fmt: skip


def install() -> None:
    mods = _modules()
    for module in mods:
        for attr, value in list(vars(module).items()):
            if inspect.isfunction(value) and (value.__module__ or "").startswith("mok"):
                setattr(module, attr, _wrap_function(value, f"{value.__module__}.{value.__name__}"))
            elif inspect.isclass(value) and value.__module__ == module.__name__:
                for key, member in list(vars(value).items()):
                    label = f"{value.__module__}.{value.__name__}.{key}"
                    if isinstance(member, staticmethod):
                        setattr(value, key, staticmethod(_wrap_function(member.__func__, label)))
                    elif inspect.isfunction(member) and (
                        key == "__call__" or not key.startswith("__")
                    ):
                        setattr(value, key, _wrap_function(member, label))
    for attr in ("empty", "zeros", "full", "empty_like", "zeros_like", "tensor"):
        setattr(torch, attr, _wrap_function(getattr(torch, attr), f"torch.{attr}"))
    for attr in ("new_empty", "new_zeros", "view", "contiguous", "data_ptr", "unsqueeze"):
        setattr(torch.Tensor, attr, _wrap_function(getattr(torch.Tensor, attr), f"Tensor.{attr}"))


class _ClearAtStart:
    """`measure`'s profile hook: the counts start after its warm-up steps."""

    def enable(self) -> None:
        _STATS.clear()

    def disable(self) -> None:
        pass


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args(argv)
    plain = measure(args.shape, args.tokens, steps=args.steps)
    install()
    wrapped = measure(args.shape, args.tokens, steps=args.steps, profile=_ClearAtStart())
    steps = 2 * args.steps  # measure's two loops: GPU idle at each step, then back to back
    print(
        f"{args.shape} T={args.tokens}: host {plain['host_ms']:.3f} ms, GPU {plain['gpu_ms']:.3f}"
        f" ms unwrapped; host {wrapped['host_ms']:.3f} ms wrapped"
    )
    print(f"{'function':72s} {'calls':>6s} {'incl us':>9s} {'excl us':>9s}")
    rows = sorted(_STATS.items(), key=lambda kv: -kv[1][2])
    for name, (calls, incl, excl) in rows[: args.top]:
        print(f"{name[-72:]:72s} {calls / steps:6.1f} {incl / steps * 1e6:9.1f} "
              f"{excl / steps * 1e6:9.1f}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
