"""tokenizer.json -> GGUF tokenizer metadata (the exporter's path for HF sources), checked with
llama.cpp's own test vectors.

For each vocab file in ../shared/vocab (qwen2, llama-bpe, gpt-2): the runner rebuilds the
tokenizer from the GGUF, saves it as an HF tokenizer.json; the exporter turns that tokenizer.json
back into `tokenizer.ggml.*` metadata (token list, types, merges, pre-tokenizer name found by
probing the split, special ids) in a fresh GGUF; the tokenizer rebuilt from *that* must
reproduce llama.cpp's .inp/.out vectors line for line and name the same pre-tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

VOCAB = Path(__file__).resolve().parents[1].parent / "shared" / "vocab"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "gpt-2"])
def test_hf_tokenizer_to_gguf_metadata_reproduces_llama_cpp_vectors(tmp_path, name):
    import gguf

    from quantzoo.model.config import ModelConfig
    from quantzoo.model.export import Source, add_hf_tokenizer
    from quantzoo.model.gguf_loader import read_metadata
    from quantzoo.model.tokenizer import Tokenizer

    path = VOCAB / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        pytest.fail(f"{path} is missing: the tokenizer vectors live in ../shared/vocab beside the checkout")
    meta0 = read_metadata(gguf.GGUFReader(path), str(path), prefix="tokenizer.")
    tok0 = Tokenizer.from_gguf_fields(meta0, str(path))
    (tmp_path / "tokenizer.json").write_text(tok0.tok.to_str(), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok0.bos_token or None, "eos_token": tok0.eos_token or None,
         "add_bos_token": False}), encoding="utf-8")
    n_vocab = len(meta0["tokenizer.ggml.tokens"])
    cfg = ModelConfig(arch="llama", vocab_size=n_vocab, hidden_size=64, intermediate_size=64,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position=64, tie_word_embeddings=True, qk_norm=False)
    out = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    add_hf_tokenizer(w, Source(tmp_path, cfg, {}, hf_config={}))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    meta = read_metadata(gguf.GGUFReader(out), str(out), prefix="tokenizer.")
    assert meta["tokenizer.ggml.pre"] == name
    assert meta["tokenizer.ggml.tokens"] == meta0["tokenizer.ggml.tokens"]
    assert len(meta["tokenizer.ggml.merges"]) == len(meta0["tokenizer.ggml.merges"])
    if tok0.eos_token:
        assert meta["tokenizer.ggml.eos_token_id"] == meta0["tokenizer.ggml.eos_token_id"]
    tok = Tokenizer.from_gguf_fields(meta, str(out))
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    lines = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(texts) == len(lines) == 46
    bad = [(t, tok.encode(t, add_bos=False)) for t, line in zip(texts, lines)
           if tok.encode(t, add_bos=False) != [int(x) for x in line.split()]]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {bad[0]!r}"
