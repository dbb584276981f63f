"""`specdec_cli.files`: the atomic writes every store uses, on a platform that refuses to flush a read-only handle
(Windows: `os.fsync` of a file opened read-only fails with EBADF), simulated here with `fcntl`."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from specdec_cli import files


@pytest.fixture
def windows_fsync(monkeypatch) -> list[int]:
    """os.fsync as Windows has it: EBADF for a descriptor opened read-only. Returns the descriptors flushed."""
    real = os.fsync
    flushed: list[int] = []

    def fsync(fd: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        real(fd)
        flushed.append(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return flushed


def test_every_atomic_write_works_where_a_read_only_handle_cannot_be_flushed(tmp_path, windows_fsync):
    target = tmp_path / "learnt.json"
    assert files.write_atomic(target, "{}") == 2
    assert target.read_text() == "{}" and target.stat().st_mode & 0o777 == files.PRIVATE
    assert files.write_atomic(target, b"\x00\x01") == 2 and target.read_bytes() == b"\x00\x01"

    marker = tmp_path / "model.gguf.sha256"  # the resolver's marker: a user-visible file, public mode
    files.write_atomic(marker, "ab  model.gguf\n", private=False)
    assert marker.read_text() == "ab  model.gguf\n"

    header, state = tmp_path / "entry.json", tmp_path / "entry.state"  # the prompt cache: nested, state first
    with files.staged(header) as tmp_header, files.staged(state) as tmp_state:
        with open(tmp_state, "wb") as f:  # a writer of its own (numpy, llama.cpp)
            f.write(b"kv")
        tmp_header.write_text("{}")
    assert state.read_bytes() == b"kv" and header.read_text() == "{}"

    files.fsync_file(target)
    files.fsync_dir(tmp_path)  # never fatal, whatever the platform says
    assert windows_fsync  # the files were flushed, through handles opened for writing
    assert not list(tmp_path.glob(".*.tmp-*"))  # no temporary left behind
