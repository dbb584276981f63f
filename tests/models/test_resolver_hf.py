"""Models named as on the Hugging Face Hub (`owner/repo[:QUANT]`, `hf.co/...`, huggingface.co URLs), and catalog
entries that pin no sha256: the Hub is faked (no network reaches it here), through the two calls the resolver makes,
`HfApi().model_info(files_metadata=True)` (`resolver._hub_api`) and `huggingface_hub.hf_hub_download`."""

from __future__ import annotations

import hashlib
import struct
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from specdec_cli import config
from specdec_cli.cli.commands.models import models_app
from specdec_cli.config import Catalog
from specdec_cli.errors import ChecksumError, ConfigError, ModelError
from specdec_cli.models import resolver
from specdec_cli.models.resolver import HfRef

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def gguf(fill: int) -> bytes:
    """A minimal valid GGUF (one F32 tensor of 8 elements) whose data bytes are `fill`: distinct files, each passing
    `check_gguf`."""

    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + s("general.architecture") + struct.pack("<I", 8) + s("llama")
    head += s("w") + struct.pack("<IQIQ", 1, 8, 0, 0)
    head += b"\0" * (-len(head) % 32)
    return head + bytes([fill]) * 32


REPO_FILES = {
    "README.md": b"# a model card",
    "Model-Q4_K_M.gguf": gguf(1),
    "Model-UD-Q4_K_XL.gguf": gguf(2),
    "Model-Q8_0.gguf": gguf(3),
    "mmproj-F16.gguf": gguf(4),
    "BF16/Model-BF16-00001-of-00002.gguf": gguf(5),
    "BF16/Model-BF16-00002-of-00002.gguf": gguf(6),
}


class FakeHub:
    """One Hub repo per name in `repos` ({path: bytes}); `published` overrides the sha256 the Hub lists for a path.
    Records every call in `calls`; `down` makes every call fail as an unreachable Hub would."""

    def __init__(self, tmp_path: Path, repos: dict[str, dict[str, bytes]]) -> None:
        self.tmp, self.repos = tmp_path, repos
        self.published: dict[str, str] = {}
        self.calls: list[tuple[str, ...]] = []
        self.down = False

    def model_info(self, repo_id: str, *, revision: str | None = None, files_metadata: bool = False):
        from huggingface_hub import errors
        from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling

        self.calls.append(("model_info", repo_id, revision or "main"))
        if self.down:
            raise ConnectionError("the Hub is down")
        if repo_id not in self.repos:
            e = errors.RepositoryNotFoundError.__new__(errors.RepositoryNotFoundError)
            Exception.__init__(e, f"404 {repo_id}")
            raise e
        assert files_metadata, "the sha256 comes with the files' metadata"
        siblings = []
        for path, data in self.repos[repo_id].items():
            sha = self.published.get(path, hashlib.sha256(data).hexdigest())
            lfs = BlobLfsInfo(size=len(data), sha256=sha, pointer_size=134) if path.endswith(".gguf") else None
            siblings.append(RepoSibling(rfilename=path, size=len(data), lfs=lfs))
        return SimpleNamespace(sha=COMMIT, siblings=siblings)

    def download(self, repo_id, filename, revision, local_files_only):
        self.calls.append(("download", repo_id, filename, revision))
        if self.down:
            raise ConnectionError("the Hub is down")
        blob = self.tmp / "hf-blobs" / repo_id.replace("/", "--") / filename
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(self.repos[repo_id][filename])
        return str(blob)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def hub(tmp_path, monkeypatch) -> FakeHub:
    import huggingface_hub

    fake = FakeHub(tmp_path, {"owner/Model-GGUF": dict(REPO_FILES)})
    monkeypatch.setattr(resolver, "_hub_api", lambda: fake)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.download)
    monkeypatch.setattr(resolver, "_hf_reachable", lambda: True)
    return fake


def empty_catalog() -> Catalog:
    return Catalog({}, {}, "x", "x")


