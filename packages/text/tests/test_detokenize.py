"""Incremental detokenization and stop conditions (no model)."""

from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.text.detokenize import OutputState
from jaxlearn.text.tokenizers import ByteTokenizer

BIG = 10**6


def run(tokens, *, stop=(), stop_ids=(), max_new=BIG, room=BIG, prompt=(1,)):
    out = OutputState(ByteTokenizer(), list(prompt), max_new_tokens=max_new, stop=stop,
                      stop_token_ids=stop_ids)
    deltas = []
    for i, t in enumerate(tokens):
        deltas.append(out.add(t, room=room - i - 1))
        if out.finished:
            break
    if not out.finished:
        deltas.append(out.finish("cancelled"))
    return out, deltas


def test_multibyte_characters_wait_until_complete():
    ids = ByteTokenizer().encode("aé€😀b")
    out, deltas = run(ids)
    texts = [d.text for d in deltas]
    assert "".join(texts) == "aé€😀b" == out.text
    assert all("\ufffd" not in t for t in texts)
    # 'é' is two bytes: its first byte shows nothing.
    assert texts[1] == "" and texts[2] == "é"


def test_stop_string_across_tokens_is_held_back_and_cut():
    ids = ByteTokenizer().encode("hello world. bye")
    out, deltas = run(ids, stop=("ld.",))
    assert out.text == "hello wor" and out.finish_reason == "stop"
    assert out.stop_reason == "ld."
    shown = "".join(d.text for d in deltas)
    assert shown == "hello wor"
    # The 'l' was held back while it could still start "ld.".
    assert "".join(d.text for d in deltas[:10]) == "hello wor"
    assert len(out.tokens) == len("hello world.")


def test_stop_token_and_lengths():
    tok = ByteTokenizer()
    out, deltas = run(tok.encode("ab") + [2] + tok.encode("cd"), stop_ids=(2,))
    assert out.text == "ab" and out.tokens == tok.encode("ab") + [2]
    assert out.finish_reason == "stop" and out.stop_reason == 2
    out, _ = run(tok.encode("abcdef"), max_new=3)
    assert (out.text, out.finish_reason) == ("abc", "length")
    out, _ = run(tok.encode("abcdef"), room=2)
    assert (out.text, out.finish_reason) == ("ab", "length")


@given(
    st.text(alphabet="abc é€", max_size=30),
    st.lists(st.text(alphabet="abc é", min_size=1, max_size=4), max_size=3),
)
def test_streamed_text_equals_final_text_and_first_stop(text, stops):
    ids = ByteTokenizer().encode(text)
    out, deltas = run(ids, stop=tuple(stops))
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    assert out.text == expected
    assert "".join(d.text for d in deltas) == expected
    assert out.finish_reason == ("stop" if hits else "cancelled")


def _hf_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxlearn.text.tokenizers import HFTokenizer

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(["hello world, user assistant système 😀"] * 20, trainer)
    return HFTokenizer.from_tokenizer(raw, eos_token_ids=[2])


@given(st.text(alphabet="helo wrd,é€😀ü", max_size=40))
def test_hf_stream_equals_full_decode(text):
    tok = _hf_tokenizer()
    prompt = tok.encode("user: hello")
    ids = tok.encode(text)
    out = OutputState(tok, prompt, max_new_tokens=BIG)
    assert out._stream is not None  # Streamed by tokenizers.decoders.DecodeStream.
    deltas = [out.add(t, room=BIG) for t in ids] + [out.finish("cancelled")]
    full = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert out.text == full == text
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)


def test_hf_stream_with_stop_strings_and_specials():
    tok = _hf_tokenizer()
    ids = tok.encode("hello world, système") + [1] + tok.encode("user")
    out = OutputState(tok, [], max_new_tokens=BIG, stop=("sys",))
    deltas = []
    for t in ids:
        deltas.append(out.add(t, room=BIG))
        if out.finished:
            break
    assert out.text == "hello world, " == "".join(d.text for d in deltas)
    assert out.finish_reason == "stop"
    # A special id (<|im_start|>) shows no text; EOS ends the request.
    out = OutputState(tok, [], max_new_tokens=BIG, stop_token_ids=tok.eos_token_ids)
    texts = [out.add(t, room=BIG).text for t in [1, *tok.encode("hi"), 2]]
    assert "".join(texts) == "hi" and out.stop_reason == 2
