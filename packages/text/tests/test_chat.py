"""Chat templates: jinja2's sandbox reproduces HF's renderings of real templates, and
refuses templates that run too long or build too much text, quickly and in this thread."""

import json
import pathlib
import re
import threading
import time

import pytest

from jaxlearn.text.chat import ChatLimits, ChatTemplate
from jaxlearn.text.errors import ChatTemplateError

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
DATA = json.loads((FIXTURES / "chat_templates.json").read_text())
CASES = DATA["cases"]
HI = [{"role": "user", "content": "hi"}]


def _id(case):
    gen = "gen" if case["add_generation_prompt"] else "nogen"
    return f"{case['name']}-{case['conversation']}-{gen}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_renders_real_templates_like_hf(case):
    template = ChatTemplate(
        DATA["templates"][case["name"]], bos_token=case["bos_token"], eos_token=case["eos_token"]
    )
    got = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert got == case["expected"]


def test_a_template_can_render_many_times_and_from_threads():
    template = ChatTemplate(DATA["templates"]["llama3"], bos_token="<|begin_of_text|>")
    want = template.render(HI)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(template.render(HI)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 4


@pytest.mark.parametrize(
    "source, limit",
    [
        ("{{ 'x' * 4000000000 }}", "max_output_bytes"),
        ("{{ 4000000000 * 'x' }}", "max_output_bytes"),
        ("{{ ([0] * 100000) * 100000 }}", "max_output_bytes"),
        ("{{ 10 ** 1000000000 }}", "max_output_bytes"),
        ("{{ '%4000000000s' % 'x' }}", "max_output_bytes"),
        ("{{ '{:>4000000000}'.format(1) }}", "max_output_bytes"),
        ("{{ 'x'.ljust(4000000000) }}", "max_output_bytes"),
        ("{{ 'x'|center(4000000000) }}", "max_output_bytes"),
        ("{{ 'x'|indent(4000000000, first=True) }}", "max_output_bytes"),
        ("{{ '\t'.expandtabs(4000000000) }}", "max_output_bytes"),
        ("{{ ('x' * 100000).replace('', 'y' * 100) }}", "max_output_bytes"),
        ("{{ range(100000)|join('y' * 40000) }}", "max_output_bytes"),
        (  # Doubling a string: 2**64 characters.
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "max_output_bytes",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "max_output_bytes",
        ),
        (  # 10**10 iterations writing output.
            "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}"
            "{% endfor %}",
            "max_(output_bytes|seconds)",  # Whichever comes first on this machine.
        ),
        (  # 10**15 iterations writing nothing.
            "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000)"
            " %}{% endfor %}{% endfor %}{% endfor %}",
            "max_seconds",
        ),
    ],
)
def test_runaway_templates_are_refused_fast(source, limit):
    threads = threading.active_count()
    template = ChatTemplate(source, origin="evil/tokenizer_config.json: chat_template",
                            limits=ChatLimits(max_output_bytes=1 << 20, max_seconds=0.5))
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        template.render(HI)
    assert time.monotonic() - start < 3.0
    message = str(e.value)
    assert message.startswith("evil/tokenizer_config.json: chat_template: chat template refused")
    assert re.search(f"ChatLimits.{limit}=", message) and "\n" not in message
    assert threading.active_count() == threads  # Nothing left running.


def test_limits_are_configurable():
    source = "{% for i in range(100) %}{{ messages[0].content }}{% endfor %}"
    assert ChatTemplate(source).render(HI) == "hi" * 100
    with pytest.raises(ChatTemplateError, match="output would be 102 long.*=100"):
        ChatTemplate(source, limits=ChatLimits(max_output_bytes=100)).render(HI)
    with pytest.raises(ChatTemplateError, match="must be positive"):
        ChatLimits(max_seconds=0)


def test_template_errors_name_the_origin():
    compile_error = r"^a\.jinja: chat template does not compile: .*line 1"
    with pytest.raises(ChatTemplateError, match=compile_error):
        ChatTemplate("{% for m in messages %}", origin="a.jinja").render(HI)
    with pytest.raises(ChatTemplateError, match=r"^b\.jinja: chat template raised: roles!"):
        ChatTemplate("{{ raise_exception('roles!') }}", origin="b.jinja").render(HI)
    with pytest.raises(ChatTemplateError, match=r"^c\.jinja: chat template failed: .*undefined"):
        ChatTemplate("{{ nothing.here }}", origin="c.jinja").render(HI)
    with pytest.raises(ChatTemplateError, match="recursion"):
        ChatTemplate("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").render(HI)
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]: expected a dict with role"):
        ChatTemplate("{{ messages }}").render([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("")


def test_sandbox_blocks_python_internals_and_mutation():
    with pytest.raises(ChatTemplateError, match="unsafe|not safely|undefined"):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(HI)
    with pytest.raises(ChatTemplateError, match="unsafe|immutable|not safely"):
        ChatTemplate("{{ messages.append(1) }}").render(HI)