def hf_listing() -> list[str]:
    root = config.cache_dir() / "hf"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.suffix != ".lock")


# --- the names ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, ref",
    [
        ("owner/Model-GGUF", HfRef("owner/Model-GGUF")),
        ("owner/Model-GGUF:Q4_K_M", HfRef("owner/Model-GGUF", "Q4_K_M")),
        ("owner/Model-GGUF:ud-q4_k_xl", HfRef("owner/Model-GGUF", "ud-q4_k_xl")),
        ("hf.co/owner/Model-GGUF:Q8_0", HfRef("owner/Model-GGUF", "Q8_0", explicit=True)),
        ("hf.co/owner/Model-GGUF", HfRef("owner/Model-GGUF", explicit=True)),
        ("huggingface.co/owner/Model-GGUF:q8_0", HfRef("owner/Model-GGUF", "q8_0", explicit=True)),
        ("https://huggingface.co/owner/Model-GGUF", HfRef("owner/Model-GGUF", explicit=True)),
        ("https://huggingface.co/owner/Model-GGUF/", HfRef("owner/Model-GGUF", explicit=True)),
        ("https://huggingface.co/owner/Model-GGUF/tree/main", HfRef("owner/Model-GGUF", explicit=True)),
        ("https://huggingface.co/owner/Model-GGUF/tree/v2", HfRef("owner/Model-GGUF", explicit=True, revision="v2")),
        (
            "https://huggingface.co/owner/Model-GGUF/blob/main/Model-Q8_0.gguf",
            HfRef("owner/Model-GGUF", file="Model-Q8_0.gguf", explicit=True),
        ),
        (
            "https://huggingface.co/owner/Model-GGUF/blob/" + COMMIT + "/Model-Q8_0.gguf",
            HfRef("owner/Model-GGUF", file="Model-Q8_0.gguf", explicit=True, revision=COMMIT),
        ),
        (
            "https://huggingface.co/owner/Model-GGUF/resolve/main/BF16/Model-BF16-00001-of-00002.gguf?download=true",
            HfRef("owner/Model-GGUF", file="BF16/Model-BF16-00001-of-00002.gguf", explicit=True),
        ),
    ],
)
def test_each_name_form_parses(text, ref):
    assert resolver.parse_hf_ref(text) == ref


@pytest.mark.parametrize(
    "text",
    [
        "smollm2-135m",
        "models/model.gguf",
        "./owner/repo",
        "~/owner/repo",
        "/owner/repo",
        "a/b/c",
        "C:/models/x",
        "owner/repo:",
        "hf.co/owner",
    ],
)
def test_paths_and_names_are_not_hub_repos(text):
    assert resolver.parse_hf_ref(text) is None


def test_a_catalog_name_and_an_existing_path_keep_precedence(hub, tmp_path):
    catalog = config.load_catalog()
    with pytest.raises(ModelError, match="'tiny' is a target/draft pair"):  # a catalog name: not a repo "tiny"
        resolver.resolve("tiny", catalog, download=False)
    (tmp_path / "owner" / "Model-GGUF").mkdir(parents=True)  # a local directory of that name wins over the Hub
    with pytest.raises(ModelError, match="is a directory, not a .gguf file"):
        resolver.resolve("owner/Model-GGUF", catalog)
    assert hub.calls == []
    path = resolver.resolve("hf.co/owner/Model-GGUF", catalog)  # hf.co/ always means the Hub
    assert path.read_bytes() == REPO_FILES["Model-Q4_K_M.gguf"]


def test_a_name_that_is_neither_a_file_nor_a_repo_says_both(hub):
    with pytest.raises(ModelError) as e:
        resolver.resolve("owner/no-such-repo:Q4_K_M", empty_catalog())
    assert e.value.message == (
        "owner/no-such-repo:Q4_K_M is not a file, and no Hugging Face repo owner/no-such-repo "
        "was found (or it is private)."
    )


