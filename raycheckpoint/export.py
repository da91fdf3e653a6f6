"""Reading one role's tensors out of a checkpoint without Ray or a process group.

Used by ``raycheckpoint inspect`` and ``raycheckpoint export``.  A role's DCP directory
holds one file per saving rank; a tensor's pieces (its chunks, one per rank that held a
shard) are found through DCP's ``.metadata`` and read by byte range, so assembling a
full tensor needs memory for that tensor only.  Every file of the role is verified
(size and checksum, streamed) before anything is read from it; ``.metadata`` (a pickle)
is unpickled only once its checksum matches, and only by the restricted unpickler of
:mod:`~raycheckpoint._internal.dcp.safe_pickle`: a forged one is refused, nothing it names
runs.

Export formats:

* ``hf``: a Hugging Face directory: the role's assets (``config.json``, tokenizer
  files, written by the worker's ``ckpt_assets()``) and ``model.safetensors`` written
  tensor by tensor (the header is computed from the metadata first);
* ``state_dict``: one file of the model's tensors: ``.safetensors`` (streamed) or a
  ``torch.save`` file (assembled in memory) for any other suffix.

Tensor names are those of the worker's ``"model"`` state dict (the convention of
:class:`~raycheckpoint.worker.CheckpointableWorker`), i.e. the FQNs DCP saved with the
leading ``model.`` removed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from raycheckpoint._internal.dcp.safe_pickle import load_item, load_metadata
from raycheckpoint.errors import CheckpointNotFoundError, IntegrityError
from raycheckpoint.integrity.crypto import MAGIC, check_key
from raycheckpoint.integrity.verify import read_verified, verify_files
from raycheckpoint.protocol.checkpoint import VerifiedCheckpoint
from raycheckpoint.protocol.paths import DCP_METADATA, CheckpointPaths, dcp_metadata
from raycheckpoint.storage import Storage

MODEL_PREFIX = "model."

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str  # DCP FQN, e.g. "model.model.layers.0.mlp.up_proj.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: int

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class RoleReader:
    """The tensors of one role of a verified checkpoint, read by byte range."""

    def __init__(self, ck: VerifiedCheckpoint, role: str) -> None:
        layout = ck.manifest.roles.get(role)
        if layout is None:
            raise CheckpointNotFoundError(
                f"{ck.name} has no role {role!r}; it holds {sorted(ck.manifest.roles)}", ref=role)
        self.ck, self.role, self.layout = ck, role, layout
        self.storage: Storage = ck.storage
        self.dcp_dir = layout.dcp_dir
        prefix = self.dcp_dir + "/"
        self.files = {p: e for p, e in ck.manifest.files.items() if p.startswith(prefix)}
        self._metadata: Metadata | None = None
        self._encrypted: dict[str, bool] = {}

    @property
    def has_tensors(self) -> bool:
        return dcp_metadata(self.dcp_dir) in self.files

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        """Stream-hash every file of the role against the manifest."""
        verify_files(self.storage, self.files, progress)

    def metadata(self) -> Metadata:
        if self._metadata is None:
            rel = dcp_metadata(self.dcp_dir)
            if rel not in self.files:
                raise IntegrityError(f"{self.ck.name}: role {self.role!r} saved no tensors", path=rel)
            data = read_verified(self.storage, rel, self.files[rel], decrypt=True)
            self._metadata = load_metadata(data, rel)  # refused, not run, when forged
        return self._metadata

    def tensors(self) -> list[TensorInfo]:
        out = []
        for fqn, md in sorted(self.metadata().state_dict_metadata.items()):
            if isinstance(md, TensorStorageMetadata):
                out.append(TensorInfo(fqn, tuple(md.size), md.properties.dtype, len(md.chunks)))
        return out

    def other_items(self) -> list[str]:
        return sorted(fqn for fqn, md in self.metadata().state_dict_metadata.items()
                      if isinstance(md, BytesStorageMetadata))

    def model_tensors(self) -> list[TensorInfo]:
        found = [t for t in self.tensors() if t.name.startswith(MODEL_PREFIX)]
        if not found:
            raise IntegrityError(f"{self.ck.name}: role {self.role!r} has no 'model' tensors to "
                                 "export", path=self.dcp_dir)
        return found

    def read_item(self, fqn: str) -> Any:
        """A non-tensor item (``other_items``), unpickled as a load does: weights-only."""
        rel, data = self._record(MetadataIndex(fqn))
        return load_item(data, rel, fqn)

    def _record(self, index: MetadataIndex) -> tuple[str, bytes]:
        """The file holding the item at ``index``, and the item's record (plaintext)."""
        where = self.metadata().storage_data.get(index)
        if where is None:
            raise IntegrityError(f"{dcp_metadata(self.dcp_dir)}: lists {index.fqn} without "
                                 "saying where it is stored", path=dcp_metadata(self.dcp_dir))
        rel = f"{self.dcp_dir}/{where.relative_path}"
        if rel not in self.files:
            raise IntegrityError(f"{rel}: referenced by {DCP_METADATA} but not in the manifest",
                                 path=rel)
        if getattr(where, "transform_descriptors", None):
            raise IntegrityError(f"{rel}: uses DCP stream transforms, which this reader does "
                                 "not support", path=rel)
        return rel, self._read_range(rel, where.offset, where.offset + where.length)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The full tensor, assembled from its chunks."""
        md = self.metadata().state_dict_metadata[info.name]
        full = torch.empty(info.shape, dtype=info.dtype)
        for chunk in md.chunks:
            rel, data = self._record(MetadataIndex(info.name, chunk.offsets))
            piece = load_item(data, rel, info.name)
            if not isinstance(piece, torch.Tensor):
                raise IntegrityError(f"{rel}: chunk of {info.name} holds a "
                                     f"{type(piece).__name__}, not a tensor", path=rel)
            view = full
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                view = view.narrow(dim, start, length)
            if tuple(piece.shape) != tuple(view.shape):
                raise IntegrityError(f"{rel}: chunk of {info.name} has shape {tuple(piece.shape)}, "
                                     f"metadata says {tuple(view.shape)}", path=rel)
            view.copy_(piece)
        return full

    def _read_range(self, rel: str, start: int, end: int) -> bytes:
        """Plaintext bytes [start, end) of a (verified) data file, decrypting if needed."""
        if rel not in self._encrypted:
            self._encrypted[rel] = self.storage.read_bytes(rel, 0, len(MAGIC)) == MAGIC
        if not self._encrypted[rel]:
            return self.storage.read_bytes(rel, start, end)
        if self.storage.cipher is None:
            self.storage.decrypted(rel, MAGIC)  # raises the error naming what to set
        return self.storage.cipher.decrypt_range(
            rel, lambda a, b: self.storage.read_bytes(rel, a, b), self.files[rel].size, start, end)

    def iter_model(self, progress: Callable[[int], None] | None = None,
                   skip: frozenset[str] = frozenset()
                   ) -> Iterator[tuple[str, TensorInfo, torch.Tensor]]:
        for info in self.model_tensors():
            if info.name[len(MODEL_PREFIX):] in skip:
                continue
            tensor = self.read(info)
            if progress is not None:
                progress(info.nbytes)
            yield info.name[len(MODEL_PREFIX):], info, tensor

    def assets(self) -> dict[str, str]:
        """``{file name: path relative to the root}`` of the role's assets: those of the
        checkpoint that wrote its tensors (a frozen role's later checkpoints refer to it)."""
        owner = self.dcp_dir.split("/", 1)[0]
        prefix = CheckpointPaths(owner).assets_prefix(self.role)
        return {p[len(prefix):]: p for p in self.ck.manifest.files if p.startswith(prefix)}


def write_safetensors(path: str, reader: RoleReader,
                      progress: Callable[[int], None] | None = None,
                      skip: frozenset[str] = frozenset()) -> int:
    """Stream the role's model tensors (but ``skip``) into a safetensors file; returns the
    tensors written."""
    infos = [i for i in reader.model_tensors() if i.name[len(MODEL_PREFIX):] not in skip]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for info in infos:
        if info.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{info.name}: dtype {info.dtype} has no safetensors equivalent")
        header[info.name[len(MODEL_PREFIX):]] = {
            "dtype": _SAFETENSORS_DTYPES[info.dtype], "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, _info, tensor in reader.iter_model(progress, skip):
            data = tensor.contiguous().view(torch.uint8).numpy() if tensor.numel() else b""
            f.write(memoryview(data))
            del tensor
        f.flush()
        os.fsync(f.fileno())
    return len(infos)


def _publish_dir(tmp: str, out: str, force: bool) -> None:
    if os.path.exists(out):
        if not force:
            raise FileExistsError(f"{out} exists; pass --force to replace it")
        shutil.rmtree(out) if os.path.isdir(out) else os.unlink(out)
    os.replace(tmp, out)


def export(ck: VerifiedCheckpoint, out: str, *, fmt: str, role: str = "actor", force: bool = False,
           progress: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None
           ) -> dict[str, Any]:
    """Export ``role`` of ``ck`` to the local path ``out`` as ``hf`` or ``state_dict``.

    ``on_total(bytes)`` is told the bytes the progress will count (verification + tensors).
    The output appears complete or not at all (written beside it, then renamed).
    """
    if fmt not in ("hf", "state_dict"):
        raise ValueError(f"--format must be 'hf' or 'state_dict', got {fmt!r}")
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    check_key(ck.manifest.encryption, ck.storage.cipher, ck.name)
    reader = RoleReader(ck, role)
    assets = reader.assets()
    if fmt == "hf" and "config.json" not in assets:
        raise IntegrityError(
            f"{ck.name}: role {role!r} has no Hugging Face config.json among its assets (its "
            "worker's ckpt_assets() returned none); export it with --format state_dict",
            path=ck.paths.assets_prefix(role).rstrip("/"))
    skip: frozenset[str] = frozenset()
    if fmt == "hf":
        config = json.loads(read_verified(ck.storage, assets["config.json"],
                                          ck.manifest.files[assets["config.json"]]))
        # tied output embeddings are one tensor: saved once, as save_pretrained does
        skip = frozenset({"lm_head.weight"} if config.get("tie_word_embeddings") else ())
    model_bytes = sum(t.nbytes for t in reader.model_tensors()
                      if t.name[len(MODEL_PREFIX):] not in skip) if reader.has_tensors else 0
    asset_bytes = sum(ck.manifest.files[p].size for p in assets.values())
    if on_total is not None:
        on_total(reader.bytes + asset_bytes + model_bytes)
    reader.verify(progress)
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    if fmt == "hf":
        tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
        try:
            for name, rel in sorted(assets.items()):
                data = read_verified(ck.storage, rel, ck.manifest.files[rel])
                if progress is not None:
                    progress(len(data))
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            count = write_safetensors(os.path.join(tmp, "model.safetensors"), reader, progress, skip)
            _publish_dir(tmp, out, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        files = sorted(os.listdir(out))
    else:
        fd, tmp = tempfile.mkstemp(prefix=".export-", dir=parent)
        os.close(fd)
        try:
            if out.endswith(".safetensors"):
                count = write_safetensors(tmp, reader, progress)
            else:
                state = {name: tensor for name, _, tensor in reader.iter_model(progress)}
                with open(tmp, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                count = len(state)
            _publish_dir(tmp, out, force)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        files = [os.path.basename(out)]
    return {"checkpoint": ck.name, "step": ck.step, "role": role, "format": fmt, "out": out,
            "tensors": count, "bytes": model_bytes, "files": files}
