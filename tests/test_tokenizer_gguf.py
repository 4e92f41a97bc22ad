"""The tokenizer rebuilt from GGUF metadata reproduces llama.cpp's own test vectors.

Files: ../shared/vocab/ggml-vocab-{qwen2,llama-bpe,gpt-2}.gguf (vocab-only GGUFs from
llama.cpp's models/ directory) with .inp texts separated by `__ggml_vocab_test__` lines and
.out token ids, one line per text, made by llama.cpp's test-tokenizer-0 (no BOS, special
tokens not parsed). Every line must match.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest

VOCAB = Path(__file__).resolve().parents[1].parent / "shared" / "vocab"
NAMES = ["qwen2", "llama-bpe", "gpt-2"]


@functools.lru_cache(maxsize=None)   # (parsing a vocabulary takes seconds; the tests only read it)
def _load(name):
    import gguf

    from quantzoo.model.gguf_loader import read_metadata
    from quantzoo.model.tokenizer import Tokenizer

    path = VOCAB / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        pytest.fail(f"{path} is missing: the tokenizer vectors live in ../shared/vocab beside the checkout")
    meta = read_metadata(gguf.GGUFReader(path), str(path), prefix="tokenizer.")
    return path, Tokenizer.from_gguf_fields(meta, str(path))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_vectors(name):
    path, tok = _load(name)
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and lines[-1] == ""     # both files end with a separator / newline
    texts, lines = texts[:-1], lines[:-1]
    assert len(texts) == len(lines) == 46
    bad = []
    for text, line in zip(texts, lines):
        want = [int(t) for t in line.split()]
        got = tok.encode(text, add_bos=False)
        if got != want:
            bad.append((text, got, want))
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {bad[0]!r}"
    # decoding gives the text back (byte-level BPE is lossless)
    for text in texts:
        assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_a_byte_the_vocabulary_lacks_still_parts_its_neighbours():
    """llama.cpp drops a byte its vocabulary has no token for (SmolLM2's lacks 21), but only after
    the merges, so the characters around it do not merge across it: "!\\x04!" is "!", "!", not
    "!!". Here gpt-2's vocabulary with the token for byte 0x04 renamed (and its merges dropped)."""
    import gguf

    from quantzoo.model.gguf_loader import read_metadata
    from quantzoo.model.tokenizer import Tokenizer

    path = VOCAB / "ggml-vocab-gpt-2.gguf"
    meta = read_metadata(gguf.GGUFReader(path), str(path), prefix="tokenizer.")
    _, whole = _load("gpt-2")
    bang, bangbang = whole.encode("!", add_bos=False), whole.encode("!!", add_bos=False)
    assert len(bang) == 1 and len(bangbang) == 1                    # "!!" is one token when whole
    b04 = chr(0x100 + 4)                                            # byte 0x04 in GPT-2's byte-level alphabet
    toks = list(meta["tokenizer.ggml.tokens"])
    toks[toks.index(b04)] = "<no byte 04>"
    meta["tokenizer.ggml.tokens"] = toks
    meta["tokenizer.ggml.merges"] = [m for m in meta["tokenizer.ggml.merges"] if b04 not in m]
    tok = Tokenizer.from_gguf_fields(meta, str(path))
    assert tok.encode("!\x04!", add_bos=False) == bang * 2
    assert tok.encode("!!", add_bos=False) == bangbang
    assert tok.decode(tok.encode("a\x04b", add_bos=False)) == "ab"   # dropped, as llama.cpp drops it


def test_contractions_match_an_apostrophe_and_s_not_the_long_s():
    """The splitters' 's is [sS] in llama.cpp; a case-insensitive (?i:'s) also takes the long s
    U+017F, which would make "'\u017fx" two pieces where llama.cpp keeps one."""
    for name in ("qwen2", "llama-bpe"):
        _, tok = _load(name)

        def pieces(text):
            return [p for p, _ in tok.tok.pre_tokenizer.pre_tokenize_str(text)]

        assert pieces("'\u017fx") == ["'\u00c5\u00bfx"], name          # U+017F is bytes C5 BF
        for c in "sStTmMdD":
            assert pieces(f"'{c}x") == [f"'{c}", "x"], (name, c)
        for c in ("re", "RE", "ve", "Ve", "ll", "LL"):
            assert pieces(f"'{c}x") == [f"'{c}", "x"], (name, c)


def test_add_bos_defaults_as_llama_cpp():
    """None of the three vocab files says tokenizer.ggml.add_bos_token; llama.cpp's
    llama-vocab.cpp then adds BOS for the llama3 pre-tokenizer family only (add_bos = true
    beside ignore_merges), not for qwen2 or gpt-2. A missed BOS changes every Llama 3 logit."""
    for name, want in (("llama-bpe", True), ("qwen2", False), ("gpt-2", False)):
        path, tok = _load(name)
        assert tok.add_bos is want, name
        ids = tok.encode("Hello world")
        assert (ids[0] == tok.bos_token_id) is want, (name, ids)
        assert ids[int(want):] == tok.encode("Hello world", add_bos=False)


def test_unknown_pre_tokenizer_is_an_error():
    from quantzoo.model.tokenizer import Tokenizer

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "made-up",
            "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": []}
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='made-up' is not supported"):
        Tokenizer.from_gguf_fields(meta, "x.gguf")
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ValueError, match="tokenizer.ggml.model='bert' is not supported"):
        Tokenizer.from_gguf_fields(meta, "x.gguf")