# --- choosing the file --------------------------------------------------------------------------------------------

FILES = list(REPO_FILES)


@pytest.mark.parametrize(
    "quant, chosen",
    [
        (None, "Model-Q4_K_M.gguf"),  # llama.cpp's default
        ("q4_k_m", "Model-Q4_K_M.gguf"),  # case-insensitive
        ("Q8_0", "Model-Q8_0.gguf"),
        ("UD-Q4_K_XL", "Model-UD-Q4_K_XL.gguf"),
        ("q4_k_xl", "Model-UD-Q4_K_XL.gguf"),
    ],
)
def test_quant_matching(quant, chosen):
    assert resolver.select_files(FILES, HfRef("o/r", quant)) == [chosen]


def test_default_falls_back_to_q8_0_then_the_first_model_file_never_a_projector():
    assert resolver.select_files([f for f in FILES if "Q4_K_M" not in f], HfRef("o/r")) == ["Model-Q8_0.gguf"]
    assert resolver.select_files(["mmproj-F16.gguf", "z-F16.gguf", "a-imatrix.gguf"], HfRef("o/r")) == ["z-F16.gguf"]


def test_shortest_name_wins_among_matches():
    files = ["Model-UD-Q4_K_M.gguf", "Model-Q4_K_M-v2.gguf", "Model-Q4_K_M.gguf"]  # the longest sorts first
    assert resolver.select_files(files, HfRef("o/r", "Q4_K_M")) == ["Model-Q4_K_M.gguf"]


def test_no_matching_quant_lists_the_quants_there_are():
    with pytest.raises(ModelError) as e:
        resolver.select_files(FILES, HfRef("owner/Model-GGUF", "Q5_K_S"))
    assert e.value.message == "owner/Model-GGUF has no Q5_K_S file; its quants: BF16, Q4_K_M, Q8_0, UD-Q4_K_XL."
    assert e.value.fix == "Name one, e.g. owner/Model-GGUF:Q4_K_M."


def test_a_repo_without_gguf_files_is_one_line():
    with pytest.raises(ModelError) as e:
        resolver.select_files(["README.md", "mmproj-F16.gguf"], HfRef("o/r"))
    assert e.value.message == "o/r holds no GGUF model file."


def test_split_gguf_names_every_part_and_refuses_an_incomplete_one():
    assert resolver.select_files(FILES, HfRef("o/r", "bf16")) == [
        "BF16/Model-BF16-00001-of-00002.gguf",
        "BF16/Model-BF16-00002-of-00002.gguf",
    ]
    with pytest.raises(ModelError) as e:
        resolver.select_files(FILES[:-1], HfRef("o/r", "BF16"))
    assert e.value.message == (
        "o/r: the split GGUF BF16/Model-BF16-00001-of-00002.gguf is incomplete "
        "(missing Model-BF16-00002-of-00002.gguf)."
    )


# --- fetching, verifying, caching ---------------------------------------------------------------------------------


def test_resolved_file_is_verified_and_cached_under_the_repo(hub):
    path = resolver.resolve("hf.co/owner/Model-GGUF:q8_0", empty_catalog())
    assert path == config.cache_dir() / "hf" / "owner" / "Model-GGUF" / "Model-Q8_0.gguf"
    assert path.read_bytes() == REPO_FILES["Model-Q8_0.gguf"]
    assert resolver._read_marker(path) == hashlib.sha256(REPO_FILES["Model-Q8_0.gguf"]).hexdigest()
    assert ("download", "owner/Model-GGUF", "Model-Q8_0.gguf", COMMIT) in hub.calls  # the commit it was listed at
    assert not resolver.is_catalog_file(path)  # not pinned by us: host.probe_load still tries it once


def test_sha256_mismatch_is_refused_and_nothing_is_kept(hub):
    hub.published["Model-Q8_0.gguf"] = "0" * 64
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        resolver.resolve("owner/Model-GGUF:Q8_0", empty_catalog())
    assert hf_listing() == []


