"""The spool is private: another local user can neither read spooled states nor slip frames in."""

from __future__ import annotations

import os

import pytest

from sglang_patch.spool import Spool, SpoolDirectoryError, check_private_directory


def test_a_new_spool_directory_is_private_and_frames_are_kept_in_order(tmp_path) -> None:
    spool = Spool(tmp_path / "spool" / "dp0", max_bytes=1000)
    assert os.stat(tmp_path / "spool" / "dp0").st_mode & 0o777 == 0o700
    assert spool.put(b"first") and spool.put(b"second") and not spool.put(b"x" * 1000)
    assert all(os.stat(path).st_mode & 0o777 == 0o600 for path, _ in spool.oldest(1000))
    assert [frame for _, frame in spool.oldest(1000)] == [b"first", b"second"]
    assert [frame for _, frame in spool.oldest(1)] == [b"first"]  # at least one, then what fits
    reopened = Spool(tmp_path / "spool" / "dp0", max_bytes=1000)  # a restart keeps and orders what waits
    assert len(reopened) == 2 and reopened.num_bytes == len(b"firstsecond")
    reopened.remove(reopened.oldest(1)[0][0])
    assert [frame for _, frame in reopened.oldest(1000)] == [b"second"] and reopened.num_bytes == 6


def test_a_directory_others_can_read_is_refused(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(SpoolDirectoryError, match="must be private: chmod 700"):
        Spool(shared, max_bytes=1000)


def test_a_symlinked_directory_is_refused(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(SpoolDirectoryError, match="symlink"):
        check_private_directory(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_a_directory_of_another_user_is_refused(tmp_path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 12345, 12345)
    with pytest.raises(SpoolDirectoryError, match="belongs to uid 12345"):
        check_private_directory(foreign)


def test_a_planted_symlink_is_never_written_through(tmp_path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1000)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (tmp_path / "spool" / ".0000000000000000.frame.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        spool.put(b"frame")
    assert victim.read_bytes() == b"untouched" and len(spool) == 0
