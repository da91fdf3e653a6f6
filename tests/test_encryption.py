"""Encryption at rest: AES-256-GCM per file, streamed; keys from env: or file: references."""

from __future__ import annotations

import base64
import json
import os
import random

import pytest

from raycheckpoint import CheckpointConfig, IntegrityError, Storage
from raycheckpoint.admin import verify
from raycheckpoint.integrity.crypto import MAGIC, EncryptionKeyError, FileCipher, key_id, load_key
from tests.helpers import assert_same, flip_bit, full_state, manager, train

pytestmark = pytest.mark.timeout(300)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


def test_keys_come_from_references_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RC_KEY_HEX", KEY.hex())
    monkeypatch.setenv("RC_KEY_B64", base64.b64encode(KEY).decode())
    raw = tmp_path / "key.bin"
    raw.write_bytes(KEY)
    text = tmp_path / "key.txt"
    text.write_text(KEY.hex() + "\n")
    for ref in ("env:RC_KEY_HEX", "env:RC_KEY_B64", f"file:{raw}", f"file:{text}"):
        assert load_key(ref) == KEY
    with pytest.raises(EncryptionKeyError, match="RC_MISSING is not set"):
        load_key("env:RC_MISSING")
    monkeypatch.setenv("RC_SHORT", "abcd")
    with pytest.raises(EncryptionKeyError, match="256-bit"):
        load_key("env:RC_SHORT")
    with pytest.raises(ValueError, match="literal secret"):
        CheckpointConfig(save_dir=str(tmp_path), encryption_key=KEY.hex())
    assert key_id(KEY) != key_id(OTHER) and KEY.hex() not in key_id(KEY)


def test_streamed_chunks_authenticate_everything(tmp_path):
    cipher = FileCipher(KEY, chunk_bytes=1000)
    st = Storage(str(tmp_path), cipher=cipher)
    data = os.urandom(4321)
    with st.open_write("d/x", encrypt=True) as w:
        for i in range(0, len(data), 517):  # writes that do not line up with chunks
            w.write(data[i:i + 517])
    assert w.tell() == len(data)  # positions are plaintext positions (DCP offsets)
    stored = st.read_bytes("d/x")
    assert stored.startswith(MAGIC) and data[:64] not in stored
    assert w.entry.size == len(stored)  # the manifest sizes/hashes the stored bytes
    assert st.decrypted("d/x", stored) == data
    rng = random.Random(0)
    for _ in range(30):
        a = rng.randrange(len(data))
        b = rng.randrange(a, len(data) + 1)
        assert cipher.decrypt_range("d/x", lambda x, y: st.read_bytes("d/x", x, y),
                                    len(stored), a, b) == data[a:b]
    flipped = bytearray(stored)
    flipped[len(stored) // 2] ^= 1
    with pytest.raises(IntegrityError, match="authentication failed"):
        st.decrypted("d/x", bytes(flipped))
    header, chunk = 21, 1000 + 16
    assert (len(stored) - header) // chunk == 4  # 4 full chunks, then the last (321 bytes)
    with pytest.raises(IntegrityError, match="authentication failed"):  # last chunk dropped
        st.decrypted("d/x", stored[:header + 4 * chunk])
    with pytest.raises(IntegrityError, match="authentication failed"):  # moved elsewhere
        cipher.decrypt("d/y", stored)
    with pytest.raises(IntegrityError, match="authentication failed"):  # another key
        FileCipher(OTHER, chunk_bytes=1000).decrypt("d/x", stored)


@pytest.fixture
def keys(monkeypatch, tmp_path):
    monkeypatch.setenv("RC_TEST_KEY", KEY.hex())
    other = tmp_path / "other.key"
    other.write_bytes(OTHER)
    return {"key": "env:RC_TEST_KEY", "other": f"file:{other}"}


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_encrypted_round_trip_and_refusals(backend, keys, group2, local_root, request, tmp_path,
                                           capsys):
    root, options = (local_root, {}) if backend == "local" else request.getfixturevalue("s3_root")
    m = manager(root, {"actor": group2}, options, config={"encryption_key": keys["key"]})
    try:
        train(group2, [1])
        m.update(step=1)
        m.save_checkpoint().wait(120)
        saved = full_state(group2)
        train(group2, [2, 3])
        m.load_checkpoint(1)
        assert_same(saved["model"], full_state(group2)["model"])
        assert_same(saved["optim"], full_state(group2)["optim"])
    finally:
        m.close(60)
    st = Storage(root, options)
    files = st.list_files("step_00000001")
    manifest_doc = st.read_bytes("step_00000001/manifest.msgpack")
    assert key_id(KEY).encode() in manifest_doc and KEY not in manifest_doc
    for path in files:
        data = st.read_bytes(path)
        assert KEY not in data and KEY.hex().encode() not in data
        if "/actor/" in path or "/rng/" in path:
            assert data.startswith(MAGIC), path  # tensors and rank state are encrypted
    # verification needs no key: the manifest hashes the stored bytes
    assert verify(root, options)["ok"]

    # the wrong key, or none, is refused before any tensor is read
    wrong = manager(root, {"actor": group2}, options, config={"encryption_key": keys["other"]})
    try:
        with pytest.raises(EncryptionKeyError, match=f"key id {key_id(KEY)}.*wrong key"):
            wrong.load_checkpoint(1)
    finally:
        wrong.close(60)
    plain = manager(root, {"actor": group2}, options)
    try:
        with pytest.raises(EncryptionKeyError, match=r"set checkpoint\.encryption_key"):
            plain.load_checkpoint(1)
    finally:
        plain.close(60)

    # export needs the key; with it the weights come out exact
    from raycheckpoint import cli

    opts = [a for k, v in options.items() for a in ("-o", f"{k}={v}")]
    out = str(tmp_path / "sd.safetensors")
    assert cli.main(["export", root, out, "--format", "state_dict", "--step", "1", *opts]) == 2
    assert "set checkpoint.encryption_key (or --encryption-key)" in capsys.readouterr().err
    assert cli.main(["export", root, out, "--format", "state_dict", "--step", "1",
                     "--encryption-key", keys["key"], *opts]) == 0
    from safetensors.torch import load_file

    exported = load_file(out)
    assert_same(dict(saved["model"]), exported)
    capsys.readouterr()
    assert cli.main(["inspect", root, "--step", "1", "--json", *opts]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["encryption"]["key_id"] == key_id(KEY) and "note" in doc["roles"]["actor"]


def test_tampered_ciphertext_fails_authentication_even_without_checksums(keys, group2, local_root):
    m = manager(local_root, {"actor": group2},
                config={"encryption_key": keys["key"], "enable_checksum": False})
    try:
        train(group2, [1])
        m.update(step=1)
        m.save_checkpoint().wait(120)
        flip_bit(f"{local_root}/step_00000001/actor/__0_0.distcp", 0x80)
        with pytest.raises(IntegrityError, match="authentication failed") as e:
            m.load_checkpoint(1)
        assert e.value.path == "step_00000001/actor/__0_0.distcp"  # never garbage tensors
    finally:
        m.close(60)
