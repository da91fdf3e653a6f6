"""torch.save records without their zip CRCs, written from templates and read without
torch's reader (raycheckpoint._internal.dcp.torch_records)."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from raycheckpoint._internal.dcp import torch_records
from raycheckpoint._internal.dcp.torch_records import load_record, save_record


def _record(t: torch.Tensor) -> memoryview:
    buf = io.BytesIO()
    torch.save(t, buf)
    return memoryview(bytearray(buf.getvalue()))


@pytest.mark.parametrize("make", [
    lambda: torch.randn(37, 11),
    lambda: torch.randn(5, 7).to(torch.bfloat16),
    lambda: torch.arange(24, dtype=torch.int64).reshape(4, 6).t(),  # strided
    lambda: torch.arange(10.0)[3:7],                                # a view: offset into storage
    lambda: torch.tensor(3.0),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.empty(0, 4),
], ids=["fp32", "bf16", "transposed", "view", "scalar", "bool", "empty"])
@pytest.mark.parametrize("reuse", [None, False], ids=["this-torch", "no-layout-reuse"])
def test_load_record_matches_torch_load_and_views_the_buffer(make, reuse, monkeypatch):
    """``no-layout-reuse``: the path of a torch whose zip reader cannot say a record's size
    (torch 2.11, the GPU machine's): every record is unpickled."""
    if reuse is not None:
        monkeypatch.setattr(torch_records, "_REUSE_LAYOUTS", reuse)
        monkeypatch.setattr(torch_records, "_layouts", {})
    src = make()
    for _ in range(3):  # the first record is unpickled; equal ones after it use its layout
        blob = _record(src.clone() if src.is_contiguous() and src.storage_offset() == 0 else src)
        want = torch.load(io.BytesIO(blob), weights_only=True)
        got = load_record(blob)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
        assert torch.equal(got, want)
        if got.untyped_storage().nbytes():  # zero-copy: the storage lies inside the record
            base = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
            assert base <= got.untyped_storage().data_ptr() < base + len(blob)
            del got, want


def test_load_record_equal_pickles_with_other_data_read_their_own_bytes():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    load_record(_record(a))
    assert torch.equal(load_record(_record(b)), b)  # the cached layout, b's own data


def test_load_record_refuses_what_weights_only_refuses():
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    buf = io.BytesIO()
    torch.save({"t": torch.ones(2), "x": Evil()}, buf)
    with pytest.raises(pickle.UnpicklingError, match="weights-only load refused the record"):
        load_record(memoryview(bytearray(buf.getvalue())))


def test_save_record_skips_only_the_zip_crc():
    """Records are torch.save's format, loadable by torch.load, without the per-record
    CRC32 (the file's checksum covers the bytes; the CRC cost CPU with the GIL held)."""
    src = torch.randn(33, 7)
    buf = io.BytesIO()
    save_record(src, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), src)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        data = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
        assert data.CRC == 0 and data.file_size == src.numel() * 4
        assert "archive/byteorder" in zf.namelist()


def test_records_of_a_known_layout_are_torchs_bytes():
    """A record written from its layout's template is byte for byte what torch's writer
    writes (without CRCs), and loads back, for every dtype and shape tried; a layout that
    cannot be templated (a view into a larger storage) goes through torch's writer."""
    from raycheckpoint._internal.dcp.torch_records import _TEMPLATES, _template, _torch_record

    tensors = [torch.randn(33, 7), torch.randn(()), torch.randn(5).to(torch.bfloat16),
               torch.tensor([True, False, True]), torch.arange(9), torch.ones(1, dtype=torch.uint8),
               torch.zeros(4, 3, dtype=torch.float16)]
    for src in tensors:
        for attempt in range(3):  # the first builds the template, the others use it
            x = src.clone() if attempt < 2 else src.clone().fill_(1)
            ours, theirs = io.BytesIO(), io.BytesIO()
            save_record(x, ours)
            _torch_record(x, theirs)
            assert ours.getvalue() == theirs.getvalue(), (x.dtype, tuple(x.shape))
            assert torch.equal(torch.load(io.BytesIO(ours.getvalue()), weights_only=True), x)
        assert _template(src) is not None, (src.dtype, tuple(src.shape))
    view = torch.randn(10)[2:5]
    assert _template(view) is None
    buf = io.BytesIO()
    save_record(view, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), view)
    assert len(_TEMPLATES) >= len(tensors)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(37, 11),
    lambda: torch.randn(5, 7).to(torch.bfloat16),
    lambda: torch.tensor(3.0),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.arange(24, dtype=torch.int64).reshape(4, 6),
], ids=["fp32", "bf16", "scalar", "bool", "int64"])
def test_a_record_of_a_known_layout_is_read_without_torchs_reader(make, monkeypatch):
    """The bytes around a template-written record's data depend only on its layout, which
    the loader knows from the metadata: such a record's tensor views its data, no zip
    parsing.  Anything else (CRCs written, another layout than the metadata says) goes to
    torch's own reader, with the same result."""
    from raycheckpoint._internal.dcp import torch_records as records
    from raycheckpoint._internal.dcp.torch_records import record_tensor

    src = make()
    parsed = []
    real = records.load_record
    monkeypatch.setattr(records, "load_record", lambda b: parsed.append(1) or real(b))
    buf = io.BytesIO()
    save_record(src, buf)
    blob = memoryview(bytearray(buf.getvalue()))
    got = record_tensor(blob, src.dtype, tuple(src.shape))
    assert parsed == [] and got.dtype == src.dtype and torch.equal(got, src)
    base = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    assert base <= got.data_ptr() < base + len(blob)  # a view of the record
    del got
    with_crc = io.BytesIO()
    torch.save(src, with_crc)  # torch.save's own records carry CRCs: not the template
    assert torch.equal(record_tensor(memoryview(bytearray(with_crc.getvalue())), src.dtype,
                                     tuple(src.shape)), src)
    assert parsed == [1]
    other = record_tensor(blob, src.dtype, (1, *src.shape))  # the metadata says another shape
    assert parsed == [1, 1] and torch.equal(other, src)  # torch's answer; the caller checks it
