"""`stack_forms`: which dicts of a structure mismatch differ only in their layer stack's
form (stacked `layer` vs per-layer `layer{i}`); anything else is left to the error. The
restore itself is tested end to end in experiments' test_lora_training.py."""

from jaxlearn.runtime.stack_forms import _other_forms

STACKED = ["params.dec.stack.layer.w", "opt.mu.dec.stack.layer.w"]
PER_LAYER = [f"{p}.dec.stack.layer{i}.w" for p in ("params", "opt.mu") for i in range(3)]


def test_finds_the_form_in_either_direction_with_its_layer_count():
    # Step stacked, target per layer: 3 layers, counted from the target.
    assert _other_forms(STACKED, PER_LAYER) == {
        "params.dec.stack": (True, 3), "opt.mu.dec.stack": (True, 3)}
    # Step per layer, target stacked: counted from the step.
    assert _other_forms(PER_LAYER, STACKED) == {
        "params.dec.stack": (False, 3), "opt.mu.dec.stack": (False, 3)}


def test_any_other_difference_is_not_explained():
    assert _other_forms([], []) is None
    assert _other_forms(STACKED, PER_LAYER + ["params.head.w"]) is None  # A new leaf.
    assert _other_forms(STACKED + ["params.old.w"], PER_LAYER) is None  # A dropped one.
    assert _other_forms(["params.dec.stack.layer.w"],
                        ["params.dec.stack.layer0.v"]) is None  # Another leaf name.
    # One dict both stacked and per layer: not a form swap.
    assert _other_forms(["a.layer.w", "a.layer0.v"], ["a.layer0.w", "a.layer.v"]) is None
    # Two dicts, each in its other form: each converted its own way.
    assert _other_forms(["a.layer.w", "b.layer0.w"], ["a.layer0.w", "b.layer.w"]) == {
        "a": (True, 1), "b": (False, 1)}
