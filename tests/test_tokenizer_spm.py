"""SentencePiece vocabularies (`tokenizer.ggml.model` 'llama': Llama 1/2, TinyLlama, Mistral v0.1)
against SentencePiece itself.

No llama.cpp test vectors for an SPM vocabulary are in ../shared/vocab, so each test trains a
small SentencePiece BPE model the way Llama's tokenizer.model is set up (identity normalization,
a dummy prefix, byte fallback, digits split, whitespace kept), writes it to GGUF metadata as
llama.cpp's converter does (convert_hf_to_gguf.py, `_create_vocab_sentencepiece`: every piece
with its score and type), and checks the runner's tokenizer rebuilt from that metadata against
`sentencepiece.SentencePieceProcessor` on llama.cpp's multilingual test texts, English prose and
fresh random strings (characters outside the vocabulary among them: byte fallback).
Where llama.cpp and SentencePiece differ -- llama.cpp parses special tokens in the text and puts
a space prefix after each one -- the expected ids are llama.cpp's, built from SentencePiece's.
Also: `quantzoo quantize`'s export of an HF Llama tokenizer.json (as transformers writes it) to a
GGUF SPM vocabulary, and a llama model with such a vocabulary through every export.
"""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

VOCAB = Path(__file__).resolve().parents[1].parent / "shared" / "vocab"
ENGLISH = Path(__file__).resolve().parents[1] / "quantzoo" / "data" / "english.txt"
# characters for random texts: ASCII, whitespace runs, accents, CJK, emoji, and some no
# training text holds (byte fallback)
ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFG0123456789     \n\t.,;'\"!?-éüñßøçЖж日本語中文😀🎉") + [
    "\u2581", "\u00a0", "\u200b", "ǅ", "ꙮ", "𝔘", "\U0001f9ec"]


def _texts():
    out = []
    for name in ("llama-bpe", "qwen2"):   # llama.cpp's tokenizer test texts, read from ../shared
        p = VOCAB / f"ggml-vocab-{name}.gguf.inp"
        if not p.exists():
            pytest.fail(f"{p} is missing: the tokenizer vectors live in ../shared/vocab beside the checkout")
        out += p.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    return out + ENGLISH.read_text(encoding="utf-8").split("\n")


def _train(vocab_size=700, **options):
    """A SentencePiece BPE model set up as Llama's (options override); trains in ~20 ms.
    (sentencepiece is a test dependency, pyproject .[test]; imported here, not at collection,
    so that the GPU tier collects this module on a machine without it.)"""
    import sentencepiece as spm

    lines = _texts() * 2
    buf = io.BytesIO()
    kw = dict(model_type="bpe", vocab_size=vocab_size, byte_fallback=True, normalization_rule_name="identity",
              remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
              allow_whitespace_only_pieces=True, hard_vocab_limit=False, character_coverage=0.995,
              user_defined_symbols=["<tool>"], minloglevel=2)
    kw.update(options)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, **kw)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def _gguf_meta(sp, user_defined=("<tool>",), add_space_prefix=True):
    """tokenizer.ggml.* as llama.cpp's converter writes them for a tokenizer.model."""
    from quantzoo.model.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]

    def kind(i):
        return (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
                else BYTE if sp.is_byte(i) else USER_DEFINED if tokens[i] in user_defined else NORMAL)

    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


def _random_texts(rng, n=300):
    return ["".join(rng.choice(ALPHABET, int(rng.integers(0, 50)))) for _ in range(n)]


@pytest.fixture(scope="module")
def llama_like():
    sp = _train()
    return sp, _gguf_meta(sp)


def _differences(tok, sp, texts):
    bad = []
    for t in texts:
        got, want = tok.encode(t, add_bos=False), sp.encode(t)
        if got != want:
            bad.append((t, [sp.id_to_piece(i) for i in got], [sp.id_to_piece(i) for i in want]))
    return bad