def test_a_cached_file_is_reused_without_asking_the_hub(hub, monkeypatch):
    first = resolver.resolve("owner/Model-GGUF:Q8_0", empty_catalog())
    hub.calls.clear()
    hub.down = True
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolver.resolve("owner/Model-GGUF:q8_0", empty_catalog()) == first
    assert (
        resolver.resolve("https://huggingface.co/owner/Model-GGUF/blob/main/Model-Q8_0.gguf", empty_catalog()) == first
    )
    assert hub.calls == []


def test_a_truncated_cached_file_is_fetched_again(hub):
    path = resolver.resolve("owner/Model-GGUF:Q8_0", empty_catalog())
    path.write_bytes(path.read_bytes()[:-8])  # the marker stays, the file is short
    hub.calls.clear()
    assert resolver.resolve("owner/Model-GGUF:Q8_0", empty_catalog()).read_bytes() == REPO_FILES["Model-Q8_0.gguf"]
    assert [c[0] for c in hub.calls] == ["model_info", "download"]


def test_not_cached_and_offline_is_one_line_without_a_hub_call(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as e:
        resolver.resolve("owner/Model-GGUF:Q8_0", empty_catalog())
    assert e.value.message == "owner/Model-GGUF:Q8_0 is not in the cache and HF_HUB_OFFLINE is set."
    assert hub.calls == []


def test_split_gguf_fetches_every_part_and_returns_the_first(hub, monkeypatch):
    path = resolver.resolve("owner/Model-GGUF:BF16", empty_catalog())
    assert path.name == "Model-BF16-00001-of-00002.gguf"
    assert (path.parent / "Model-BF16-00002-of-00002.gguf").read_bytes() == REPO_FILES[
        "BF16/Model-BF16-00002-of-00002.gguf"
    ]
    hub.calls.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolver.resolve("owner/Model-GGUF:bf16", empty_catalog()) == path and hub.calls == []
    (path.parent / "Model-BF16-00002-of-00002.gguf").unlink()  # a part gone: not cached whole any more
    assert resolver.cached_hf(HfRef("owner/Model-GGUF", "BF16")) is None


def test_split_gguf_with_a_bad_part_keeps_no_bad_part(hub):
    hub.published["BF16/Model-BF16-00002-of-00002.gguf"] = "0" * 64
    with pytest.raises(ChecksumError):
        resolver.resolve("owner/Model-GGUF:BF16", empty_catalog())
    assert "owner/Model-GGUF/Model-BF16-00002-of-00002.gguf" not in hf_listing()
    assert resolver.cached_hf(HfRef("owner/Model-GGUF", "BF16")) is None


# --- catalog entries that pin no sha256 ---------------------------------------------------------------------------

USER_CATALOG = """
[models.unpinned]
description = "a model verified against the Hub's sha256"
file = "unpinned.gguf"
kind = "hybrid"
rollback = "snapshots"
mtp = true
ci = false

[[models.unpinned.sources]]
kind = "hf"
repo = "owner/Model-GGUF"
file = "Model-Q8_0.gguf"
"""


def write_user_catalog(text: str = USER_CATALOG) -> Path:
    path = config.user_catalog_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_an_unpinned_catalog_entry_is_verified_against_the_hub(hub, monkeypatch):
    write_user_catalog()
    catalog = config.load_catalog()
    spec = catalog.models["unpinned"]
    assert (spec.size, spec.sources[0].sha256, spec.kind, spec.rollback, spec.mtp, spec.ci) == (
        None,
        None,
        "hybrid",
        "snapshots",
        True,
        False,
    )
    path = resolver.resolve("unpinned", catalog)
    assert path == config.cache_dir() / "unpinned.gguf" and path.read_bytes() == REPO_FILES["Model-Q8_0.gguf"]
    hub.calls.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolver.is_present(spec) and resolver.resolve("unpinned", catalog) == path and hub.calls == []


def test_an_unpinned_catalog_entry_with_the_wrong_content_is_not_kept(hub):
    write_user_catalog()
    hub.published["Model-Q8_0.gguf"] = "0" * 64
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        resolver.resolve("unpinned", config.load_catalog())
    assert not (config.cache_dir() / "unpinned.gguf").exists()


def test_an_unpinned_catalog_entry_offline_says_why():
    write_user_catalog()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(
            ModelError,
            match="its sha256 is not pinned and the Hub, which publishes it, cannot be "
            r"asked \(HF_HUB_OFFLINE is set\)",
        ):
            resolver.resolve("unpinned", config.load_catalog())


@pytest.mark.parametrize(
    "line, error",
    [
        ('kind = "mamba"', "models.bad.kind: expected one of 'transformer', 'hybrid', 'recurrent'"),
        ('rollback = "rewind"', "models.bad.rollback: expected one of 'kv', 'snapshots', 'checkpoints'"),
        ('mtp = "yes"', "models.bad.mtp: expected true or false"),
    ],
)
def test_new_catalog_fields_are_validated(line, error):
    path = write_user_catalog(f"""
    [models.bad]
    description = "d"
    file = "bad.gguf"
    {line}

    [[models.bad.sources]]
    kind = "hf"
    repo = "o/r"
    file = "bad.gguf"
    """)
    with pytest.raises(ConfigError) as e:
        config.load_catalog()
    assert e.value.message.startswith(f"{path}: {error}")


def test_a_pinned_sha256_still_needs_its_size():
    write_user_catalog(f"""
    [models.bad]
    description = "d"
    file = "bad.gguf"

    [[models.bad.sources]]
    kind = "hf"
    repo = "o/r"
    file = "bad.gguf"
    sha256 = "{"a" * 64}"
    """)
    with pytest.raises(ConfigError, match="models.bad: missing key 'size'"):
        config.load_catalog()


# --- the built-in catalog -----------------------------------------------------------------------------------------


def test_builtin_catalog_lists_the_2026_families_unpinned_and_not_in_ci():
    c = config.load_catalog()
    expect = {  # name: (kind, rollback, mtp, swa)
        "qwen3.5-0.8b": ("hybrid", "snapshots", False, False),
        "qwen3.5-0.8b-mtp": ("hybrid", "snapshots", True, False),
        "qwen3.6-27b-mtp": ("hybrid", "snapshots", True, False),
        "lfm2-1.2b": ("hybrid", "snapshots", False, False),
        "lfm2.5-1.2b": ("hybrid", "snapshots", False, False),
        "gemma3-4b": ("transformer", "kv", False, True),
        "gemma4-31b": ("transformer", "kv", False, True),
        "nemotron-nano-9b-v2": ("hybrid", "snapshots", False, False),
        "granite-4.0-h-micro": ("hybrid", "checkpoints", False, False),
    }
    for name, want in expect.items():
        m = c.models[name]
        assert (m.kind, m.rollback, m.mtp, m.swa) == want, name
    new = [m for m in c.models.values() if not m.ci]
    assert {m.name for m in new} >= expect.keys()
    assert all(m.size is None and all(s.kind == "hf" and s.sha256 is None for s in m.sources) for m in new)
    assert len({m.file for m in c.models.values()}) == len(c.models)  # no two entries share a cache file
    for pair in ("qwen3.5", "lfm2", "lfm2.5", "gemma3", "gemma4", "granite-4.0-h"):
        assert c.pairs[pair].target in c.models and c.pairs[pair].draft in c.models


def test_docs_models_md_names_every_catalog_model_with_its_kind_and_rollback():
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    for m in config.load_catalog().models.values():
        if m.ci:
            assert f"| `{m.name}` |" in text, m.name
            continue
        row = next((r for r in rows.values() if f"`{m.name}`" in r), None)
        assert row is not None, f"docs/models.md lacks {m.name}"
        cells = [c.strip() for c in row.split("|")]
        assert cells[3].startswith(m.kind) and cells[4] == m.rollback, m.name


def test_the_models_the_tests_pull_are_untouched():
    c = config.load_catalog()
    pins = {
        "qwen2.5-coder-1.5b": ("cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
        "qwen2.5-coder-0.5b": ("1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
        "smollm2-135m": ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432),
        "gemma3-270m": ("a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024),
    }
    for name, (sha, size) in pins.items():
        m = c.models[name]
        assert m.ci and m.pinned and (m.sha256s, m.size) == ({sha}, size), name
        assert (m.kind, m.rollback, m.mtp, m.swa) == ("transformer", "kv", False, False), name


# --- the CLI ------------------------------------------------------------------------------------------------------

runner = CliRunner()


def test_models_pull_takes_a_hub_repo_and_skips_it_once_cached(hub):
    result = runner.invoke(models_app, ["pull", "hf.co/owner/Model-GGUF:Q8_0"])
    assert result.exit_code == 0, result.output
    path = config.cache_dir() / "hf" / "owner" / "Model-GGUF" / "Model-Q8_0.gguf"
    assert str(path) in result.output and path.read_bytes() == REPO_FILES["Model-Q8_0.gguf"]
    hub.calls.clear()
    result = runner.invoke(models_app, ["pull", "owner/Model-GGUF:Q8_0"])
    assert result.exit_code == 0 and "already present" in result.output and hub.calls == []


def test_models_pull_no_such_quant_exits_3_with_the_quants(hub):
    result = runner.invoke(models_app, ["pull", "owner/Model-GGUF:Q2_K"])
    assert isinstance(result.exception, ModelError) and result.exception.exit_code == 3
    assert "its quants: BF16, Q4_K_M, Q8_0, UD-Q4_K_XL" in result.exception.message


def test_models_pull_all_skips_the_models_not_in_ci(monkeypatch):
    fetched = []
    monkeypatch.setattr(resolver, "fetch", lambda spec, reporter=None: fetched.append(spec.name) or Path("x"))
    monkeypatch.setattr(resolver, "is_present", lambda spec: False)
    result = runner.invoke(models_app, ["pull", "--all"])
    assert result.exit_code == 0, result.output
    assert sorted(fetched) == ["gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"]
    assert "skipped" in result.output and "qwen3.5-0.8b-mtp" in result.output


def test_models_list_shows_kind_rollback_mtp_and_not_in_ci():
    result = runner.invoke(models_app, ["list"])
    assert result.exit_code == 0, result.output
    out = result.output
    header = next(line for line in out.splitlines() if "rollback" in line)
    assert "kind" in header and "MTP" in header
    row = next(line for line in out.splitlines() if "qwen3.5-0.8b-mtp" in line)
    assert "hybrid" in row and "snapshots" in row and "✓" in row
    gemma = next(line for line in out.splitlines() if "gemma4-31b" in line)
    assert "transformer, SWA" in gemma and "kv" in gemma
    assert "(not in CI)" in out
    smollm2 = out.split("smollm2-135m", 1)[1].split("\n", 2)[1]  # the line under its name
    assert "(not in CI)" not in smollm2


def test_a_hub_that_fails_is_one_line_naming_the_repo(hub):
    hub.down = True
    with pytest.raises(ModelError) as e:
        resolver.resolve("owner/Model-GGUF:Q8_0", empty_catalog())
    assert (
        e.value.message == "Could not list owner/Model-GGUF on the Hugging Face Hub: ConnectionError: the Hub is down."
    )
    assert hf_listing() == []


def test_a_url_s_revision_is_the_one_listed(hub):
    path = resolver.resolve("https://huggingface.co/owner/Model-GGUF/tree/v2", empty_catalog())
    assert path.name == "Model-Q4_K_M.gguf" and ("model_info", "owner/Model-GGUF", "v2") in hub.calls
