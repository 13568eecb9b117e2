"""A training process's state as checkpoint files, and back: model, optimizer, LR, RNG.

The checkpoint store deals in bytes (tide/trainer/checkpoint.py); this module is the only one
that turns Paddle objects into those bytes. Paddle is imported inside the functions, so the
session module stays importable without it.
"""

from __future__ import annotations

import io
import pickle
import random
from collections.abc import Mapping
from typing import Any

from tide.trainer import rawstate
from tide.trainer.rawstate import TENSORS, StateFiles

MODEL = "model.pdparams"
OPTIMIZER = "optimizer.pdopt"
LR = "lr.pdstate"
RNG = "rng.pdstate"
SCALER = "scaler.pdstate"
# The handover's form (state_files(raw=True)): every plain tensor of the model and the
# optimizer as an array (tide/trainer/rawstate.py; one file, state.tensors, where it is written),
# and the optimizer's other entries (its LR scheduler's state, AMP master weights) as a
# Paddle file beside it.
OPTIMIZER_REST = "optimizer-rest.pdopt"
# The RNGs in the handover's form: plain pickle (Paddle's walks every int of the Python and
# numpy generators' states: 10 ms of a 13 ms handover here).
RNG_RAW = "rng.pickle"
_MODEL_PREFIX = "model/"
_OPT_PREFIX = "opt/"
# Tensors of these dtypes go raw; any other (bfloat16, whose numpy form is ambiguous) goes
# through Paddle's own serialisation.
_RAW_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
)


def positional(model: Any, state: dict[str, Any], to_positions: bool) -> dict[str, Any]:
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


def layers(model: Any) -> Any:
    """The model whose state a checkpoint keeps: fleet's model wrappers (``ShardingParallel``)
    prefix every key with ``_layers.``, and a job resized to one rank runs unwrapped (fleet
    has no layout for one process), so its checkpoints are the wrapped layers'.
    ``paddle.DataParallel`` already gives its layers' keys."""
    inner = getattr(model, "_layers", None)
    if inner is None or type(model).__module__.split(".")[:4] != [
        "paddle",
        "distributed",
        "fleet",
        "meta_parallel",
    ]:
        return model
    return inner


def _dump(obj: Any) -> bytes:
    import paddle

    buf = io.BytesIO()
    paddle.save(obj, buf)
    return buf.getvalue()


def raw_array(value: Any) -> Any:
    """``value``'s array when it can travel as plain bytes, else None: a view of the
    tensor's own memory (DLPack; of its detached alias, which a parameter that requires
    gradients needs), not a copy; the state is read while every rank holds."""
    import numpy as np
    import paddle

    if not isinstance(value, paddle.Tensor):
        return None
    if str(value.dtype).removeprefix("paddle.") not in _RAW_DTYPES:
        return None
    try:
        return np.from_dlpack(value.detach())
    except (BufferError, TypeError, RuntimeError):
        # A tensor DLPack cannot export (a device this numpy cannot see): a copy.
        return np.ascontiguousarray(value.numpy())


def live_arrays(model: Any, optimizer: Any) -> dict[str, Any]:
    """The raw form's arrays of this process's model and optimizer as they are now: views of
    their memory, where a transfer can write the state straight in (an optimizer that has
    not stepped yet has no accumulators: those are missing)."""
    out: dict[str, Any] = {}
    if model is None:
        return out
    for key, value in layers(model).state_dict().items():
        array = raw_array(value)
        if array is not None:
            out[_MODEL_PREFIX + key] = array
    if optimizer is not None:
        state = positional(model, optimizer.state_dict(), to_positions=True)
        for key, value in state.items():
            array = raw_array(value)
            if array is not None:
                out[_OPT_PREFIX + key] = array
    return out


