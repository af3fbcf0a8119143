"""Staging folders and what is staged in them get the umask's permissions (issue 46: convert and
``data shards`` output was 0700 / 0600 whatever the umask)."""

import os

import pytest

from attn2ssm.paths import apply_umask, staging_dir


@pytest.mark.parametrize(("umask", "folder", "file"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_a_staging_folder_and_its_files_follow_the_umask(tmp_path, umask, folder, file):
    old = os.umask(umask)
    try:
        staging = staging_dir(tmp_path / "out", "test")
        assert staging.stat().st_mode & 0o777 == folder  # mkdtemp alone gives 0700
        (staging / "sub").mkdir(mode=0o700)
        private = staging / "sub" / "model.safetensors"
        private.write_bytes(b"x")
        private.chmod(0o600)  # as safetensors writes it
        script = staging / "run.sh"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o700)
        apply_umask(staging)
    finally:
        os.umask(old)
    assert (staging / "sub").stat().st_mode & 0o777 == folder
    assert private.stat().st_mode & 0o777 == file
    assert script.stat().st_mode & 0o777 == folder  # an executable keeps its x bits
