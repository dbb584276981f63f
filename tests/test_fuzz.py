"""Fuzzing (hypothesis, bounded for CI): the models.toml parser, the prompt reader and the drafters' token inputs.

Properties: the catalog loader either returns a catalog or raises ConfigError (one line, naming the file); the prompt
reader either returns non-empty text or raises UsageError; every drafter, on any int32 context (empty, one token,
huge ids, long runs of one token), returns at most k int32 tokens and leaves the context untouched.
"""

from __future__ import annotations

import io
import json
import string
import textwrap

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import FakeBackend, hashed_logits
from specdec_cli.cli.inputs import read_prompt
from specdec_cli.config import load_catalog
from specdec_cli.core.sampling import GREEDY, SamplingParams
from specdec_cli.drafters.auto import AutoDrafter
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.drafters.suffix import SuffixDrafter
from specdec_cli.errors import ConfigError, UsageError
from specdec_cli.stores.suffix_store import SuffixStore

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SHA = "ab" * 32

# -- models.toml ------------------------------------------------------------------------------------------------------

VALID = textwrap.dedent(f"""\
    [defaults]
    target = "mine"

    [pairs.p]
    target = "mine"
    draft = "smollm2-135m"

    [models.mine]
    description = "a user model"
    file = "mine.gguf"
    size = 123

    [[models.mine.sources]]
    kind = "hf"
    repo = "someone/mine-GGUF"
    file = "mine.gguf"
    sha256 = "{SHA}"

    [[models.mine.sources]]
    kind = "pypi"
    sha256 = "{SHA}"
    wheels = [{{ package = "mine-model", version = "1.0", member = "mine_model/m.gguf" }}]
    """)

KEYS = [
    "defaults",
    "models",
    "pairs",
    "target",
    "draft",
    "description",
    "file",
    "size",
    "sources",
    "kind",
    "hf",
    "pypi",
    "repo",
    "revision",
    "sha256",
    "wheels",
    "package",
    "version",
    "member",
    "mine",
    "smollm2-135m",
]
scalars = st.one_of(
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["mine", "smollm2-135m", "mine.gguf", "../x.gguf", SHA, "hf", "pypi", "-e", "a/b", "", "x" * 70]),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(KEYS) | st.text(string.ascii_letters, min_size=1, max_size=5), inner, max_size=4
        ),
    ),
    max_leaves=12,
)


