"""A reader for the block-style YAML subset `jaxlearn.launch.k8s.to_yaml` writes, so that
tests check generated manifests without a YAML library."""

import json
import re


def parse_yaml(text):
    """The block-style YAML subset `to_yaml` writes (mappings, sequences, JSON-quoted or
    plain scalars), without a YAML library."""
    lines = [(len(raw) - len(raw.lstrip(" ")), raw.strip()) for raw in text.splitlines()
             if raw.strip() and not raw.lstrip().startswith("#")]
    pos = 0

    def scalar(s):
        if s.startswith('"'):
            return json.loads(s)
        special = {"{}": {}, "[]": [], "true": True, "false": False, "null": None}
        if s in special:
            return special[s]
        for cast in (int, float):
            try:
                return cast(s)
            except ValueError:
                pass
        return s

    def split_key(s):
        m = re.match(r'("(?:[^"\\]|\\.)*"|[^"\s][^:]*):(?: (.*))?$', s)
        return (scalar(m.group(1)), m.group(2)) if m else None

    def block(indent):
        return seq(indent) if lines[pos][1].startswith("- ") else mapping(indent)

    def mapping(indent):
        nonlocal pos
        out = {}
        while pos < len(lines) and lines[pos][0] == indent and not lines[pos][1].startswith("- "):
            key, rest = split_key(lines[pos][1])
            pos += 1
            out[key] = scalar(rest) if rest is not None else block(lines[pos][0])
        return out

    def seq(indent):
        nonlocal pos
        out = []
        while pos < len(lines) and lines[pos][0] == indent and lines[pos][1].startswith("- "):
            item = lines[pos][1][2:]
            if item.startswith("- ") or split_key(item):
                lines[pos] = (indent + 2, item)
                out.append(block(indent + 2))
            else:
                out.append(scalar(item))
                pos += 1
        return out

    return block(lines[0][0])


def check_yaml(text, want=None):
    """`text` parsed by `parse_yaml` (and by PyYAML, when installed, which must agree);
    equal to `want` when given."""
    got = parse_yaml(text)
    try:
        import yaml  # Not a requirement; a second opinion when it is installed.
    except ImportError:
        pass
    else:
        assert yaml.safe_load(text) == got
    if want is not None:
        assert got == want
    return got