def test_encode_and_decode_equal_sentencepiece(tmp_path, rng, llama_like):
    """Through a real GGUF file (GGUFWriter, then the loader's metadata reader): every text encodes
    to SentencePiece's ids and decodes to SentencePiece's text, which is the text itself."""
    import gguf

    from quantzoo.model.gguf_loader import read_metadata
    from quantzoo.model.tokenizer import Tokenizer

    sp, meta = llama_like
    path = tmp_path / "spm-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_add_space_prefix(True)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    tok = Tokenizer.from_gguf_fields(read_metadata(gguf.GGUFReader(path), str(path), prefix="tokenizer."), str(path))

    texts = _texts() + _random_texts(rng)
    bad = _differences(tok, sp, texts)
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {bad[0]!r}"
    assert any(sp.is_byte(i) for t in texts for i in sp.encode(t))   # byte fallback was exercised
    for t in texts:   # lossless but for U+2581 itself, which both decode to a space
        ids = sp.encode(t)
        assert tok.decode(ids) == sp.decode(ids) == t.replace("\u2581", " ")
    assert tok.bos_token_id == sp.bos_id() and tok.eos_token_ids == [sp.eos_id()] and tok.add_bos
    assert tok.encode("Hello world") == [sp.bos_id()] + sp.encode("Hello world")


def test_special_tokens_as_llama_cpp_parses_them(llama_like):
    """Control, user-defined and unknown tokens written in the text are single ids (llama.cpp
    with parse_special), and the text after each starts with a space prefix, as llama.cpp's SPM
    session adds one after every special token; SentencePiece itself would not split them out."""
    from quantzoo.model.tokenizer import Tokenizer

    sp, meta = llama_like
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    tool = sp.piece_to_id("<tool>")
    for a, special, b in (("Hello", "</s>", "world"), ("x y", "<s>", " z"), ("it", "<tool>", "is"),
                          ("", "<unk>", "end"), ("a", "</s>", "")):
        want = sp.encode(a) + [sp.piece_to_id(special)] + sp.encode(b)
        assert tok.encode(a + special + b, add_bos=False) == want, (a, special, b)
    assert tok.encode("<tool><tool>", add_bos=False) == [tool, tool]
    ids = tok.encode("Hi</s>there", add_bos=True)
    assert tok.decode(ids) == "<s> Hi</s> there"                   # as HF's Llama tokenizer prints it
    assert tok.decode(ids, skip_special_tokens=True) == "Hi there"


def test_no_space_prefix_and_llama_cpp_defaults(rng):
    """add_space_prefix false (a model trained without SentencePiece's dummy prefix); the ids
    llama.cpp assumes for an SPM vocabulary when the file names none (unk 0, bos 1, eos 2, add
    BOS); the file's add_bos_token wins."""
    from quantzoo.model.tokenizer import Tokenizer

    sp = _train(add_dummy_prefix=False)
    meta = _gguf_meta(sp, add_space_prefix=False)
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    texts = _texts() + _random_texts(rng)
    bad = _differences(tok, sp, texts)
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {bad[0]!r}"
    assert all(tok.decode(sp.encode(t)) == sp.decode(sp.encode(t)) == t.replace("\u2581", " ") for t in texts)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [2], True)
    meta["tokenizer.ggml.add_bos_token"] = False
    meta["tokenizer.ggml.eos_token_id"] = 0
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    assert (tok.eos_token_ids, tok.add_bos) == ([0], False)


def test_without_byte_fallback_unknown_characters_are_unk(rng):
    """A vocabulary without <0xXX> pieces: characters it lacks become <unk> as SentencePiece
    gives them (a run of them one <unk>)."""
    from quantzoo.model.tokenizer import Tokenizer

    sp = _train(byte_fallback=False, character_coverage=0.98)
    tok = Tokenizer.from_gguf_fields(_gguf_meta(sp), "x.gguf")
    texts = _texts() + _random_texts(rng)
    assert any(sp.unk_id() in sp.encode(t) for t in texts)
    bad = _differences(tok, sp, texts)
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {bad[0]!r}"