def state_files(
    model: Any, optimizer: Any, lr: Any, scaler: Any = None, raw: bool = False
) -> dict[str, bytes]:
    """The files of a checkpoint of this process's training state. ``raw``: a
    :class:`~tide.trainer.rawstate.StateFiles` whose ``arrays`` are the model's and the
    optimizer's tensors, as views of their memory (copied only where they go: the handover's
    shared memory, a peer, a durable file as :data:`TENSORS`), not pickled by Paddle: the
    handover's form. Periodic durable checkpoints keep Paddle's own files
    (:func:`checkpoint_files` turns the raw form into them)."""
    import numpy as np
    import paddle

    files: dict[str, bytes] = {}
    model_state = layers(model).state_dict()
    opt_state = (
        positional(model, optimizer.state_dict(), to_positions=True)
        if optimizer is not None
        else None
    )
    if raw:
        arrays: dict[str, Any] = {}
        model_rest: dict[str, Any] = {}
        for key, value in model_state.items():
            array = raw_array(value)
            if array is None:
                model_rest[key] = value
            else:
                arrays[_MODEL_PREFIX + key] = array
        opt_rest: dict[str, Any] = {}
        for key, value in (opt_state or {}).items():
            array = raw_array(value)
            if array is None:
                opt_rest[key] = value
            else:
                arrays[_OPT_PREFIX + key] = array
        files = StateFiles(arrays=arrays)
        if model_rest:
            files[MODEL] = _dump(model_rest)
        if opt_rest:
            files[OPTIMIZER_REST] = _dump(opt_rest)
    else:
        files[MODEL] = _dump(model_state)
        if opt_state is not None:
            files[OPTIMIZER] = _dump(opt_state)
    if lr is not None:
        files[LR] = _dump(lr.state_dict())
    # A disabled scaler (AMP off, or on a CPU) has an empty state, which it cannot load.
    if scaler is not None and scaler.state_dict():
        files[SCALER] = _dump(scaler.state_dict())
    # Paddle's generator (dropout), Python's and numpy's (the augmentations of a script).
    rng = {
        "paddle": paddle.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
    }
    if raw:
        files[RNG_RAW] = pickle.dumps(rng, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        files[RNG] = _dump(_rng_file(rng))
    return files


def _rng_file(rng: Mapping[str, Any]) -> dict[str, Any]:
    """The RNG states as ``rng.pdstate`` keeps them (lists, which Paddle's pickler takes)."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    return {
        "paddle": rng["paddle"],
        "python": list(rng["python"]),
        "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, gauss],
    }


def _model_and_optimizer(files: Mapping[str, bytes]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the (positional) optimizer's state dicts of either form."""
    import paddle

    model_state: dict[str, Any] = {}
    opt_state: dict[str, Any] = {}
    arrays = getattr(files, "arrays", None) or (
        rawstate.decode(files[TENSORS]) if TENSORS in files else {}
    )
    if arrays:
        for name, array in arrays.items():
            if name.startswith(_MODEL_PREFIX):
                model_state[name[len(_MODEL_PREFIX) :]] = array
            elif name.startswith(_OPT_PREFIX):
                opt_state[name[len(_OPT_PREFIX) :]] = array
    if MODEL in files:
        model_state.update(paddle.load(io.BytesIO(files[MODEL])))
    for name in (OPTIMIZER, OPTIMIZER_REST):
        if name in files:
            opt_state.update(paddle.load(io.BytesIO(files[name])))
    return model_state, opt_state


def checkpoint_files(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """A state's files in Paddle's own form (``model.pdparams``, ``optimizer.pdopt``), the
    durable checkpoint's: a raw handover's are converted, any other returned as they are."""
    if TENSORS not in files and not getattr(files, "arrays", None):
        return dict(files)
    import paddle

    model_state, opt_state = _model_and_optimizer(files)
    raw_only = (TENSORS, MODEL, OPTIMIZER, OPTIMIZER_REST, RNG_RAW)
    out = {k: v for k, v in files.items() if k not in raw_only}
    if RNG_RAW in files:
        # Written by this same code in this pod's memory (the handover), like Paddle's own.
        out[RNG] = _dump(_rng_file(pickle.loads(files[RNG_RAW])))

    def tensors(state: dict[str, Any]) -> dict[str, Any]:
        return {k: paddle.to_tensor(v) if hasattr(v, "dtype") else v for k, v in state.items()}

    out[MODEL] = _dump(tensors(model_state))
    if opt_state:
        out[OPTIMIZER] = _dump(tensors(opt_state))
    return out


def _in_place(state: dict[str, Any], live: Mapping[str, Any]) -> None:
    """Entries of ``state`` that already are ``live``'s memory (a newcomer received into its
    own tensors) become those tensors: setting a tensor to itself costs nothing, to a numpy
    view of itself a copy (0.3-0.4 ms per MB here)."""
    for key, value in state.items():
        tensor = live.get(key)
        if tensor is None or not hasattr(value, "ctypes"):
            continue
        own = raw_array(tensor)
        if own is not None and own.ctypes.data == value.ctypes.data and own.shape == value.shape:
            state[key] = tensor


def load_state(
    files: Mapping[str, bytes], model: Any, optimizer: Any, lr: Any, scaler: Any = None
) -> None:
    """Put a checkpoint's files (either form) back into the model, optimizer, LR scheduler,
    AMP scaler and RNGs."""
    import numpy as np
    import paddle

    model_state, opt_state = _model_and_optimizer(files)
    live_model = layers(model).state_dict()
    _in_place(model_state, live_model)
    layers(model).set_state_dict(model_state)
    if optimizer is not None and opt_state:
        opt_state = positional(model, opt_state, to_positions=False)
        _in_place(opt_state, optimizer.state_dict())
        optimizer.set_state_dict(opt_state)
    if lr is not None and LR in files:
        lr.set_state_dict(paddle.load(io.BytesIO(files[LR])))
    if scaler is not None and SCALER in files:
        scaler.load_state_dict(paddle.load(io.BytesIO(files[SCALER])))
    if RNG_RAW in files:
        # The handover's, written by this same code in the pod's memory.
        rng = pickle.loads(files[RNG_RAW])
        paddle.set_rng_state(rng["paddle"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
    elif RNG in files:
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
