"""No code runs from a checkpoint: a forged pickle, re-sealed into the manifest and
``COMMITTED`` as anyone who can write an unencrypted root can do (DESIGN section 8), is
refused with an IntegrityError naming the file by every reader (a worker's load, the
background verifier, ``raycheckpoint inspect/verify/export``, the Hugging Face export),
and its payload (a shell command creating a file) never runs.  The allow-list still
admits every real checkpoint's metadata.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from raycheckpoint import IntegrityError
from raycheckpoint._internal.dcp.load import load_verified
from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
from raycheckpoint._internal.dcp.safe_pickle import check_metadata, load_item, load_metadata
from raycheckpoint._internal.dcp.torch_records import load_record
from raycheckpoint.protocol.checkpoint import open_verified
from raycheckpoint.storage import Storage
from raycheckpoint.verifier import verify_committed
from tests.forgery import (
    FIXTURES,
    METADATA,
    NAME,
    add_hf_config,
    forge_item,
    forge_metadata,
    forged_root,
    touch,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def flag(tmp_path):
    """The file a payload would create: it must never exist."""
    return tmp_path / "payload-ran"


def _reader(root: str) -> VerifyingStorageReader:
    ck = open_verified(Storage(root), NAME)
    dcp_dir = ck.manifest.roles["actor"].dcp_dir
    files = {p: e for p, e in ck.manifest.files.items() if p.startswith(dcp_dir + "/")}
    return VerifyingStorageReader(Storage(root), dcp_dir, files)


# ---- the allow-list admits what real checkpoints hold ------------------------------------------

@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("format_v*")))
def test_every_fixtures_metadata_loads_as_pickle_loads_it(fixture):
    data = (FIXTURES / fixture / "root" / METADATA).read_bytes()
    trusted = pickle.loads(data)  # a checked-in fixture: trusted
    assert load_metadata(data, METADATA) == trusted
    check_metadata(data, METADATA)  # the command line's check, without torch


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_dtype_and_memory_format_and_protocol_is_admitted(protocol):
    dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    formats = [torch.contiguous_format, torch.channels_last, torch.preserve_format]
    sdm, storage_data = {}, {}
    for i, dtype in enumerate(dtypes):
        props = TensorProperties(dtype=dtype, memory_format=formats[i % len(formats)])
        chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
        sdm[f"t{i}"] = TensorStorageMetadata(props, torch.Size([2]), [chunk])
        storage_data[MetadataIndex(f"t{i}", torch.Size([0]))] = f"__0_{i}.distcp"
    md = Metadata(sdm, planner_data={"t0": ("t0",)}, storage_data=storage_data,
                  storage_meta=StorageMeta(checkpoint_id="/ckpt", save_id="s", modules=["m"]))
    data = pickle.dumps(md, protocol=protocol)
    assert load_metadata(data, "x/.metadata") == md
    check_metadata(data, "x/.metadata")


# ---- the unpickler refuses what metadata never does -------------------------------------------

def _refused(data: bytes, match: str) -> None:
    for load in (load_metadata, check_metadata):
        with pytest.raises(IntegrityError, match=match) as e:
            load(data, "r/.metadata")
        assert e.value.path == "r/.metadata" and "nothing in it was run" in str(e.value)


def test_globals_outside_the_allow_list_are_never_looked_up_or_called(flag):
    for protocol in (0, 2, 4, 5):
        _refused(pickle.dumps(touch(flag), protocol=protocol),
                 r"posix\.system|opcode" if protocol == 0 else r"posix\.system")
    _refused(pickle.dumps(eval), r"builtins\.eval")
    # torch.load names a torch global: not a dtype, layout or memory format
    _refused(b"\x80\x04ctorch\nload\n.", r"torch\.load")
    _refused(b"\x80\x04ctorch\nfloat_power\n.", r"no dtype|does not hold DCP metadata")
    assert not flag.exists()


def test_admitted_globals_are_used_only_as_the_format_uses_them():
    dcp = b"\x8c%torch.distributed.checkpoint.metadata\x94"
    # REDUCE of a value (a dtype is not callable code to run)
    _refused(b"\x80\x04ctorch\nfloat32\n)R.", r"calls")
    # BUILD on a class itself: would set attributes of torch's class for the whole process
    build_on_class = b"\x80\x04" + dcp + b"\x8c\x08Metadata\x93N}\x8c\x03eviNs\x86b."
    _refused(build_on_class, r"sets state on")
    assert not hasattr(Metadata, "evi")
    # BUILD on a shared enum member
    member = (b"\x80\x04" + dcp + b"\x8c\x14_MEM_FORMAT_ENCODING\x93K\x00\x85R}\x8c\x07_value_K\x07sb.")
    _refused(member, r"sets state on")
    assert _MEM_FORMAT_ENCODING(0).value == 0
    # NEWOBJ of a callable that is no metadata class; SETITEM into a non-dict
    _refused(b"\x80\x04ctorch\nSize\n)\x81.", r"creates an instance")
    _refused(b"\x80\x04ctorch\nSize\n]\x85RK\x01K\x02s.", r"SETITEM on")
    # opcodes that reach other code: INST, OBJ, EXT1, BINPERSID, protocol 0 text
    for op in (b"i", b"o", b"\x82\x01", b"Q", b"P1\n", b"I1\n"):
        _refused(b"\x80\x04" + op + b".", r"opcode")
    _refused(b"\x80\x04}\x94.", r"does not hold DCP metadata|holds a dict")  # a dict, no metadata
    _refused(pickle.dumps(Metadata({}))[:-9], r"unreadable pickle|truncated")  # cut short


def test_a_records_payload_is_refused_by_the_weights_only_unpickler(flag):
    """torch_records never falls back to torch's full unpickler."""
    import io

    buf = io.BytesIO()
    torch.save({"lr": touch(flag)}, buf)
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
        load_record(memoryview(bytearray(buf.getvalue())))
    with pytest.raises(IntegrityError, match=r"d/__0_0\.distcp: item 'lr'"):
        load_item(buf.getvalue(), "d/__0_0.distcp", "lr")
    assert not flag.exists()