def test_text_so_far_with_byte_tokens(rng, llama_like):
    """generate()'s incremental detokenizer on an SPM vocabulary: random ids with byte tokens
    that split UTF-8 characters, and the leading-space strip of the first token; and a prompt
    that ends on a whole character spelled in byte tokens, streamed with both decoders a
    SentencePiece vocabulary meets (the GGUF one here, and `tokenizers`' ByteFallback chain an HF
    Llama directory brings): its window had begun at the character's last byte token, so with
    the latter an emoji after it streamed as four U+FFFD, for good."""
    from quantzoo.model.tokenizer import TextSoFar, Tokenizer
    from test_tokenizer_gguf import _check_text_so_far

    sp, meta = llama_like
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    n = sp.get_piece_size()
    byte_ids = [i for i in range(n) if sp.is_byte(i)]
    pool = [i for i in range(n) if not sp.is_byte(i)] + byte_ids
    emoji = sp.encode("ab 😀 ꙮ c")
    for _ in range(20):
        ids = rng.choice(pool, 60).tolist()
        ids[::3] = rng.choice(byte_ids, len(ids[::3])).tolist()
        _check_text_so_far(tok.decode, ids)
        k = int(rng.integers(1, len(emoji)))
        _check_text_so_far(tok.decode, emoji[k:] + ids[:10], context=ids[10:20] + emoji[:k])
    ids = [sp.piece_to_id(p) for p in ("a", "<0x0A>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x0A>")]
    t = TextSoFar(tok.decode)
    assert [t.add(i) for i in ids][-1] == tok.decode(ids) == "a\n😀\n"
    prompt = sp.encode("I like 😀")
    assert [sp.id_to_piece(i) for i in prompt[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    new = prompt[-4:] + [sp.piece_to_id("\u2581")]
    for decode in (tok.decode, lambda ids: tok.tok.decode(ids)):
        t = TextSoFar(decode, prompt)
        assert [t.add(i) for i in new][-1] == "😀 "


def test_decode_of_any_ids_equals_sentencepiece(rng, llama_like):
    """Random ids of text and byte tokens, their byte runs mostly not whole UTF-8 (a cut
    character, a stray continuation byte): the text is sentencepiece's, one U+FFFD per invalid
    byte and the valid bytes around them kept. (`tokenizers`' ByteFallback decoder turned a whole
    run into U+FFFDs when any of it was invalid: <0x0A> <0xE6> lost its newline.)"""
    from quantzoo.model.tokenizer import Tokenizer

    sp, meta = llama_like
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    n = sp.get_piece_size()
    text = [i for i in range(n) if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))]
    byte_ids = [i for i in range(n) if sp.is_byte(i)]
    lead = sp.piece_to_id("a")   # (sentencepiece keeps a leading <0x20>'s space, llama.cpp drops it)
    invalid = 0
    for _ in range(500):
        ids = [lead] + [int(rng.choice(byte_ids if rng.random() < 0.6 else text)) for _ in range(int(rng.integers(1, 30)))]
        want = sp.decode(ids)
        invalid += "\ufffd" in want
        assert tok.decode(ids) == want, [sp.id_to_piece(i) for i in ids]
    assert invalid > 300
    b = [sp.piece_to_id(p) for p in ("<0x0A>", "<0xE6>", "<0x41>", "<0x80>")]
    assert tok.decode(b) == sp.decode(b) == "\n\ufffdA\ufffd"


def _llama_cpp_spm(text: str, tokens: list, scores: list) -> list:
    """llama.cpp's SPM session (llm_tokenizer_spm_session) for a text without special tokens, as
    plainly as it can be written: the characters of U+2581 + the text (spaces as U+2581), the
    adjacent pair whose joined text is a vocabulary entry of the highest score joined first (the
    leftmost of equals), until none is; a symbol outside the vocabulary becomes its bytes'
    <0xXX> tokens; no text, no tokens. Quadratic, for short texts."""
    if not text:
        return []
    vocab = {t: i for i, t in enumerate(tokens)}
    sym = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = None
        for j in range(len(sym) - 1):
            i = vocab.get(sym[j] + sym[j + 1])
            if i is not None and (best is None or scores[i] > best[0]):
                best = (scores[i], j)
        if best is None:
            break
        j = best[1]
        sym[j:j + 2] = [sym[j] + sym[j + 1]]
    return [x for s in sym for x in ([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])]


