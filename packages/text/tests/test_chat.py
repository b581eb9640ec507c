"""Chat templates: the built-in renderer (no jinja2) reproduces HF's jinja2 renderings."""

import json
import pathlib

import pytest

from jaxlearn.text.chat import HAVE_JINJA2, ChatTemplate, detect_family
from jaxlearn.text.errors import ChatTemplateError

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
DATA = json.loads((FIXTURES / "chat_templates.json").read_text())
CASES = DATA["cases"]


def _id(case):
    gen = "gen" if case["add_generation_prompt"] else "nogen"
    return f"{case['name']}-{case['conversation']}-{gen}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_builtin_renderer_matches_hf_jinja(case):
    template = ChatTemplate(
        DATA["templates"][case["name"]],
        bos_token=case["bos_token"],
        eos_token=case["eos_token"],
        use_jinja=False,
    )
    assert (
        template.engine
        == f"builtin:{case['name'].replace('smollm2', 'chatml').replace('qwen2', 'chatml')}"
    )
    got = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert got == case["expected"]


@pytest.mark.skipif(not HAVE_JINJA2, reason="jinja2 is not installed")
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_jinja_renderer_matches_hf(case):
    template = ChatTemplate(
        DATA["templates"][case["name"]], bos_token=case["bos_token"], eos_token=case["eos_token"]
    )
    got = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert got == case["expected"]


def test_family_detection():
    assert detect_family(DATA["templates"]["smollm2"]) == "chatml"
    assert detect_family(DATA["templates"]["llama3"]) == "llama3"
    assert detect_family("{{ messages }}") is None


def test_unknown_template_without_jinja_is_a_clear_error():
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", use_jinja=False)
    assert template.engine == "builtin:unknown"
    with pytest.raises(ChatTemplateError, match="jinja2"):
        template.render([{"role": "user", "content": "hi"}])


def test_builtin_rejects_non_text_content_and_bad_messages():
    template = ChatTemplate(DATA["templates"]["smollm2"], use_jinja=False)
    with pytest.raises(ChatTemplateError, match="text only"):
        template.render([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ChatTemplateError, match="role and content"):
        template.render([{"content": "no role"}])


def test_mistral_builtin_enforces_alternation():
    template = ChatTemplate(DATA["templates"]["mistral"], use_jinja=False, bos_token="<s>")
    with pytest.raises(ChatTemplateError, match="alternate"):
        template.render([{"role": "assistant", "content": "x"}])
