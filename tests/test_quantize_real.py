"""`quantzoo quantize` on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, llama arch).

Path: Q4_1 GGUF -> (dequantized) -> HF AWQ g64 directory (576 = 4.5 x 128 forces group 64) ->
Q8_0 GGUF again. Each hop changes the file format, the tokenizer container (GGUF metadata ->
tokenizer.json with the smollm pre-tokenizer -> GGUF metadata, detected as "smollm" again) and,
for llama, the Q/K row order (unpermuted on load, permuted on write). The result must still be
the model: perplexity of test_model_default's English paragraph under the same bound (40;
measured 25.1 for AWQ g64 and ~25 for the Q8_0 re-export vs 27.9 for the original Q4_1), and the
greedy answer to a fixed question names Paris.
"""
from __future__ import annotations

import json

import pytest

from quantzoo.cli import main as cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain(tmp_path_factory, default_model_file, one_torch_thread):
    src = default_model_file
    root = tmp_path_factory.mktemp("real")
    awq, q8 = root / "smol-awq-g64", root / "smol-q8_0.gguf"
    assert cli(["quantize", src, str(awq), "--format", "awq", "--group-size", "64", "--quiet"]) == 0
    assert cli(["quantize", str(awq), str(q8), "--format", "q8_0", "--quiet"]) == 0
    return {"src": src, "awq": awq, "q8": q8, "root": root}


def _check_model(path):
    from test_model_default import PARAGRAPH, PPL_BOUND, perplexity

    from quantzoo.model import load_model

    m = load_model(path, device="cpu", progress=False)
    assert (m.config.arch, m.config.hidden_size, m.config.num_layers) == ("llama", 576, 30)
    ppl = perplexity(m, PARAGRAPH)
    print(f"{path}: perplexity {ppl:.2f}")
    assert ppl < PPL_BOUND
    tok = m.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = tok.decode(m.generate(tok.encode(prompt), max_new_tokens=16))
    assert "Paris" in out, out
    return m


def test_awq_g64_dir_from_the_default_gguf(chain):
    cfg = json.loads((chain["awq"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["quantization_config"]["group_size"] == 64
    m = _check_model(chain["awq"])
    assert m.formats["q_proj"] == "awq"


def test_group_128_is_refused_with_the_hint(chain, capsys):
    # (asked for: without --group-size an AWQ source keeps its own group, 64 here)
    assert cli(["quantize", str(chain["awq"]), str(chain["root"] / "g128"), "--format", "awq",
                "--group-size", "128", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "in_features=576" in err and "use --group-size 64" in err


def test_q8_0_gguf_from_the_awq_dir(chain):
    import gguf

    r = gguf.GGUFReader(str(chain["q8"]))
    assert r.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert r.fields["general.architecture"].contents() == "llama"
    _check_model(chain["q8"])
    # the tokenizer survives GGUF -> tokenizer.json -> GGUF
    from test_model_default import PARAGRAPH

    from quantzoo.model.gguf_loader import load_gguf

    _, _, t0 = load_gguf(chain["src"], progress=False)
    _, _, t2 = load_gguf(str(chain["q8"]), progress=False)
    for s in (PARAGRAPH, "Zürich – 1234567 ✓ 🦙\n\n  x = f(a, b)", "<|im_start|>user\nhi<|im_end|>"):
        assert t0.encode(s) == t2.encode(s), s
