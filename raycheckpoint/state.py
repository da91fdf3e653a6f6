"""RNG and data-position state: capture to plain (msgpack/JSON-safe) values, restore.

Used on both sides: workers capture their per-rank RNG into ``rng/<role>/rank_<r>``,
the driver captures its own RNG and its data loader's position into
``trainer_state.json``.  Nothing here pickles.

Data loaders: anything with ``state_dict()`` / ``load_state_dict()`` works (torchdata's
``StatefulDataLoader`` included); :class:`ResumableSampler` is a dependency-free
sampler that resumes mid-epoch at the exact next index.  A loader's state goes through
:func:`encode_loader_state` / :func:`decode_loader_state`: JSON values as they are,
tensors and numpy arrays (a shuffling sampler's generator state), tuples, bytes and
non-string keys as tagged values; anything else is refused at save time.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import torch

from raycheckpoint.errors import IntegrityError
from raycheckpoint.protocol.format import unpack


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _tensor_state(t: torch.Tensor) -> str:
    return _b64(t.cpu().numpy().tobytes())


def _state_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(_unb64(text)), dtype=torch.uint8).clone()


# the element types a data loader's state may hold in a tensor or array
_DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64")}
_TAG = "__rc."  # tagged values: {"__rc.<kind>__": ...}; a plain dict never uses the prefix


def encode_loader_state(obj: Any, where: str = "data loader state") -> Any:
    """``obj`` (a data loader's ``state_dict()``) as JSON-safe values; a value of any
    other type raises TypeError naming where it sits."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"{where}: a tensor of {t.dtype}, which a checkpoint does not store")
        return {f"{_TAG}tensor__": {"dtype": str(t.dtype).removeprefix("torch."),
                                    "shape": list(t.shape),
                                    "data": _b64(t.reshape(-1).view(torch.uint8).numpy().tobytes())}}
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in _DTYPES or obj.dtype.name == "bfloat16":
            raise TypeError(f"{where}: an array of {obj.dtype}, which a checkpoint does not store")
        return {f"{_TAG}ndarray__": {"dtype": obj.dtype.name, "shape": list(obj.shape),
                                     "data": _b64(np.ascontiguousarray(obj).tobytes())}}
    if isinstance(obj, bytes):
        return {f"{_TAG}bytes__": _b64(obj)}
    if isinstance(obj, tuple):
        return {f"{_TAG}tuple__": [encode_loader_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_loader_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith(_TAG) for k in obj):
            return {k: encode_loader_state(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {f"{_TAG}items__": [[encode_loader_state(k, f"{where} key {k!r}"),
                                    encode_loader_state(v, f"{where}[{k!r}]")]
                                   for k, v in obj.items()]}
    raise TypeError(f"{where}: a {type(obj).__name__}, which a checkpoint does not store "
                    "(it holds JSON values, tensors and arrays, never objects needing code)")


def decode_loader_state(obj: Any, source: str) -> Any:
    """The inverse of :func:`encode_loader_state`; a malformed value raises an
    IntegrityError naming ``source`` (the file it came from)."""
    try:
        return _decode(obj)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise IntegrityError(f"{source}: malformed data loader state ({type(e).__name__}: "
                             f"{e})", path=source) from None


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tags = [k for k in obj if k.startswith(_TAG)]
    if not tags:
        return {k: _decode(v) for k, v in obj.items()}
    if len(obj) != 1:
        raise ValueError(f"a tagged value with other keys: {sorted(obj)}")
    (tag, value), = obj.items()
    if tag == f"{_TAG}tuple__":
        return tuple(_decode(v) for v in value)
    if tag == f"{_TAG}items__":
        return {_hashable(_decode(k)): _decode(v) for k, v in value}
    if tag == f"{_TAG}bytes__":
        return _unb64(value)
    if tag in (f"{_TAG}tensor__", f"{_TAG}ndarray__"):
        dtype, shape, data = _DTYPES[value["dtype"]], [int(n) for n in value["shape"]], _unb64(value["data"])
        count = int(np.prod(shape)) if shape else 1
        if count * dtype.itemsize != len(data):
            raise ValueError(f"{len(data)} bytes for shape {shape} of {value['dtype']}")
        t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        t = t.reshape(shape).clone()
        return t if tag == f"{_TAG}tensor__" else t.numpy()
    raise ValueError(f"unknown tag {tag!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)):
        raise TypeError(f"a key of type {type(key).__name__}")
    return key


def capture_rng() -> dict[str, Any]:
    """The python, numpy, torch (and cuda, when present) generator states."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"name": np_name, "keys": _b64(np.asarray(np_keys, dtype=np.uint32).tobytes()),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "torch": _tensor_state(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_tensor_state(s) for s in torch.cuda.get_rng_state_all()]
    return state


def decode_rank_state(rel: str, data: bytes) -> dict[str, Any]:
    """A rank's extra-state file (``rng/<role>/rank_<r>.msgpack``): ``{"rng", "state"}``.
    Bytes that match the manifest may still not be one (a re-sealed forgery): an
    IntegrityError naming ``rel``, so that ``auto`` passes the checkpoint over."""
    try:
        extra = unpack(data)
        if not isinstance(extra, dict) or not isinstance(extra.get("rng"), dict):
            raise ValueError(f"a {type(extra).__name__} without an 'rng' map")
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise IntegrityError(f"{rel}: holds no rank state ({type(e).__name__}: {e})",
                             path=rel) from None
    return extra


def restore_rng(state: dict[str, Any], source: str = "trainer_state.json") -> list[str]:
    """Restore what ``state`` holds; return the generators it could not restore.  State
    that is not what :func:`capture_rng` wrote is an IntegrityError naming ``source``."""
    try:
        return _restore_rng(state)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        raise IntegrityError(f"{source}: its RNG state cannot be restored "
                             f"({type(e).__name__}: {e})", path=source) from None


def _restore_rng(state: dict[str, Any]) -> list[str]:
    skipped: list[str] = []
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    keys = np.frombuffer(_unb64(n["keys"]), dtype=np.uint32).copy()
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(_state_tensor(state["torch"]))
    if "cuda" in state:
        if torch.cuda.is_available():
            cuda_states = [_state_tensor(s) for s in state["cuda"]]
            if len(cuda_states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda_states)
            else:
                skipped.append(f"cuda (saved {len(cuda_states)} devices, "
                               f"found {torch.cuda.device_count()})")
        else:
            skipped.append("cuda (no CUDA device here)")
    return skipped


class ResumableSampler:
    """Shuffled indices over ``size`` items, one permutation per epoch, resumable.

    The permutation of epoch ``e`` depends only on ``(seed, e)``; ``state_dict()``
    records the epoch and the number of indices already yielded, so a restored
    sampler continues with exactly the next index.
    """

    def __init__(self, size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        while True:
            order = self._order(self.epoch)
            while self.offset < self.size:
                idx = order[self.offset]
                self.offset += 1
                yield idx
            self.epoch += 1
            self.offset = 0

    def next_batch(self, batch_size: int) -> list[int]:
        it = iter(self)
        return [next(it) for _ in range(batch_size)]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "size": self.size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for size={state['size']} seed={state['seed']}, this sampler "
                f"has size={self.size} seed={self.seed}")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.shuffle = bool(state["shuffle"])