def test_user_defined_token_with_a_space_mark_is_merged_into(rng):
    """A user-defined piece that holds U+2581 (as "\u2581the" or "\u2581\u2581") is never in the
    raw text the special-token split sees; llama.cpp's merges join pairs into it like any other
    vocabulary entry. It had come out as "\u2581th" "e" in 40 % of random texts. (SentencePiece
    itself is no oracle here: it matches user-defined pieces in the text before its merges, so it
    cuts "\u2581the" out of "\u2581there", which llama.cpp's merges never make.)"""
    from quantzoo.model.tokenizer import Tokenizer

    ud = ("\u2581the", "\u2581\u2581", "<tool>")
    sp = _train(user_defined_symbols=list(ud))
    meta = _gguf_meta(sp, user_defined=ud)
    tok = Tokenizer.from_gguf_fields(meta, "x.gguf")
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    texts = [t for t in _texts() + _random_texts(rng) if "\u2581" not in t and "<tool>" not in t]
    texts += ["the", " ", "a  b", "of the cat", "  the  there", "the cat and the dog", "In the end, the  sky"]
    want = {t: _llama_cpp_spm(t, tokens, scores) for t in texts}
    assert sum(tokens.index("\u2581the") in w for w in want.values()) >= 8
    assert sum(tokens.index("\u2581\u2581") in w for w in want.values()) >= 30
    bad = [(t, [tokens[i] for i in tok.encode(t, add_bos=False)], [tokens[i] for i in w])
           for t, w in want.items() if tok.encode(t, add_bos=False) != w]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {bad[0]!r}"


def test_bad_spm_metadata_is_named():
    from quantzoo.model.tokenizer import Tokenizer

    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"],
            "tokenizer.ggml.token_type": [2, 1]}
    with pytest.raises(ValueError, match=r"x.gguf: metadata key 'tokenizer.ggml.scores' is missing"):
        Tokenizer.from_gguf_fields(meta, "x.gguf")
    with pytest.raises(ValueError, match=r"x.gguf: tokenizer.ggml.scores has 1 entries, tokenizer.ggml.tokens 2"):
        Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.scores": [0.0]}, "x.gguf")
    with pytest.raises(ValueError, match=r"x.gguf: tokenizer.ggml.scores must be an array of float"):
        Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.scores": ["a", "b"]}, "x.gguf")
    with pytest.raises(ValueError, match=r"x.gguf: tokenizer.ggml.scores\[1\] is nan \(token 'a'\)"):
        Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.scores": [0.0, float("nan")]}, "x.gguf")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model='t5' is not supported yet"):
        Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.model": "t5"}, "x.gguf")
    meta["tokenizer.ggml.scores"] = [0.0, -1.0]
    # an id out of range: llama.cpp warns and keeps its default for the vocabulary type
    with pytest.warns(UserWarning, match=r"x.gguf: tokenizer.ggml.unknown_token_id=7 is not one of the 2 "
                                         r"token ids: using llama.cpp's default 0"):
        assert Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.unknown_token_id": 7}, "x.gguf").encode(
            "\u00e9", add_bos=False) == [0]
    with pytest.warns(UserWarning, match=r"tokenizer.ggml.bos_token_id=9 is not one of the 3 token ids: using "
                                         r"llama.cpp's default 1"):
        tok = Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.tokens": ["<unk>", "<s>", "a"],
                                          "tokenizer.ggml.scores": [0.0, 0.0, -1.0], "tokenizer.ggml.token_type": [2, 3, 1],
                                          "tokenizer.ggml.bos_token_id": 9}, "x.gguf")
    assert tok.bos_token_id == 1 and tok.encode("a")[0] == 1
    with pytest.raises(ValueError, match=r"x.gguf: an SPM vocabulary needs an unknown token"):
        Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.tokens": [], "tokenizer.ggml.scores": [],
                                    "tokenizer.ggml.token_type": []}, "x.gguf")
    # every score equal (llama.cpp's converter on a tokenizer.json-only Llama): said, since ties
    # between competing pairs resolve differently from llama.cpp's leftmost-first
    toks = ["<unk>", "a", "b", "ab", "ba", "aba"]
    with pytest.warns(UserWarning, match=r"x.gguf: 2 of the 3 tokens that merges make share their score"):
        Tokenizer.from_gguf_fields({**meta, "tokenizer.ggml.tokens": toks, "tokenizer.ggml.scores": [-1000.0] * 6,
                                    "tokenizer.ggml.token_type": [2] + [1] * 5}, "x.gguf")
    # no token types (all NORMAL, so no byte tokens): a character outside the vocabulary is the
    # unk id (llama.cpp's default 0), never dropped
    del meta["tokenizer.ggml.token_type"]
    assert Tokenizer.from_gguf_fields(meta, "x.gguf").encode("a\u00e9a", add_bos=False) == [0, 1, 0, 1]