def test_special_tokens_and_chat_template():
    """Control tokens are single ids in encoded text; the chat template renders with jinja2."""
    from quantzoo.model.tokenizer import CONTROL, NORMAL, Tokenizer

    toks = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "<|im_start|>", "<|im_end|>", "ab"]
    types = [NORMAL] * 27 + [CONTROL, CONTROL, NORMAL]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": toks, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 27,
            "tokenizer.ggml.eos_token_id": 28, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }} "
                                       "{{ m['content'] }}<|im_end|>{% endfor %}"}
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    assert tok.encode("ab c") == [27, 29, 26, 2]            # bos, merged "ab", "Ġ", "c"
    assert tok.encode("ab", add_bos=False) == [29]
    s = tok.apply_chat_template([{"role": "user", "content": "ab"}])
    assert s == "<|im_start|>user ab<|im_end|>"
    assert tok.encode(s, add_bos=False) == [27] + tok.encode("user ab", add_bos=False) + [28]
    assert 28 in tok.eos_token_ids
    assert tok.decode([29, 26, 2]) == "ab c"


def _meta(toks, types, **kv):
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": toks, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [], **{f"tokenizer.ggml.{k}": v for k, v in kv.items()}}


def test_end_of_generation_tokens_as_llama_cpp_finds_them():
    """llama.cpp's EOG set (llama-vocab.cpp): the eos id, every token of an end-of-turn text --
    typed CONTROL with a warning where the file typed it otherwise, so it is one token in text --
    and the fim pad / repo / file-separator tokens; an eot key in the file wins over the text."""
    from quantzoo.model.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer

    toks = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        "<|endoftext|>", "<|im_end|>", "<|file_sep|>", "<|fim_pad|>", "<|im_start|>", "<|repo_name|>"]
    types = [NORMAL] * 26 + [CONTROL, NORMAL, USER_DEFINED, CONTROL, CONTROL, CONTROL]
    with pytest.warns(UserWarning, match=r"token 27 '<\|im_end\|>' looks like a control token"):
        tok = Tokenizer.from_gguf_fields(_meta(toks, types, eos_token_id=26), "x.gguf")
    assert tok.eos_token_ids[0] == 26 and sorted(tok.eos_token_ids) == [26, 27, 28, 29, 31]
    assert tok.encode("a<|im_end|>b") == [0, 27, 1]
    assert tok.decode([0, 27, 1], skip_special_tokens=True) == "ab"      # CONTROL now: skipped
    # an eot id in the file is an EOG token whatever its text
    with pytest.warns(UserWarning):
        tok = Tokenizer.from_gguf_fields(_meta(toks, types, eos_token_id=26, eot_token_id=3), "x.gguf")
    assert sorted(tok.eos_token_ids) == [3, 26, 27, 28, 29, 31]