# ---- every reader of a checkpoint --------------------------------------------------------------

def test_a_workers_load_refuses_forged_metadata(tmp_path, flag):
    root = forged_root(tmp_path)
    forge_metadata(root, flag)
    with pytest.raises(IntegrityError, match=re.escape(METADATA) + r".*posix\.system"):
        load_verified({"model": {"embed.weight": torch.zeros(256, 64)}}, _reader(root))
    assert not flag.exists()


class _OwnLoadBytes(DefaultLoadPlanner):
    """A planner unpickling non-tensor items its own way (with torch's full unpickler)."""

    seen: list[bytes] = []

    def load_bytes(self, read_item, value) -> None:
        _OwnLoadBytes.seen.append(value.getvalue())
        super().load_bytes(read_item, value)


@pytest.mark.parametrize("planner", [None, _OwnLoadBytes])
def test_a_workers_load_refuses_a_forged_non_tensor_item(tmp_path, flag, planner, monkeypatch):
    import raycheckpoint._internal.dcp.load as load_module

    if planner is not None:
        monkeypatch.setattr(load_module, "LayoutCachingLoadPlanner",
                            lambda allow_partial_load: planner(allow_partial_load=allow_partial_load))
    root = forged_root(tmp_path)
    state = {"optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    load_verified(state, _reader(root))  # the real items load (weights-only), as before
    assert state["optim"]["param_groups"][0]["lr"] == 0.0009973
    assert state["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    if planner is not None:  # the planner's own unpickler saw bytes pickled anew, not the file's
        assert _OwnLoadBytes.seen and all(b[:2] == b"PK" for b in _OwnLoadBytes.seen)
    _OwnLoadBytes.seen.clear()
    rel = forge_item(root, "optim.param_groups.0.lr", touch(flag))
    with pytest.raises(IntegrityError, match=re.escape(rel) + r".*optim\.param_groups\.0\.lr"):
        load_verified({"optim": {"param_groups": [{"lr": 0.0}]}}, _reader(root))
    assert not flag.exists() and _OwnLoadBytes.seen == []


def test_the_background_verifier_refuses_forged_metadata(tmp_path, flag):
    root = forged_root(tmp_path)
    forge_metadata(root, flag)
    result = verify_committed(Storage(root), NAME)
    assert result["ok"] is False and METADATA in result["error"]
    assert "posix.system" in result["error"] and "nothing in it was run" in result["error"]
    assert not flag.exists()


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "raycheckpoint.cli", *argv], capture_output=True,
                          text=True, timeout=240, env=env)


def test_the_command_line_refuses_forged_metadata(tmp_path, flag):
    root = forged_root(tmp_path)
    forge_metadata(root, flag)
    proc = _cli("inspect", root, "--json")
    assert proc.returncode == 2 and not flag.exists(), proc.stdout + proc.stderr
    assert METADATA in proc.stderr and "posix.system" in proc.stderr
    assert "Traceback" not in proc.stderr

    proc = _cli("verify", root, "--json")
    assert proc.returncode == 1 and not flag.exists(), proc.stdout + proc.stderr
    bad = json.loads(proc.stdout)["checkpoints"][0]
    assert not bad["ok"] and bad["path"] == METADATA and "posix.system" in bad["error"]

    out = tmp_path / "actor.safetensors"
    proc = _cli("export", root, str(out), "--format", "state_dict", "--json")
    assert proc.returncode == 2 and not flag.exists(), proc.stdout + proc.stderr
    assert METADATA in proc.stderr and not out.exists()


def test_the_hf_export_refuses_forged_metadata(tmp_path, flag):
    from raycheckpoint import hf_export

    root = forged_root(tmp_path)
    add_hf_config(root)
    forge_metadata(root, flag)
    storage = Storage(root)
    with pytest.raises(IntegrityError, match=re.escape(METADATA)):
        hf_export.write_beside(open_verified(storage, NAME), "actor")
    assert not flag.exists() and not storage.exists(f"{hf_export.export_dir(NAME)}/manifest.json")



def test_verify_checks_metadata_without_importing_torch(tmp_path):
    """``raycheckpoint verify`` decides as the restricted unpickler does, on any machine."""
    root = forged_root(tmp_path)
    code = ("import sys; from raycheckpoint import cli; "
            f"rc = cli.main(['verify', {root!r}, '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"]
