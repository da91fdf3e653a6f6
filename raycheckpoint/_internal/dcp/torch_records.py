"""One DCP item's record: ``torch.save``'s format, without its zip CRCs.

DCP stores every item of a rank as a ``torch.save`` record at a recorded offset in the
rank's ``.distcp`` file.  This module writes and reads those records fast:

* :func:`save_record` writes ``torch.save(obj)`` without the per-record CRC32 (the
  file's checksum covers every byte); a tensor whose layout was written before is
  written from that layout's template (:func:`_template`): the bytes around its data,
  which depend only on the layout once there are no CRCs.  :func:`record_pieces` gives
  the same bytes as pieces to write with ``os.writev``.
* :func:`record_tensor` reads a record of a layout the checkpoint's metadata names by
  comparing it with this torch's template for that layout: its tensor views the
  record's data, no zip parsing.  :func:`load_record` is torch's own reader and
  weights-only unpickler, over a buffer and without copying, for every other record.
"""

from __future__ import annotations

import inspect
import io
import math
import mmap
import pickle
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch._weights_only_unpickler as _weights_only_unpickler
import torch.serialization


def contiguous_owner(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a tensor's whole storage; make sure that is just this tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


# torch.save without the zip CRC32s, through the writer torch.save itself uses
_NO_CRC_SAVE = (hasattr(torch._C, "PyTorchFileWriter")
                and hasattr(torch.serialization, "_get_storage_alignment")
                and list(inspect.signature(torch.serialization._save).parameters)
                == ["obj", "zip_file", "pickle_module", "pickle_protocol",
                    "_disable_byteorder_record"])


def save_record(obj: Any, f: Any) -> None:
    """``torch.save(obj, f)``, less the zip format's CRC32 of each record.

    The file's checksum already covers every byte, and ``torch.load`` (and DCP's
    FileSystemReader) read such records alike.  The CRC is computed with the GIL held: it
    was a quarter of the persist thread's serialization time, taken from training.
    torch's own switch for it is process-wide; this one touches only these records.

    Without CRCs, the bytes torch writes around a tensor's data depend only on its
    layout, so a plain CPU tensor whose layout was written before is written from that
    record's bytes (:func:`_template`): three writes instead of torch's pickler and
    zip writer (about 40 writes and 0.2 ms a record, for a model's hundreds of records).
    """
    if not _NO_CRC_SAVE:  # a torch without the internals this relies on
        torch.save(obj, f)
        return
    pieces = record_pieces(obj) if isinstance(obj, torch.Tensor) else None
    if pieces is not None:
        for piece in pieces:
            f.write(piece)
        return
    _torch_record(obj, f)
    f.flush()


def record_pieces(t: torch.Tensor) -> tuple[bytes, memoryview, bytes] | None:
    """:func:`save_record`'s bytes for ``t`` as three pieces (the middle one views ``t``'s
    memory), where ``t``'s layout has a template; None where it goes through torch."""
    if not _NO_CRC_SAVE:
        return None
    template = _template(t)
    if template is None:
        return None
    return template[0], _tensor_bytes(t), template[1]


def view_record_pieces(t: torch.Tensor) -> tuple[bytes, memoryview, bytes] | None:
    """:func:`record_pieces` of a contiguous CPU tensor that may view part of a larger
    storage (a staging slab): the record ``torch.save`` writes for a copy of it alone,
    its middle piece viewing ``t``'s memory; None where its layout has no template."""
    if (not _NO_CRC_SAVE or type(t) is not torch.Tensor or t.device.type != "cpu"
            or t.layout != torch.strided or t.requires_grad or t.is_conj() or t.is_neg()
            or not t.is_contiguous() or t.numel() == 0):
        return None
    frame = record_frame(t.dtype, tuple(t.shape))
    return None if frame is None else (frame[0], _tensor_bytes(t), frame[1])


def _contiguous_key(dtype: torch.dtype, sizes: tuple[int, ...]) -> tuple[Any, int]:
    """The layout key of a contiguous ``dtype`` tensor of ``sizes``, and its data bytes."""
    nbytes = math.prod(sizes) * dtype.itemsize
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= n
    return _layout_key(dtype, sizes, reversed(strides), nbytes), nbytes


def record_frame(dtype: torch.dtype, sizes: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """The bytes before and after the data of the record of a contiguous ``dtype``
    tensor of ``sizes`` (:func:`_template`'s), found without allocating such a tensor:
    a layout not templated yet is written once from read-only zero pages (an anonymous
    mapping, never faulted in), so a shard's records can be framed around data streamed
    from elsewhere (a device, in bounded chunks).  None where torch writes no such
    record (``_NO_CRC_SAVE`` off) or the layout cannot be framed."""
    if not _NO_CRC_SAVE or not math.prod(sizes):
        return None
    key, nbytes = _contiguous_key(dtype, sizes)
    if key in _TEMPLATES:
        return _TEMPLATES[key]
    if key not in _FRAMES:
        zeros = mmap.mmap(-1, nbytes, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # read-only on purpose: never written
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(zeros, dtype=torch.uint8).view(dtype).view(sizes)
        cap = _Capture(memoryview(zeros))
        _torch_record(t, cap)
        parts = cap.parts
        frame = None
        if parts.count(None) == 1:
            at = parts.index(None)
            frame = (b"".join(parts[:at]), b"".join(parts[at + 1:]))
        if len(_FRAMES) >= _MAX_TEMPLATES:
            _FRAMES.clear()
        _FRAMES[key] = frame
    return _FRAMES[key]


_FRAMES: dict[tuple, tuple[bytes, bytes] | None] = {}  # record_frame's, by layout


def _torch_record(obj: Any, f: Any) -> None:
    writer = torch._C.PyTorchFileWriter(f, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Capture:
    """A file for torch's zip writer: keeps what is written around the tensor's data."""

    def __init__(self, data: Any) -> None:
        self._data = np.frombuffer(data, dtype=np.uint8)
        self.parts: list[bytes | None] = []  # None: where the tensor's bytes were written
        self.pos = 0

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if mv.nbytes == self._data.nbytes and np.array_equal(
                np.frombuffer(mv, dtype=np.uint8), self._data):
            self.parts.append(None)
        else:
            self.parts.append(bytes(mv))
        self.pos += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


# layout -> (bytes before the data, bytes after), or None where a layout cannot be templated
_TEMPLATES: dict[tuple, tuple[bytes, bytes] | None] = {}
_MAX_TEMPLATES = 4096


def _layout_key(dtype: torch.dtype, sizes: tuple, strides: tuple, nbytes: int) -> tuple:
    """What :data:`_TEMPLATES` is keyed by: a record's bytes around its data depend on this."""
    return (dtype, tuple(sizes), tuple(strides), nbytes)


def _template(t: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The bytes torch writes before and after the data of a record of ``t``'s layout.

    Found by writing the record twice, once with ``t``'s bytes and once with every byte
    inverted: the tensor's bytes must be one write in each, at the same place, and every
    other byte the same in both, or the layout is never templated.
    """
    if (type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout != torch.strided
            or t.requires_grad or t.is_conj() or t.is_neg() or t.storage_offset() != 0
            or not t.is_contiguous() or t.numel() == 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        return None
    key = _layout_key(t.dtype, t.shape, t.stride(), t.untyped_storage().nbytes())
    if key in _TEMPLATES:
        return _TEMPLATES[key]
    other = t.clone()
    other.reshape(-1).view(torch.uint8).bitwise_not_()
    captures = []
    for x in (t, other):
        cap = _Capture(_tensor_bytes(x))
        _torch_record(x, cap)
        captures.append(cap.parts)
    a, b = captures
    template = None
    if a == b and a.count(None) == 1:
        at = a.index(None)
        template = (b"".join(a[:at]), b"".join(a[at + 1:]))
    if len(_TEMPLATES) >= _MAX_TEMPLATES:
        _TEMPLATES.clear()
    _TEMPLATES[key] = template
    return template


class _ViewReader(io.RawIOBase):
    """A seekable file over a memoryview, for torch's zip reader: it reads the records it
    asks for (the small pickle and headers), never the tensor bytes."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


# torch.load(weights_only=True) with its storages viewing the caller's buffer: torch's own
# reader (the one its mmap=True path uses) handed the record as one "overall storage"
_ZERO_COPY_LOAD = (hasattr(torch.serialization, "_open_zipfile_reader")
                   and "overall_storage" in inspect.signature(torch.serialization._load).parameters)
# a record's size from the zip directory (torch 2.13 has it, 2.11 lacks it): needed to reuse a layout;
# without it (torch 2.11, the GPU machine's) every record is unpickled
_REUSE_LAYOUTS = _ZERO_COPY_LOAD and hasattr(torch._C.PyTorchFileReader, "get_record_size")


@dataclass(frozen=True)
class _TensorLayout:
    """The tensor a one-storage ``torch.save`` record's pickle builds over its storage."""

    nbytes: int
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


_LAYOUT_CACHE_MAX = 4096
_layouts: dict[bytes, _TensorLayout] = {}  # data.pkl bytes -> the tensor it builds
_layouts_lock = threading.Lock()


def load_record(blob: memoryview) -> Any:
    """What ``torch.load(weights_only=True)`` returns for the ``torch.save`` record in ``blob``.

    The loaded tensors' storages view ``blob`` (which must be writable); nothing is copied,
    so the caller copies what it keeps before ``blob`` goes away.  Same zip reader, same
    unpickler, same byte-order handling as ``torch.load``.  A checkpoint holds hundreds of
    tensors of a few shapes, and torch's weights-only unpickler is pure Python: a record
    whose pickle equals one seen before (same dtype, shape, strides) is built from that
    one's result over its own storage, without unpickling it again.
    """
    if not _ZERO_COPY_LOAD:  # a torch without the internals this relies on
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    with torch.serialization._open_zipfile_reader(_ViewReader(blob)) as zip_file:
        native = (zip_file.has_record("byteorder")
                  and zip_file.get_record("byteorder").decode() == sys.byteorder)
        pkl = zip_file.get_record("data.pkl") if native and _REUSE_LAYOUTS else None
        layout = None if pkl is None else _layouts.get(pkl)
        if layout is not None and zip_file.get_record_size("data/0") == layout.nbytes:
            at = zip_file.get_record_offset("data/0")
            storage = torch.frombuffer(blob[at:at + layout.nbytes], dtype=torch.uint8)
            return torch.empty(0, dtype=layout.dtype).set_(
                storage.untyped_storage(), layout.storage_offset, layout.size, layout.stride)
        whole = torch.frombuffer(blob, dtype=torch.uint8).untyped_storage()
        try:
            obj = torch.serialization._load(zip_file, "cpu", _weights_only_unpickler,
                                            overall_storage=whole, encoding="utf-8")
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"weights-only load refused the record: {e}") from None
        if (pkl is not None and type(obj) is torch.Tensor and not obj.requires_grad
                and obj.untyped_storage().nbytes() > 0 and len(_layouts) < _LAYOUT_CACHE_MAX
                and [r for r in zip_file.get_all_records() if r.startswith("data/")] == ["data/0"]):
            with _layouts_lock:
                _layouts[pkl] = _TensorLayout(
                    nbytes=obj.untyped_storage().nbytes(), dtype=obj.dtype,
                    storage_offset=obj.storage_offset(), size=tuple(obj.size()),
                    stride=tuple(obj.stride()))
    return obj


def record_tensor(record: memoryview, dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor:
    """The tensor of a record known to hold a contiguous ``dtype`` tensor of ``sizes``.

    The bytes torch writes around a tensor's data depend only on its layout
    (:func:`_template`), so where ``record`` is this torch's template for that layout
    around data of the right length, it is exactly ``torch.save`` of such a tensor, and
    the tensor views its data: no zip parsing, no unpickling (torch's reader took about
    0.1 ms a record, a model's hundreds of records per file).  Any other record (one
    with CRCs, from another torch, or not what the metadata says) is read by torch's own
    reader (:func:`load_record`).  Like it, the tensor views ``record``.
    """
    at = record_data_offset(record, dtype, sizes)
    if at is not None:
        nbytes = math.prod(sizes) * dtype.itemsize
        data = torch.frombuffer(record[at:at + nbytes], dtype=torch.uint8)
        return data.view(dtype).view(sizes)
    return load_record(record)


def record_data_offset(record: memoryview, dtype: torch.dtype, sizes: tuple[int, ...]) -> int | None:
    """Where a contiguous ``dtype`` tensor of ``sizes`` starts in ``record``, if ``record``
    is this torch's template for that layout around data of the right length (see
    :func:`record_tensor`); None for any other record."""
    template = _read_template(dtype, sizes)
    if template is None:
        return None
    before, after, nbytes = template
    # bytes() first: comparing a memoryview with bytes goes item by item (1.1 against 0.2
    # us for a record's 600 leading bytes)
    if (len(record) == len(before) + nbytes + len(after)
            and bytes(record[:len(before)]) == before
            and bytes(record[len(before) + nbytes:]) == after):
        return len(before)
    return None


def _read_template(dtype: torch.dtype, sizes: tuple[int, ...]) -> tuple[bytes, bytes, int] | None:
    """:func:`_template` of a contiguous ``dtype`` tensor of ``sizes``, and its data bytes.

    A load asks for one per record (hundreds a file): its layout key is built from the
    sizes, since building a tensor to key :func:`_template` cost more than comparing the
    record with the template.
    """
    if not _NO_CRC_SAVE:
        return None
    key, nbytes = _contiguous_key(dtype, sizes)
    template = (_TEMPLATES[key] if key in _TEMPLATES
                else _template(torch.empty(sizes, dtype=dtype)))
    return None if template is None else (*template, nbytes)