def test_add_eos_token_from_the_file():
    from quantzoo.model.tokenizer import CONTROL, NORMAL, Tokenizer

    toks = ["a", "b", "<s>", "</s>"]
    types = [NORMAL, NORMAL, CONTROL, CONTROL]
    meta = _meta(toks, types, bos_token_id=2, eos_token_id=3, add_bos_token=True, add_eos_token=True)
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    assert tok.encode("ab") == [2, 0, 1, 3]
    assert tok.encode("ab", add_bos=False, add_eos=False) == [0, 1]
    meta["tokenizer.ggml.add_eos_token"] = False
    assert Tokenizer.from_gguf_fields(meta, "x.gguf").encode("ab") == [2, 0, 1]
    del meta["tokenizer.ggml.eos_token_id"]   # nothing to add
    assert Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.add_eos_token": True}, "x.gguf").encode("ab") == [2, 0, 1]


def test_duplicate_token_strings_are_refused():
    """One string at two ids: encode gave one id, decode both the same text. llama.cpp aborts."""
    from quantzoo.model.tokenizer import NORMAL, Tokenizer

    with pytest.raises(ValueError, match=r"^x\.gguf: tokenizer\.ggml\.tokens holds 'tt' twice, as ids 1 and 3$"):
        Tokenizer.from_gguf_fields(_meta(["t", "tt", "a", "tt"], [NORMAL] * 4), "x.gguf")
    # empty strings are no duplicates: llama.cpp names each "[EMPTY_<id>]" (with a warning) and loads
    with pytest.warns(UserWarning, match=r"x\.gguf: tokenizer\.ggml\.tokens: 2 empty token\(s\), e\.g\. id 2"):
        tok = Tokenizer.from_gguf_fields(_meta(["t", "tt", "", ""], [NORMAL] * 4), "x.gguf")
    assert tok.decode([3]) == "[EMPTY_3]" and tok.decode([1]) == "tt"


def _spm_meta(**kv):   # a tiny SentencePiece vocabulary
    from quantzoo.model.tokenizer import CONTROL, NORMAL, UNKNOWN

    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581", "a", "\u2581a"],
            "tokenizer.ggml.scores": [0.0] * 6, "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * 3,
            "tokenizer.ggml.eos_token_id": 2, **{f"tokenizer.ggml.{k}": v for k, v in kv.items()}}


@pytest.mark.parametrize("key,off", [("add_bos_token", [5]), ("add_eos_token", [1, 5]), ("add_space_prefix", [1, 4])])
@pytest.mark.parametrize("value", ["false", [False], 0])
def test_flags_must_be_gguf_booleans(key, off, value):
    """bool("false") and bool([False]) are True: a flag stored as a string or an array had turned
    BOS / EOS / the space prefix on. llama.cpp refuses a key of any type but BOOL."""
    from quantzoo.model.tokenizer import Tokenizer

    needle = re.escape(f"x.gguf: tokenizer.ggml.{key}={value!r} must be a boolean, not")
    with pytest.raises(ValueError, match="^" + needle):
        Tokenizer.from_gguf_fields(_spm_meta(**{key: value}), "x.gguf")
    assert Tokenizer.from_gguf_fields(_spm_meta(**{key: False}), "x.gguf").encode("a") == off


