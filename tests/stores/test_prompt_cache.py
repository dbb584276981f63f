"""The prompt cache (specdec_cli/stores/prompt_cache.py): keying, longest-prefix choice, LRU eviction, atomic writes,
bad files discarded with a warning, permissions, concurrent processes; and on the tiny real model, logits after a
restore equal those of a fresh prefill exactly."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from specdec_cli.errors import StateError
from specdec_cli.stores.prompt_cache import PromptCache, PromptCacheWarning, key_digest

MAGIC = b"FKST"


class StateFake:
    """A backend with a fake KV state: per token `per_token` bytes derived from (position, token), so a state of
    other tokens, a torn file or a mismatched payload is detected by `load_state` like llama.cpp would (StateError).
    `path` is a real file: its identity is part of the key."""

    def __init__(self, path: Path, *, n_ctx: int = 4096, per_token: int = 16) -> None:
        self.path = str(path)
        self.n_ctx = n_ctx
        self.per_token = per_token
        self._toks = np.zeros(0, np.int32)
        self.loads = 0

    @property
    def tokens(self) -> np.ndarray:
        view = self._toks.view()
        view.flags.writeable = False
        return view

    def decode(self, toks) -> None:
        self._toks = np.concatenate([self._toks, np.asarray(toks, np.int32)])

    def truncate(self, n: int) -> None:
        self._toks = self._toks[:n]

    def state_key(self) -> dict:
        return {"fake": 1, "n_ctx": self.n_ctx}

    def _payload(self, toks: np.ndarray) -> bytes:
        cells = (toks.astype(np.int64) * 7 + np.arange(len(toks))) % 251
        return np.repeat(cells.astype(np.uint8), self.per_token).tobytes()

    def save_state(self, path) -> int:
        toks = self._toks
        data = MAGIC + struct.pack("<I", len(toks)) + toks.astype("<i4").tobytes() + self._payload(toks)
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    def load_state(self, path) -> int:
        self._toks = np.zeros(0, np.int32)
        data = Path(path).read_bytes()
        if data[:4] != MAGIC or len(data) < 8:
            raise StateError(f"not a state: {path}")
        (n,) = struct.unpack("<I", data[4:8])
        toks = np.frombuffer(data[8 : 8 + 4 * n], "<i4").astype(np.int32)
        if len(toks) != n or data[8 + 4 * n :] != self._payload(toks) or n > self.n_ctx:
            raise StateError(f"bad state: {path}")
        self._toks = toks
        self.loads += 1
        return n


@pytest.fixture
def model(tmp_path) -> Path:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return p


@pytest.fixture
def cache(tmp_path) -> PromptCache:
    return PromptCache(tmp_path / "prompts")


def seq(n: int, start: int = 100) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def saved(cache: PromptCache, model: Path, toks, **kw) -> int:
    b = StateFake(model, **kw)
    b.decode(toks)
    return cache.save(b)


def headers(cache: PromptCache) -> list[Path]:
    return sorted(cache.directory.glob("*.json"))


# -- restore: keying and the longest prefix ------------------------------------------------------------------------


def test_a_saved_prompt_is_restored_into_a_fresh_backend(cache, model):
    toks = seq(100)
    assert saved(cache, model, toks) > 0
    b = StateFake(model)
    n, ms = cache.restore(b, toks)
    assert n == 100 and ms >= 0 and np.array_equal(b.tokens, toks) and b.loads == 1


def test_the_key_separates_model_files_context_parameters_and_a_changed_file(cache, model, tmp_path):
    toks = seq(100)
    saved(cache, model, toks)
    other = tmp_path / "copy.gguf"
    shutil.copy(model, other)
    assert cache.restore(StateFake(other), toks)[0] == 0  # same bytes, another file
    assert cache.restore(StateFake(model, n_ctx=2048), toks)[0] == 0  # another context
    assert cache.restore(StateFake(model), toks)[0] == 100
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed (or was replaced)
    b = StateFake(model)
    assert cache.restore(b, toks)[0] == 0 and b.loads == 0


def test_the_entry_sharing_the_longest_prefix_wins_and_the_state_is_cut_to_it(cache, model):
    common = seq(40)
    a = np.concatenate([common, seq(60, 1000)])  # shares 40 + 0 with the query
    b_ = np.concatenate([common, seq(30, 2000), seq(50, 3000)])  # shares 40 + 30
    c = seq(200, 5000)  # shares nothing
    for toks in (a, b_, c):
        assert saved(cache, model, toks) > 0
    query = np.concatenate([common, seq(30, 2000), seq(10, 7000)])
    b = StateFake(model)
    n, _ = cache.restore(b, query)
    assert n == 70
    assert np.array_equal(b.tokens, query[:70])  # truncated to the shared prefix, not the whole saved state


def test_a_restore_never_goes_past_the_requested_context(cache, model):
    saved(cache, model, seq(120))
    b = StateFake(model)
    assert cache.restore(b, seq(50))[0] == 50 and np.array_equal(b.tokens, seq(50))


def test_align_cuts_a_partial_restore_to_a_multiple_and_never_a_whole_one(cache, model):
    saved(cache, model, seq(300))
    query = np.concatenate([seq(200), seq(50, 9000)])
    b = StateFake(model)
    assert cache.restore(b, query, align=64)[0] == 192 and np.array_equal(b.tokens, query[:192])
    b = StateFake(model)
    assert cache.restore(b, seq(250), align=64)[0] == 250  # all of the context: nothing to batch differently
    b = StateFake(model)
    assert cache.restore(b, np.concatenate([seq(60), seq(50, 9000)]), align=64)[0] == 0  # 0 < min_tokens


def test_a_shared_prefix_shorter_than_min_tokens_is_not_restored(cache, model):
    saved(cache, model, seq(100))
    query = np.concatenate([seq(31), seq(40, 9000)])
    assert cache.restore(StateFake(model), query)[0] == 0
    query = np.concatenate([seq(32), seq(40, 9000)])
    assert cache.restore(StateFake(model), query)[0] == 32


def test_nothing_is_loaded_when_the_backend_already_holds_as_much(cache, model):
    saved(cache, model, seq(100))
    b = StateFake(model)
    b.decode(seq(80))
    assert cache.restore(b, seq(100))[0] == 100 and b.loads == 1  # 100 > 80: worth it
    b = StateFake(model)
    b.decode(seq(100))
    assert cache.restore(b, seq(120))[0] == 0 and b.loads == 0 and len(b.tokens) == 100


def test_a_miss_on_an_empty_or_missing_directory_does_not_create_it(tmp_path, model):
    cache = PromptCache(tmp_path / "nowhere")
    assert cache.restore(StateFake(model), seq(100))[0] == 0
    assert not cache.directory.exists()


# -- save: prefixes, eviction, atomicity, permissions --------------------------------------------------------------


def test_a_prefix_of_a_saved_state_is_not_saved_again_and_a_longer_state_replaces_its_prefix(cache, model):
    assert saved(cache, model, seq(100)) > 0
    assert saved(cache, model, seq(60)) == 0  # covered by the saved 100
    assert len(headers(cache)) == 1
    assert saved(cache, model, seq(150)) > 0  # covers the saved 100: replaces it
    assert len(headers(cache)) == 1
    assert saved(cache, model, seq(10)) == 0  # below min_tokens
    b = StateFake(model)
    assert cache.restore(b, seq(150))[0] == 150


def test_a_state_with_an_eighth_or_less_new_is_not_written_again(cache, model):
    """An editor's next completion (the last one's state with its last tokens changed) and a conversation's next turn
    are not written, a whole state each time, until more than an eighth of them is in no saved entry: the saved one
    stands for them (touched) and is what a restart restores."""
    assert saved(cache, model, seq(800)) > 0
    edited = np.concatenate((seq(720), seq(100, 5000)))  # the last 80 of 800 changed, 20 more: 100 of 820 new
    assert saved(cache, model, edited) == 0
    assert saved(cache, model, seq(900)) == 0  # a turn of 100: 100 of 900 new
    assert len(headers(cache)) == 1
    b = StateFake(model)
    assert cache.restore(b, edited)[0] == 720  # the saved state, cut to the shared prefix
    assert saved(cache, model, seq(950)) > 0  # 150 of 950 new: written, and it replaces the 800 (its prefix)
    assert len(headers(cache)) == 1
    assert saved(cache, model, np.concatenate((seq(700), seq(250, 5000)))) > 0  # 250 of 950 new: another entry
    assert len(headers(cache)) == 2


def test_least_recently_used_entries_are_evicted_to_stay_under_the_cap(tmp_path, model):
    probe = PromptCache(tmp_path / "probe")
    one = saved(probe, model, seq(100, 0))  # bytes of one entry of 100 tokens
    cache = PromptCache(tmp_path / "prompts", max_bytes=int(2.5 * one))
    a, b_, c = seq(100, 0), seq(100, 1000), seq(100, 2000)
    saved(cache, model, a)
    saved(cache, model, b_)
    for h in headers(cache):  # both used long ago
        os.utime(h, (1e9, 1e9))
    assert cache.restore(StateFake(model), a)[0] == 100  # a is now the most recently used
    saved(cache, model, c)
    assert cache.stats().n_bytes <= cache.max_bytes
    assert cache.restore(StateFake(model), a)[0] == 100
    assert cache.restore(StateFake(model), c)[0] == 100
    assert cache.restore(StateFake(model), b_)[0] == 0  # the least recently used went


def test_a_state_larger_than_the_cap_is_not_kept(tmp_path, model):
    cache = PromptCache(tmp_path / "prompts", max_bytes=1000)
    with pytest.warns(PromptCacheWarning, match="larger than the prompt cache's cap"):
        assert saved(cache, model, seq(100)) == 0
    assert headers(cache) == [] and list(cache.directory.glob("*.state")) == []


def test_files_are_0600_in_a_0700_directory(cache, model):
    saved(cache, model, seq(100))
    assert cache.directory.stat().st_mode & 0o777 == 0o700
    files = [p for p in cache.directory.iterdir()]
    assert {p.suffix or p.name for p in files} == {".json", ".state", ".lock"}
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o600, p.name


class CrashingFake(StateFake):
    def save_state(self, path) -> int:
        with open(path, "wb") as f:
            f.write(MAGIC + b"\0" * 100)  # half a state ...
        os._exit(9)  # ... and the process dies (kill -9, power cut)


def _save_and_crash(directory: str, model: str) -> None:
    b = CrashingFake(Path(model))
    b.decode(seq(100))
    PromptCache(directory).save(b)


def test_a_crash_mid_write_leaves_no_entry_and_the_next_save_cleans_up(cache, model):
    proc = multiprocessing.get_context("fork").Process(target=_save_and_crash, args=(str(cache.directory), str(model)))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 9
    assert headers(cache) == [] and cache.stats().entries == ()
    assert any(".tmp-" in p.name for p in cache.directory.iterdir())  # the torn temp file is there ...
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.restore(StateFake(model), seq(100))[0] == 0  # ... and never read
        assert saved(cache, model, seq(100, 500)) > 0
    assert not any(".tmp-" in p.name for p in cache.directory.iterdir())  # ... and removed by the next save


def test_a_crash_between_the_two_renames_leaves_no_entry(cache, model, monkeypatch):
    """The state is renamed into place first, the header last: killed in between, only an orphan state is left (no
    entry to trust), and the next save removes it."""
    import specdec_cli.stores.prompt_cache as pc

    real_replace, calls = os.replace, []

    def replace_then_die(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process is stopped between the two renames
        real_replace(src, dst)

    monkeypatch.setattr(pc.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        saved(cache, model, seq(100))
    monkeypatch.setattr(pc.os, "replace", real_replace)
    assert headers(cache) == [] and cache.stats().entries == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.restore(StateFake(model), seq(100))[0] == 0
        assert saved(cache, model, seq(100, 500)) > 0
    assert len(list(cache.directory.glob("*.state"))) == 1  # the orphan is gone


def test_a_failed_save_warns_and_leaves_nothing(cache, model):
    class Failing(StateFake):
        def save_state(self, path) -> int:
            Path(path).write_bytes(b"partial")
            raise StateError("llama.cpp could not save the KV state")

    b = Failing(model)
    b.decode(seq(100))
    with pytest.warns(PromptCacheWarning, match="Could not save"):
        assert cache.save(b) == 0
    assert [p.name for p in cache.directory.iterdir()] == [".lock"]


# -- bad files are discarded with a warning, never loaded ----------------------------------------------------------


def _only(cache: PromptCache) -> tuple[Path, Path]:
    (h,) = headers(cache)
    return h, h.with_suffix(".state")


def _restore_warns(cache, model, toks, match) -> StateFake:
    b = StateFake(model)
    with pytest.warns(PromptCacheWarning, match=match):
        assert cache.restore(b, toks)[0] == 0
    assert headers(cache) == [] and list(cache.directory.glob("*.state")) == []
    return b


def test_a_state_with_a_flipped_byte_is_discarded_unloaded(cache, model):
    saved(cache, model, seq(100))
    _, state = _only(cache)
    data = bytearray(state.read_bytes())
    data[-5] ^= 0xFF
    state.write_bytes(bytes(data))
    b = _restore_warns(cache, model, seq(100), "fails its checksum")
    assert b.loads == 0


def test_a_truncated_or_missing_state_is_discarded(cache, model):
    saved(cache, model, seq(100))
    _, state = _only(cache)
    state.write_bytes(state.read_bytes()[:-10])
    _restore_warns(cache, model, seq(100), "header says")
    saved(cache, model, seq(100))
    _only(cache)[1].unlink()
    _restore_warns(cache, model, seq(100), "state file is missing")


def test_a_garbage_header_is_discarded(cache, model):
    saved(cache, model, seq(100))
    header, _ = _only(cache)
    header.write_bytes(b"\x00\xff not json")
    _restore_warns(cache, model, seq(100), "not JSON")


def test_a_foreign_entry_renamed_into_this_key_is_discarded(cache, model, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF another model")
    saved(cache, model, seq(100))
    header, state = _only(cache)
    mine = header.name.split("-")[0]
    ob = StateFake(other)
    ob.decode(seq(100, 3000))
    cache.save(ob)
    (foreign,) = [h for h in headers(cache) if not h.name.startswith(mine)]
    # the other model's entry, renamed so that its file name claims this model's key
    stem = f"{mine}-{foreign.name.split('-')[1].removesuffix('.json')}"
    os.replace(foreign, cache.directory / f"{stem}.json")
    os.replace(foreign.with_suffix(".state"), cache.directory / f"{stem}.state")
    b = StateFake(model)
    with pytest.warns(PromptCacheWarning, match="does not match its name"):
        assert cache.restore(b, seq(100, 3000))[0] == 0
    assert b.loads == 0 and not (cache.directory / f"{stem}.json").exists()
    assert cache.restore(StateFake(model), seq(100))[0] == 100  # this model's own entry is unaffected


def test_a_state_whose_token_list_differs_from_its_header_is_discarded(cache, model):
    """The header and its checksum agree, but the state holds other tokens (e.g. a header written for another
    state): only the token list llama.cpp reads back from the state can tell."""
    import json

    from specdec_cli.stores.prompt_cache import _file_blake2b

    saved(cache, model, seq(100))
    header, state = _only(cache)
    other = StateFake(model)
    other.decode(np.concatenate([seq(50), seq(50, 9000)]))
    other.save_state(state)
    doc = json.loads(header.read_text())
    doc["state_bytes"], doc["state_blake2b"] = _file_blake2b(state)
    header.write_text(json.dumps(doc))
    b = _restore_warns(cache, model, seq(100), "token list inside its state differs")
    assert len(b.tokens) == 0  # what was loaded is not left in the cache


def test_a_state_the_backend_refuses_is_discarded_and_the_backend_left_empty(cache, model):
    saved(cache, model, seq(100))
    b = StateFake(model, per_token=8)  # another payload layout: its load_state refuses the file
    b.decode(seq(10, 7))
    with pytest.warns(PromptCacheWarning, match="bad state"):
        assert cache.restore(b, seq(100))[0] == 0
    assert len(b.tokens) == 0 and headers(cache) == []


# -- two processes -------------------------------------------------------------------------------------------------


def _save_many(directory: str, model: str, base: int, barrier) -> None:
    cache = PromptCache(directory, max_bytes=10**9)
    barrier.wait()
    for i in range(15):
        b = StateFake(Path(model), per_token=512)
        b.decode(seq(64 + i, base + 1000 * i))
        assert cache.save(b) > 0


def test_two_processes_saving_at_once_leave_only_whole_entries(cache, model):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_save_many, args=(str(cache.directory), str(model), base, barrier))
             for base in (0, 500)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(headers(cache)) == 30
    assert not any(".tmp-" in p.name for p in cache.directory.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for base in (0, 500):
            for i in range(15):
                toks = seq(64 + i, base + 1000 * i)
                b = StateFake(model, per_token=512)
                assert cache.restore(b, toks)[0] == len(toks)


# -- stats, clear and the CLI ----------------------------------------------------------------------------------------


def test_stats_lists_entries_and_clear_deletes_them(cache, model):
    assert cache.stats().entries == () and cache.stats().n_bytes == 0
    saved(cache, model, seq(100))
    saved(cache, model, seq(50, 3000))
    s = cache.stats()
    assert [e.n_tokens for e in s.entries] == [50, 100] and all(e.model == "model.gguf" for e in s.entries)
    assert s.n_bytes == sum(e.n_bytes for e in s.entries) and all(e.problem == "" for e in s.entries)
    _only_state = headers(cache)[0].with_suffix(".state")
    _only_state.unlink()
    assert any(e.problem == "its state file is missing" for e in cache.stats().entries)
    assert cache.clear() == 3
    assert cache.stats().entries == () and cache.restore(StateFake(model), seq(100))[0] == 0


def test_key_digest_is_canonical():
    assert key_digest({"a": 1, "b": {"c": 2, "d": 3}}) == key_digest({"b": {"d": 3, "c": 2}, "a": 1})
    assert key_digest({"a": 1}) != key_digest({"a": 2})


def test_cache_stats_and_clear_cover_the_prompt_cache(tmp_path, model, monkeypatch):
    from typer.testing import CliRunner

    from specdec_cli.cli.commands.cache import cache_app

    runner = CliRunner()
    result = runner.invoke(cache_app, ["stats"])
    assert result.exit_code == 0, result.output
    assert "No prompt-cache entries" in result.stderr
    cache = PromptCache()
    assert cache.directory == tmp_path / "prompt-cache"  # conftest's SPECDEC_PROMPT_CACHE
    saved(cache, model, seq(100))
    result = runner.invoke(cache_app, ["stats"])
    assert result.exit_code == 0, result.output
    assert "prompt cache" in result.stdout and "model.gguf" in result.stdout and "100" in result.stdout
    result = runner.invoke(cache_app, ["clear", "--only", "suffix", "--yes"])
    assert result.exit_code == 0 and len(headers(cache)) == 1
    result = runner.invoke(cache_app, ["clear"], input="n\n")
    assert result.exit_code != 0 and len(headers(cache)) == 1
    result = runner.invoke(cache_app, ["clear", "--yes"])
    assert result.exit_code == 0, result.output
    assert headers(cache) == [] and "Deleted 1 prompt-cache entries" in result.stderr
    result = runner.invoke(cache_app, ["clear", "--only", "everything"])
    assert result.exit_code == 2 and "neither suffix nor prompts" in result.output


def test_the_default_directory_is_under_the_cache_dir(tmp_path, monkeypatch):
    from specdec_cli.stores.prompt_cache import default_directory

    monkeypatch.delenv("SPECDEC_PROMPT_CACHE")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert default_directory() == tmp_path / "cache" / "prompts"


# -- the real tiny model ---------------------------------------------------------------------------------------------

TEXT = (
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
)


@pytest.fixture(scope="module")
def llama_backend_cls():
    pytest.importorskip("llama_cpp")
    from specdec_cli.models.llama import LlamaBackend

    return LlamaBackend


def _fresh(cls, path, **kw):
    return cls(path, n_ctx=kw.pop("n_ctx", 1024), n_batch=kw.pop("n_batch", 128), n_threads=2, **kw)


def _next_logits(backend, context, last) -> np.ndarray:
    from specdec_cli.models.backend import sync

    sync(backend, context)
    return backend.decode([last], n_logits=1)[0].copy()


@pytest.mark.real
def test_logits_after_a_restore_equal_a_fresh_prefill_exactly(smollm2_path, llama_backend_cls, tmp_path):
    """The engine's prefill: context = prompt[:-1] evaluated (here over 3 n_batch chunks), then the last token."""
    cache = PromptCache(tmp_path / "prompts")
    a = _fresh(llama_backend_cls, smollm2_path)
    prompt = np.array(a.tokenize(TEXT * 4 + "# Explain merge_sorted.\n"), np.int32)
    context, last = prompt[:-1], int(prompt[-1])
    assert 2 * a.n_batch < len(context) < a.n_ctx
    a.decode(context)
    assert cache.save(a) > 0
    fresh = a.decode([last], n_logits=1)[0].copy()
    a.close()

    b = _fresh(llama_backend_cls, smollm2_path)
    n, ms = cache.restore(b, context)
    assert n == len(context) and np.array_equal(b.tokens, context)
    assert b.n_evaluated == 0  # nothing was evaluated: it came from the file
    restored = b.decode([last], n_logits=1)[0]
    assert np.array_equal(restored, fresh)

    # A longer state restored to a shorter prefix (load, then llama_memory_seq_rm): a new instruction after the code.
    prompt2 = np.array(b.tokenize(TEXT * 4 + "# Add type hints to merge_sorted.\n"), np.int32)
    context2, last2 = prompt2[:-1], int(prompt2[-1])
    shared = int(np.flatnonzero(context2[: len(context)] != context[: len(context2)])[0])
    c = _fresh(llama_backend_cls, smollm2_path)
    n2, _ = cache.restore(c, context2)
    assert n2 == shared and shared >= 32 and np.array_equal(c.tokens, context2[:shared])
    restored2 = _next_logits(c, context2, last2)
    assert c.n_evaluated == len(context2) - shared + 1
    # The reference is a fresh prefill with the same batch boundary: llama.cpp's numerics depend on how tokens are
    # batched (the rest evaluated as its own batch vs inside an n_batch chunk moves smollm2's logits by up to ~0.6),
    # which is the engine's business, not the cache's. The restored KV itself is bit-identical.
    d = _fresh(llama_backend_cls, smollm2_path)
    d.decode(context2[:shared])
    reference = _next_logits(d, context2, last2)
    assert np.array_equal(restored2, reference)
    d.close()

    # With align=n_batch the rest is batched as a cold prefill batches it: equal to the run without any cache.
    e = _fresh(llama_backend_cls, smollm2_path)
    n3, _ = cache.restore(e, context2, align=e.n_batch)
    assert n3 == shared // e.n_batch * e.n_batch > 0
    aligned = _next_logits(e, context2, last2)
    cold = _next_logits(_fresh(llama_backend_cls, smollm2_path), context2, last2)
    assert np.array_equal(aligned, cold)
    e.close()
    b.close()
    c.close()