def _hf_llama_tokenizer_dir(sp, path, legacy):
    """tokenizer.json + tokenizer_config.json as transformers writes them for a Llama (its own
    LlamaTokenizer built from the vocabulary and the merges its SentencePiece converter derives)."""
    import importlib

    import transformers

    convert = importlib.import_module("transformers.convert_slow_tokenizer")
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    merges = convert.generate_merges(vocab, {sp.id_to_piece(i): sp.get_score(i) for i in range(n)})
    transformers.LlamaTokenizer(vocab=vocab, merges=merges, legacy=legacy).save_pretrained(path)
    return path


def _export_tokenizer(tok_dir, n_vocab, out):
    import gguf

    from quantzoo.model.config import ModelConfig
    from quantzoo.model.export import Source, add_hf_tokenizer
    from quantzoo.model.gguf_loader import read_metadata

    cfg = ModelConfig(arch="llama", vocab_size=n_vocab, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position=64, tie_word_embeddings=True, qk_norm=False)
    w = gguf.GGUFWriter(str(out), "llama")
    try:
        add_hf_tokenizer(w, Source(tok_dir, cfg, {}, hf_config={}))
        for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
            write()
    finally:
        w.close()
    return read_metadata(gguf.GGUFReader(out), str(out), prefix="tokenizer.")


@pytest.mark.parametrize("legacy", [True, False])
def test_hf_llama_tokenizer_json_exports_as_sentencepiece(tmp_path, rng, llama_like, legacy):
    """`quantzoo quantize` from an HF Llama 1/2 directory: its tokenizer.json (no scores) becomes
    tokenizer.ggml.model 'llama' with scores from the merges' order and llama.cpp's token types,
    and the tokenizer rebuilt from that GGUF matches SentencePiece on every text -- where
    transformers' own tokenizer from that tokenizer.json does not (its Metaspace adds no U+2581
    before a text that starts with a space: ' ' is one piece there, two in SentencePiece)."""
    import transformers

    from quantzoo.model.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, Tokenizer

    sp, _ = llama_like
    d = _hf_llama_tokenizer_dir(sp, tmp_path / "hf", legacy)
    meta = _export_tokenizer(d, sp.get_piece_size(), tmp_path / "v.gguf")
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is True
    assert "tokenizer.ggml.merges" not in meta
    types = meta["tokenizer.ggml.token_type"]
    assert [types.count(t) for t in (UNKNOWN, CONTROL, BYTE)] == [1, 2, 256] and types[0] == UNKNOWN
    assert types.count(NORMAL) == sp.get_piece_size() - 259
    tok = Tokenizer.from_gguf_fields(meta, "v.gguf")
    texts = [t for t in _texts() + _random_texts(rng) if "<tool>" not in t]   # not user-defined in HF's
    bad = _differences(tok, sp, texts)
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {bad[0]!r}"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [2], True)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert hf.encode(" ", add_special_tokens=False) != sp.encode(" ") == tok.encode(" ", add_bos=False)