def test_an_out_of_range_special_id_is_warned_of_once():
    """Every tokenizer.ggml.*_token_id is checked to be an integer; the check of them all had read
    each id as the runner does, so an out-of-range eos / unknown id was warned of twice."""
    import warnings

    from quantzoo.model.tokenizer import Tokenizer

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        Tokenizer.from_gguf_fields(_spm_meta(eos_token_id=600, unknown_token_id=700), "x.gguf")
    assert sorted(str(w.message) for w in got) == [
        "x.gguf: tokenizer.ggml.eos_token_id=600 is not one of the 6 token ids: using llama.cpp's default 2",
        "x.gguf: tokenizer.ggml.unknown_token_id=700 is not one of the 6 token ids: using llama.cpp's default 0"]


def _check_text_so_far(decode, ids, context=()):
    """Each step's text against decoding the context and the ids so far whole, less the text of
    the context up to its last whole character."""
    from quantzoo.model.tokenizer import TextSoFar

    context = list(context)
    cut = len(context)
    while cut and decode(context[:cut]).endswith("\ufffd"):
        cut -= 1
    before = decode(context[:cut])
    t = TextSoFar(decode, context)
    for n, i in enumerate(ids, 1):
        whole = decode(context + ids[:n])
        assert whole.startswith(before)
        assert t.add(i) == whole[len(before):], (context, ids[:n], t.text)


@pytest.mark.parametrize("name", NAMES)
def test_text_so_far_equals_decoding_the_whole_list(name):
    """generate()'s incremental detokenizer (model/tokenizer.py TextSoFar) against decoding every
    prefix whole: llama.cpp's test texts (multi-byte characters, emoji, CJK, mixed whitespace) and
    random ids, whose byte tokens split and break UTF-8 characters anywhere."""
    path, tok = _load(name)
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = tok.encode("".join(texts), add_bos=False)
    _check_text_so_far(tok.decode, ids)
    rng = np.random.default_rng()
    byte_ids = [tok.tok.token_to_id(c) for c in "Ã¤ðŁĺĢ"]   # one-byte tokens: lead and continuation bytes
    assert None not in byte_ids
    emoji = tok.encode("ab😀🎉 c", add_bos=False)
    for _ in range(20):
        ids = rng.integers(0, tok.vocab_size, 60).tolist()
        ids[::3] = rng.choice(byte_ids, len(ids[::3])).tolist()
        _check_text_so_far(tok.decode, ids)
        k = int(rng.integers(1, len(emoji)))   # a prompt that may end inside a character
        _check_text_so_far(tok.decode, emoji[k:] + ids[:10], context=ids[10:20] + emoji[:k])


def test_text_so_far_with_other_decoders():
    """A decoder that strips the text's first space (SentencePiece-style: the window must start
    one commit early to strip the same one), one whose later pieces rewrite earlier text (a
    replacement spanning pieces: the whole list is decoded again), and UTF-8 bytes."""
    pieces = ["▁a", "b", "▁c", "é", "▁", "d", "a"]

    def metaspace(ids):
        text = "".join(pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text

    def utf8(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    rng = np.random.default_rng()
    for _ in range(30):
        _check_text_so_far(lambda ids: metaspace(ids).replace("ab", "X"), rng.integers(0, len(pieces), 25).tolist())
        _check_text_so_far(metaspace, rng.integers(0, len(pieces), 25).tolist(),
                           context=rng.integers(0, len(pieces), int(rng.integers(0, 12))).tolist())
        prompt = "".join(rng.choice(list("aé€😀 "), 6)).encode()   # cut anywhere, inside a character too
        _check_text_so_far(utf8, rng.integers(0x7f, 0x100, 25).tolist(),
                           context=list(prompt[:int(rng.integers(0, len(prompt) + 1))]))
    text = list("añ€😀".encode())
    _check_text_so_far(utf8, text + [0xff] + text[::-1] + text)
    for k in range(len(text)):   # a context that ends inside a character: the text starts with it, whole
        _check_text_so_far(utf8, text[k:] + text, context=[0x41] + text[:k])
        _check_text_so_far(utf8, text[k:] + text, context=text[:k])
