"""The staging directory: ownership, parts, commits, removal and the sweep of dead owners."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lora_contract.errors import ErrorCode, LoraVersionError
from sglang_ext.staging import StagingArea, sweep_dead_owners

KEY = ("lv:p:e:v:0123456789abcdef", "a" * 32)


@pytest.fixture
def area(tmp_path: Path) -> StagingArea:
    a = StagingArea(tmp_path)
    yield a
    a.close()


def test_the_owner_directory_is_private_and_named_for_the_sweep(area: StagingArea, tmp_path: Path) -> None:
    assert area.root.parent == tmp_path
    assert stat.S_IMODE(area.root.stat().st_mode) == 0o700
    assert area.root.name.startswith(f"sglang-lora-versions-{os.getpid()}-")


def test_a_part_is_written_through_its_mapping_and_committed_by_rename(area: StagingArea) -> None:
    part = area.new_part(10)
    assert part.path.parent == area.root and part.path.stat().st_size == 10
    part.view[0:10] = b"0123456789"
    area.attempt_dir(KEY)
    area.commit_part(KEY, part, 3)
    files = area.bucket_files(KEY)
    assert [f.name for f in files] == ["bucket-00003.safetensors"]
    assert files[0].read_bytes() == b"0123456789" and not part.path.exists()
    assert not list(area.root.glob("*.part"))


def test_discard_and_remove_leave_nothing(area: StagingArea) -> None:
    part = area.new_part(4)
    StagingArea.discard_part(part)
    assert not part.path.exists()
    area.commit_part(KEY, area.new_part(1), 0)
    area.write_config(KEY, b"{}")
    d = area.attempt_dir(KEY)
    area.remove(KEY)
    assert not d.exists() and not area.has_attempt(KEY) and area.bucket_files(KEY) == []
    assert list(area.root.iterdir()) == []


def test_an_empty_part_needs_no_mapping(area: StagingArea) -> None:
    part = area.new_part(0)
    assert len(part.view) == 0 and part.path.stat().st_size == 0
    StagingArea.discard_part(part)


def test_close_removes_the_owner_directory(tmp_path: Path) -> None:
    a = StagingArea(tmp_path)
    a.commit_part(KEY, a.new_part(8), 0)
    a.close()
    assert not a.root.exists()


def test_a_version_larger_than_the_free_room_is_refused(area: StagingArea) -> None:
    st = os.statvfs(area.root)
    with pytest.raises(LoraVersionError) as info:
        area.check_room(st.f_bavail * st.f_frsize + 1, "version x")
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE
    area.check_room(1024, "version y")


def test_dead_owners_are_swept_and_live_or_foreign_ones_kept(tmp_path: Path) -> None:
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dead = tmp_path / f"sglang-lora-versions-{dead_pid}-0123456789ab"
    (dead / "attempt-0").mkdir(parents=True)
    (dead / "attempt-0" / "bucket-00000.safetensors").write_bytes(b"x")
    live = tmp_path / f"sglang-lora-versions-{os.getpid()}-ba9876543210"
    live.mkdir()
    foreign = tmp_path / "sglang-lora-versions-notapid"
    foreign.mkdir()
    assert sweep_dead_owners(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and foreign.exists()
    # a new staging area sweeps at start
    dead.mkdir()
    StagingArea(tmp_path).close()
    assert not dead.exists()


def test_only_exactly_the_planned_bucket_files_may_reach_a_load(area: StagingArea) -> None:
    for i in range(2):
        area.commit_part(KEY, area.new_part(1), i)
    area.check_bucket_files(KEY, 2)
    for bad in (1, 3):  # a file too many, a file missing
        with pytest.raises(LoraVersionError) as info:
            area.check_bucket_files(KEY, bad)
        assert info.value.code is ErrorCode.MANIFEST_MISMATCH
    (area.attempt_dir(KEY) / "bucket-00007.safetensors").write_bytes(b"x")  # a stray one
    with pytest.raises(LoraVersionError):
        area.check_bucket_files(KEY, 2)
