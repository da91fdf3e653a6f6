"""What the environment may change in a job's config (config.env_overrides): the root, and
never whether checksums are checked."""

from __future__ import annotations

from raycheckpoint import CheckpointConfig
from raycheckpoint.config import env_overrides


def test_checksums_cannot_be_switched_off_from_the_environment(monkeypatch, tmp_path):
    for value in ("0", "false"):
        monkeypatch.setenv("RAYCHECKPOINT_ENABLE_CHECKSUM", value)
        assert "enable_checksum" not in env_overrides()
        assert CheckpointConfig.from_dict({"save_dir": str(tmp_path)}).enable_checksum is True
    # the documented key is unchanged
    off = CheckpointConfig.from_dict({"save_dir": str(tmp_path), "enable_checksum": False})
    assert off.enable_checksum is False


def test_the_root_still_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYCHECKPOINT_SAVE_DIR", str(tmp_path / "elsewhere"))
    assert CheckpointConfig.from_dict({"save_dir": str(tmp_path)}).save_dir == str(tmp_path / "elsewhere")
