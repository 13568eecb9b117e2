"""A training process's state as checkpoint files, and back: model, optimizer, LR, RNG.

The checkpoint store deals in bytes (trainer/checkpoint.py); this module is the only one
that turns Paddle objects into those bytes. Paddle is imported inside the functions, so the
session module stays importable without it.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping
from typing import Any

MODEL = "model.pdparams"
OPTIMIZER = "optimizer.pdopt"
LR = "lr.pdstate"
RNG = "rng.pdstate"
SCALER = "scaler.pdstate"


def _positional(model: Any, state: dict[str, Any], to_positions: bool) -> dict[str, Any]:
    """Optimizer accumulators are keyed by parameter name (``linear_3.w_0_moment1_0``),
    and names come from a per-process counter; a checkpoint keys them by the parameter's
    position instead, so any process that builds the same model can load it."""
    names = [p.name for p in model.parameters()]
    positional = [f"@param{i}" for i in range(len(names))]
    src, dst = (names, positional) if to_positions else (positional, names)
    # Longest first: "linear_1.w_0" must not match a key of "linear_1.w_00".
    order = sorted(range(len(src)), key=lambda i: -len(src[i]))
    out: dict[str, Any] = {}
    for key, value in state.items():
        for i in order:
            if key.startswith(src[i] + "_"):
                key = dst[i] + key[len(src[i]) :]
                break
        out[key] = value
    return out


def state_files(model: Any, optimizer: Any, lr: Any, scaler: Any = None) -> dict[str, bytes]:
    """The files of a checkpoint of this process's training state."""
    import numpy as np
    import paddle

    def dump(obj: Any) -> bytes:
        buf = io.BytesIO()
        paddle.save(obj, buf)
        return buf.getvalue()

    files = {MODEL: dump(model.state_dict())}
    if optimizer is not None:
        files[OPTIMIZER] = dump(_positional(model, optimizer.state_dict(), to_positions=True))
    if lr is not None:
        files[LR] = dump(lr.state_dict())
    # A disabled scaler (AMP off, or on a CPU) has an empty state, which it cannot load.
    if scaler is not None and scaler.state_dict():
        files[SCALER] = dump(scaler.state_dict())
    # Paddle's generator (dropout), Python's and numpy's (the augmentations of a script).
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    files[RNG] = dump(
        {
            "paddle": paddle.get_rng_state(),
            "python": list(random.getstate()),
            "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, gauss],
        }
    )
    return files


def load_state(
    files: Mapping[str, bytes], model: Any, optimizer: Any, lr: Any, scaler: Any = None
) -> None:
    """Put a checkpoint's files back into the model, optimizer, LR scheduler, AMP scaler
    and RNGs."""
    import numpy as np
    import paddle

    model.set_state_dict(paddle.load(io.BytesIO(files[MODEL])))
    if optimizer is not None and OPTIMIZER in files:
        saved = paddle.load(io.BytesIO(files[OPTIMIZER]))
        optimizer.set_state_dict(_positional(model, saved, to_positions=False))
    if lr is not None and LR in files:
        lr.set_state_dict(paddle.load(io.BytesIO(files[LR])))
    if scaler is not None and SCALER in files:
        scaler.load_state_dict(paddle.load(io.BytesIO(files[SCALER])))
    if RNG in files:
        rng = paddle.load(io.BytesIO(files[RNG]), return_numpy=False)
        paddle.set_rng_state(rng["paddle"])
        random.setstate(_as_tuple(rng["python"]))
        if "numpy" in rng:
            kind, keys, *rest = rng["numpy"]
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


def _as_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_as_tuple(v) for v in value)
    return value
