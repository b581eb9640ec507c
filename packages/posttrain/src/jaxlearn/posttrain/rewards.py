"""Reward functions of RL post-training: plain callables `fn(prompt, completion, row) ->
float`, named on the command line.

    fns = load_rewards(["numeric_match", "rewards.py:brevity"], weights=[1.0, 0.1])
    total, parts = score(fns, prompt, completion, row, where="prompts.jsonl:3")

A spec is a built-in name, `regex:PATTERN`, `json_schema:FILE.json`, `FILE.py:function`
(a file, loaded as a module) or `package.module:function` (imported). `prompt` is the
rendered prompt text, `completion` the sampled text (no end-of-turn token), `row` the
prompt's JSONL record as a dict. A reward that raises, or returns something that is not a
finite number, is a `RewardError` naming the function and the row: never a silent 0.

Built-ins:
- `exact_match`: 1 when the completion, stripped, equals `row["answer"]` as text.
- `numeric_match`: 1 when the completion's final number (the content of the last
  `\\boxed{...}` if there is one, else the last number written, "1,234" and "-3.5"
  included) equals `row["answer"]` as a number (relative tolerance 1e-6).
- `regex:PATTERN`: 1 when `re.search(PATTERN, completion)` finds something (a format
  reward).
- `json_schema:FILE`: 1 when the completion is JSON valid under the schema in FILE, checked
  by the grammar the server's structured output compiles from it (llguidance).
- `length`: the completion's length in characters over 1000 (weight it negatively to
  reward brevity).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import numbers
import os
import re
from typing import Any, Callable, Optional, Sequence

__all__ = ["BUILTINS", "Reward", "RewardError", "final_number", "load_reward",
           "load_rewards", "score"]

RewardFn = Callable[[str, str, dict], float]


class RewardError(ValueError):
    """A reward spec that does not load, or a reward that fails on a row."""


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0


def _answer(row: dict, name: str) -> Any:
    if "answer" not in row:
        raise RewardError(f"{name} needs an 'answer' field in the row")
    return row["answer"]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_number(text: str) -> Optional[float]:
    """The last number in `text` (inside the last `\\boxed{}` if any), or None."""
    boxed = _BOXED.findall(text)
    found = _NUMBER.findall(boxed[-1] if boxed else text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def exact_match(prompt: str, completion: str, row: dict) -> float:
    return float(completion.strip() == str(_answer(row, "exact_match")).strip())


def numeric_match(prompt: str, completion: str, row: dict) -> float:
    answer = _answer(row, "numeric_match")
    try:
        want = float(str(answer).replace(",", ""))
    except ValueError:
        raise RewardError(f"numeric_match: 'answer' {answer!r} is not a number") from None
    got = final_number(completion)
    return float(got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def length(prompt: str, completion: str, row: dict) -> float:
    return len(completion) / 1000.0


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "numeric_match": numeric_match,
                                 "length": length}


def _regex(pattern: str) -> RewardFn:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise RewardError(f"reward 'regex:{pattern}': not a regular expression: {e}") from None
    return lambda prompt, completion, row: float(compiled.search(completion) is not None)


def _json_schema(path: str) -> RewardFn:
    from jaxlearn.decoding.grammar import GrammarVocab, response_format_grammar
    from jaxlearn.text.tokenizers import ByteTokenizer

    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
        grammar = response_format_grammar(
            {"type": "json_schema", "json_schema": {"name": "reward", "schema": schema}},
            whitespace_flexible=True)
    except (OSError, ValueError) as e:
        raise RewardError(f"reward 'json_schema:{path}': {' '.join(str(e).split())}") from None
    assert grammar is not None
    vocab = GrammarVocab(ByteTokenizer(), 259)

    def valid(prompt: str, completion: str, row: dict) -> float:
        m = vocab.matcher(grammar)
        ok = all(m.advance(b + 3) for b in completion.strip().encode("utf-8"))
        return float(ok and m.accepting())

    return valid


def _from_code(spec: str) -> RewardFn:
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise RewardError(f"reward {spec!r}: no file {target!r}")
            module_spec = importlib.util.spec_from_file_location(
                f"jaxlearn_reward_{abs(hash(os.path.abspath(target)))}", target)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except RewardError:
        raise
    except Exception as e:  # Whatever the user's file raised at import.
        raise RewardError(f"reward {spec!r}: loading {target!r} failed: "
                          f"{type(e).__name__}: {' '.join(str(e).split())}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {target!r} has no function {name!r}")
    return fn


def load_reward(spec: str, weight: float = 1.0) -> Reward:
    """The reward a spec names (module doc); RewardError when it does not load."""
    if spec in BUILTINS:
        return Reward(spec, BUILTINS[spec], weight)
    kind, sep, arg = spec.partition(":")
    if sep and kind == "regex":
        return Reward(spec, _regex(arg), weight)
    if sep and kind == "json_schema":
        return Reward(spec, _json_schema(arg), weight)
    if ":" in spec and spec.rpartition(":")[2].isidentifier():
        return Reward(spec, _from_code(spec), weight)
    raise RewardError(f"reward {spec!r}: not a built-in ({', '.join(sorted(BUILTINS))}), "
                      "regex:PATTERN, json_schema:FILE, FILE.py:function or "
                      "module:function")


def load_rewards(specs: Sequence[str], weights: Sequence[float] = ()) -> list[Reward]:
    """The rewards of `specs`, weighted by `weights` (empty: all 1; else one per spec)."""
    if not specs:
        raise RewardError("no reward function given (--reward NAME, e.g. numeric_match)")
    if weights and len(weights) != len(specs):
        raise RewardError(f"{len(weights)} reward weights for {len(specs)} reward functions")
    return [load_reward(s, float(w)) for s, w in zip(specs, weights or [1.0] * len(specs))]


def score(rewards: Sequence[Reward], prompt: str, completion: str, row: dict,
          where: str) -> tuple[float, list[float]]:
    """(weighted sum, each reward's value) of one completion of the prompt at `where`."""
    parts: list[float] = []
    for r in rewards:
        try:
            value = r.fn(prompt, completion, row)
        except Exception as e:  # The user's code: any failure is theirs to see, named.
            raise RewardError(f"{where}: reward {r.name} raised {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}") from None
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"{where}: reward {r.name} returned {value!r}, not a finite "
                              "number")
        parts.append(float(value))
    return sum(r.weight * v for r, v in zip(rewards, parts)), parts