def test_byte_fallback_bpe_that_is_not_sentencepiece_is_refused(tmp_path, llama_like):
    """A tokenizer.json with byte fallback that a GGUF SPM vocabulary cannot reproduce is refused,
    naming the file and the reason, instead of written as a tokenizer that splits differently:
    merges that are not every split of a token (a trained BPE's); a token's merges apart with
    another token's between them (no score per token orders them); a pre-tokenizer that splits
    (Metaspace split true, or no "split" key, which tokenizers reads as true); a normalizer that
    does more than write spaces as U+2581 (Lowercase); another replacement character."""
    import copy
    import json

    sp, _ = llama_like
    d = _hf_llama_tokenizer_dir(sp, tmp_path / "hf", True)
    tj = d / "tokenizer.json"
    good = json.loads(tj.read_text(encoding="utf-8"))
    merges = good["model"]["merges"]
    i = len(merges) // 2
    # a token whose two splits are both merges, the first one moved to the front
    joined = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in merges]
    j = next(k for k in range(1, len(merges)) if joined.count(joined[k]) > 1 and joined.index(joined[k]) == k)
    cases = {
        "its merges are not every split of a token": lambda t: t["model"].update(merges=merges[:i] + merges[i + 1:]),
        "a score per token cannot order such merges": lambda t: t["model"].update(
            merges=[merges[j]] + merges[:j] + merges[j + 1:]),
        "does not prepare text as SentencePiece does": lambda t: t["pre_tokenizer"].update(split=True),
        "does not prepare text as SentencePiece does ": lambda t: t["pre_tokenizer"].pop("split"),
        "does not prepare text as SentencePiece does  ": lambda t: t.update(normalizer={"type": "Lowercase"}),
        "does not prepare text as SentencePiece does   ": lambda t: t["pre_tokenizer"].update(replacement="_"),
    }
    for n, (needle, change) in enumerate(cases.items()):
        data = copy.deepcopy(good)
        change(data)
        tj.write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(ValueError, match=r"tokenizer.json: .*" + needle.strip()):
            _export_tokenizer(d, sp.get_piece_size(), tmp_path / f"{n}.gguf")
    tj.write_text(json.dumps(good), encoding="utf-8")
    assert _export_tokenizer(d, sp.get_piece_size(), tmp_path / "good.gguf")["tokenizer.ggml.model"] == "llama"


@pytest.mark.slow
def test_llama_model_with_a_sentencepiece_vocabulary(tmp_path, rng):
    """A Llama-arch model whose HF directory carries a SentencePiece-converted tokenizer.json,
    through `quantzoo quantize` to a Q8_0 GGUF, then to an AWQ directory, then back to GGUF:
    each loads with a tokenizer that matches SentencePiece, and generates through `quantzoo run
    model`."""
    import helpers_models as H
    from quantzoo.cli import main as cli
    from quantzoo.model import load_model

    sp = _train()
    spec = dataclasses.replace(H.SPECS["llama-gqa"], vocab=sp.get_piece_size())
    model, tok = H.build_hf_model(spec)
    model.config.bos_token_id, model.config.eos_token_id = sp.bos_id(), sp.eos_id()
    path = H.save_hf_dir(model, tok, tmp_path / "llama-spm")
    _hf_llama_tokenizer_dir(sp, path, legacy=False)   # replaces the byte-level tokenizer files
    texts = [t for t in _texts() + _random_texts(rng, 50) if "<tool>" not in t]
    q8 = tmp_path / "m-q8_0.gguf"
    awq = tmp_path / "m-awq"
    q4 = tmp_path / "m-q4_0.gguf"
    assert cli(["quantize", str(path), str(q8), "--format", "q8_0", "--quiet"]) == 0
    assert cli(["quantize", str(q8), str(awq), "--format", "awq", "--group-size", "32", "--quiet"]) == 0
    assert cli(["quantize", str(awq), str(q4), "--format", "q4_0", "--quiet"]) == 0
    for model_path in (q8, awq, q4):
        m = load_model(str(model_path), device="cpu")
        bad = _differences(m.tokenizer, sp, texts)
        assert not bad, (model_path.name, bad[0])
        ids = m.tokenizer.encode("The Moon is")
        assert ids[0] == sp.bos_id() and ids[1:] == sp.encode("The Moon is")
        new = m.generate(ids, max_new_tokens=8, temperature=0.0)
        assert len(new) == 8 or new[-1] in m.tokenizer.eos_token_ids
    assert cli(["run", "model", "--model", str(q4), "--prompt", "The Moon is", "--max-new-tokens", "4",
                "--device", "cpu"]) == 0
