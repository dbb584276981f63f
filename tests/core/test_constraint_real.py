"""Constrained generation on a real model (SmolLM2-135M): grammar-aware speculation against constrained plain
decoding, up to numerical near-ties, and replies valid against their schema."""

from __future__ import annotations

import json

import pytest

from specdec_cli.core import constraint
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Finish, Step
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.measure.audit import audit_output
from specdec_cli.models.llama import LlamaBackend

pytestmark = pytest.mark.real

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
TEXT = (
    "Return the person as JSON with name, age, city and languages.\n\nMarta Oliveira is 34 years old, lives in "
    "Porto and speaks Portuguese, English and French."
)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    target = LlamaBackend(smollm2_path, n_ctx=1024)
    yield target
    target.close()


def generate(engine, prompt, grammar):
    records = list(engine.generate(prompt, GenerationConfig(max_tokens=80, grammar=grammar)))
    steps = [r for r in records if isinstance(r, Step)]
    assert isinstance(records[-1], Finish)
    return [t for s in steps for t in s.emitted], steps, records[-1].finish_reason


@pytest.mark.parametrize("layout", ["inline", "free"])
def test_constrained_speculation_equals_constrained_plain_up_to_near_ties(smol, layout):
    target = smol
    g = constraint.json_schema(SCHEMA, name="test", layout=layout)
    prompt = target.tokenize(
        target.format_chat([{"role": "user", "content": TEXT}]), add_special=False, parse_special=True
    )
    target.truncate(0)
    plain, _, plain_end = generate(SpeculativeEngine(target, None), prompt, g)
    target.truncate(0)
    spec, steps, end = generate(SpeculativeEngine(target, NgramDrafter(1, 3), FixedK(6)), prompt, g)
    assert any(s.source == "grammar" and s.n_accepted for s in steps)  # the schema's keys were drafted free
    # every emitted token is the constrained argmax of plain (batch-1) numerics, or a near-tie
    report = audit_output(target, prompt, spec, ended_with_eog=end == "eog", grammar=g)
    assert report.passed, report.to_dict()
    if spec == plain:
        assert end == plain_end
    for tokens, finish in ((spec, end), (plain, plain_end)):
        if finish == "eog":
            doc = json.loads(b"".join(target.piece(t) for t in tokens).decode())
            assert set(doc) == set(SCHEMA["properties"]) and isinstance(doc["age"], int)