def toml_value(v) -> str:
    """An inline TOML value (strings through json.dumps; a few come out invalid, which is a ConfigError too)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def check_catalog(path, text: str) -> None:
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        catalog = load_catalog(path)
    except ConfigError as e:
        assert str(path) in str(e) or "built-in" in str(e)
        assert "\n" not in e.message and e.exit_code == 6
    else:
        assert catalog.default_target in catalog.models and catalog.default_draft in catalog.models


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(KEYS), values, max_size=4))
def test_catalog_from_random_documents(tmp_path, doc):
    check_catalog(tmp_path / "models.toml", "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in doc.items()))


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID)), st.integers(0, 6), st.text(max_size=4)), max_size=4))
def test_catalog_from_a_mangled_valid_file(tmp_path, edits):
    text = VALID
    for at, cut, insert in edits:
        text = text[:at] + insert + text[at + cut :]
    check_catalog(tmp_path / "models.toml", text)


def test_the_unmangled_catalog_is_valid(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(VALID)
    assert "mine" in load_catalog(path).models


@FUZZ
@given(data=st.binary(max_size=300))
def test_catalog_from_random_bytes(tmp_path, data):
    path = tmp_path / "models.toml"
    path.write_bytes(data)
    try:
        load_catalog(path)
    except ConfigError as e:
        assert "\n" not in e.message


# -- the prompt reader ------------------------------------------------------------------------------------------------


def check_prompt(read, data: bytes) -> None:
    try:
        text = read()
    except UsageError as e:
        assert "\n" not in str(e) and e.exit_code == 2
        return
    assert text.strip() and not text.startswith("\ufeff")
    assert data.decode("utf-8").removeprefix("\ufeff") == text


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=200),
        st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.text(max_size=50).map(lambda s: ("\ufeff" + s).encode("utf-8", "surrogatepass")),
    )
)
def test_prompt_reader_on_random_bytes_from_a_file_and_from_stdin(tmp_path, data):
    path = tmp_path / "prompt.txt"
    path.write_bytes(data)
    check_prompt(lambda: read_prompt(str(path)), data)
    check_prompt(lambda: read_prompt("-", stdin=io.TextIOWrapper(io.BytesIO(data))), data)


# -- drafters ---------------------------------------------------------------------------------------------------------

INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
TOKENS = st.integers(0, (1 << 31) - 1)
contexts = st.one_of(
    st.just([]),
    st.lists(INT32, min_size=1, max_size=1),
    st.lists(TOKENS, max_size=60),  # huge ids
    st.lists(st.integers(0, 4), max_size=200),  # small alphabet: many repeats and matches
    st.tuples(st.integers(0, (1 << 31) - 1), st.integers(1, 300)).map(lambda t: [t[0]] * t[1]),  # one token repeated
)
SAMPLING = [GREEDY, SamplingParams(temperature=0.8, seed=1)]


def check_draft(drafter, context: list[int], k: int, sampling: SamplingParams) -> None:
    ctx = np.asarray(context, dtype=np.int32)
    before = ctx.copy()
    draft = drafter.propose(ctx, k, sampling, np.random.default_rng(0))
    assert np.array_equal(ctx, before)  # the context is not modified
    assert draft.tokens.dtype == np.int32 and draft.tokens.ndim == 1 and len(draft.tokens) <= k
    assert 0.0 <= draft.score <= 1.0
    if draft.dists is not None:
        assert len(draft.dists) == len(draft.tokens)


@FUZZ
@given(context=contexts, k=st.integers(1, 16), n=st.tuples(st.integers(1, 4), st.integers(0, 4)))
def test_ngram_drafter_on_any_context(context, k, n):
    drafter = NgramDrafter(n[0], n[0] + n[1])
    check_draft(drafter, context, k, GREEDY)
    draft = drafter.propose(np.asarray(context, np.int32), k, GREEDY, np.random.default_rng(0))
    if len(draft):  # a copy of tokens that followed an earlier occurrence: a slice of the context after its start
        text = "," + ",".join(map(str, context[1:])) + ","
        assert "," + ",".join(map(str, draft.tokens.tolist())) + "," in text


@FUZZ
@given(history=st.lists(contexts, max_size=3), context=contexts, k=st.integers(1, 16))
def test_suffix_drafter_on_any_context_and_store(tmp_path, history, context, k):
    store = SuffixStore(tmp_path / "suffix" / "s.npz", fingerprint=SHA)
    drafter = SuffixDrafter(store, preload=False)
    for doc in history:  # learn earlier outputs, including empty and huge-id ones
        drafter.finish(np.zeros(0, np.int32), np.asarray(doc, np.int32))
    drafter.begin(np.asarray(context, np.int32))
    check_draft(drafter, context, k, GREEDY)
    check_draft(drafter, context + context[:3], k, GREEDY)  # an extended context reuses the local index
    drafter.close()


@FUZZ
@given(
    context=st.one_of(contexts, st.lists(st.integers(0, 31), min_size=1, max_size=80)),
    k=st.integers(1, 8),
    sampling=st.sampled_from(SAMPLING),
)
def test_auto_drafter_with_a_fake_model_on_any_context(tmp_path, context, k, sampling):
    model = ModelDrafter(FakeBackend(hashed_logits, n_ctx=1024))
    drafter = AutoDrafter(SuffixDrafter(None), model)
    check_draft(drafter, context, k, sampling)  # the model's draft
    check_draft(drafter, context[: max(1, len(context) // 2)], k, sampling)  # shorter: the model's cache rolls back
    assert len(model.backend.tokens) <= len(context) + k
    for draft in drafter.lookup(np.asarray(context, np.int32), k, sampling, np.random.default_rng(0)):
        assert 1 <= len(draft) <= k and draft.dists is None and draft.match_len >= 1  # free drafts carry evidence


def test_model_drafter_on_an_empty_context_proposes_nothing_and_leaves_its_cache():
    backend = FakeBackend(hashed_logits)
    backend.decode([3, 4, 5])
    draft = ModelDrafter(backend).propose(np.zeros(0, np.int32), 4, GREEDY, np.random.default_rng(0))
    assert len(draft) == 0 and draft.tokens.dtype == np.int32
    assert backend.tokens.tolist() == [3, 4, 5] and backend.truncations == []