@pytest.mark.real
def test_a_state_of_another_model_file_or_context_is_refused(smollm2_path, llama_backend_cls, tmp_path):
    cache = PromptCache(tmp_path / "prompts")
    a = _fresh(llama_backend_cls, smollm2_path)
    context = np.array(a.tokenize(TEXT * 4), np.int32)
    a.decode(context)
    assert cache.save(a) > 0
    a.close()
    # another model file (a copy: same bytes, another file) and another context size: not this key
    copy = tmp_path / "copy.gguf"
    shutil.copy(smollm2_path, copy)
    b = _fresh(llama_backend_cls, copy)
    assert cache.restore(b, context)[0] == 0 and len(b.tokens) == 0
    b.close()
    small = _fresh(llama_backend_cls, smollm2_path, n_ctx=128, n_batch=64)
    assert cache.restore(small, context)[0] == 0
    # and llama.cpp's own check, for a file that gets past the key: more tokens than the context holds
    (state,) = cache.directory.glob("*.state")
    assert len(context) > small.n_ctx
    small.decode(context[:10])
    with pytest.raises(StateError, match="refused"):
        small.load_state(state)
    assert len(small.tokens) == 0
    small.decode(context[:10], n_logits=1)  # the cache is usable (empty, consistent) after the refusal
    garbage = tmp_path / "garbage.state"
    garbage.write_bytes(b"GGSQ" + b"\x07" * 64)
    with pytest.raises(StateError):
        small.load_state(garbage)
    assert len(small.tokens) == 0
    small.close()
