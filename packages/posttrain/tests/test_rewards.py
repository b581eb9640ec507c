"""Built-in rewards against hand-checked cases and a property, loaders and their errors."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.posttrain.rewards import RewardError, final_number, load_reward, load_rewards, score


@given(st.integers(-10**9, 10**9), st.sampled_from(["{:d}", "{:,d}"]),
       st.sampled_from(["The answer is {}.", "{}", "3 + 4 = 7, so... {}", "\\boxed{{{}}} 99"]))
def test_final_number_reads_the_last_or_boxed_number(x, fmt, text):
    assert final_number(text.format(fmt.format(x))) == x


@pytest.mark.parametrize("completion,answer,want", [
    ("12", "12", 1.0), ("I think it is 12.", 12, 1.0), ("12.0", "12", 1.0),
    ("1,200 apples", "1200", 1.0), ("-3.5", "-3.5", 1.0), ("13", "12", 0.0),
    ("twelve", "12", 0.0), ("\\boxed{7} and then 8", "7", 1.0)])
def test_numeric_match(completion, answer, want):
    assert load_reward("numeric_match").fn("", completion, {"answer": answer}) == want


def test_exact_regex_length_and_json_schema(tmp_path):
    assert load_reward("exact_match").fn("", " Paris\n", {"answer": "Paris"}) == 1.0
    assert load_reward("exact_match").fn("", "paris", {"answer": "Paris"}) == 0.0
    fmt = load_reward(r"regex:^<answer>\d+</answer>$").fn
    assert fmt("", "<answer>42</answer>", {}) == 1.0 and fmt("", "42", {}) == 0.0
    assert load_reward("length").fn("", "x" * 250, {}) == 0.25
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"]}))
    valid = load_reward(f"json_schema:{schema}").fn
    assert valid("", '{"n": 3}', {}) == 1.0
    assert valid("", '{"n": "3"}', {}) == 0.0 and valid("", '{"n": 3', {}) == 0.0
    assert valid("", "no json", {}) == 0.0


def test_weights_sum_and_errors(tmp_path):
    code = tmp_path / "r.py"
    code.write_text("def half(prompt, completion, row):\n    return 0.5\n"
                    "def text(prompt, completion, row):\n    return 'x'\n")
    rewards = load_rewards(["numeric_match", f"{code}:half"], [2.0, -1.0])
    total, parts = score(rewards, "", "7", {"answer": 7}, "f:1")
    assert parts == [1.0, 0.5] and total == 1.5
    with pytest.raises(RewardError, match="f:3: reward numeric_match raised RewardError: "
                                          "numeric_match needs an 'answer'"):
        score(rewards, "", "7", {}, "f:3")
    with pytest.raises(RewardError, match=r"f:1: reward .*r.py:text returned 'x', not a finite"):
        score(load_rewards([f"{code}:text"]), "", "7", {}, "f:1")
    with pytest.raises(RewardError, match="not a built-in"):
        load_reward("exactmatch")
    with pytest.raises(RewardError, match="no file"):
        load_reward(str(tmp_path / "missing.py") + ":f")
    with pytest.raises(RewardError, match="2 reward weights for 1 reward"):
        load_rewards(["length"], [1.0, 2.0])
    with pytest.raises(RewardError, match="not a regular expression"):
        load_reward("regex:(")
    with pytest.raises(RewardError, match="no reward function given"):
        load_rewards([])
    assert load_reward("json:loads").name == "json:loads"  # module:function imports.
