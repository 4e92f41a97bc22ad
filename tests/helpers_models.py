"""Small seeded synthetic Qwen3 / llama models built with HF transformers, saved as HF dirs.

Each spec below is a few-layer model whose dims exercise one thing the runner and the
exporters must get right: GQA, head_dim 64 and 128, tied and untied lm_head, hidden sizes
divisible by 128 (AWQ g128) or only by 64 (AWQ needs --group-size 64). Weights are random
(transformers' init, seeded) but scaled up so the logits are peaked: a greedy 32-token run
then does not hinge on near-ties that fp32 summation order could flip.

The tokenizer is a tiny byte-level BPE trained with `tokenizers` on a fixed paragraph, with
Qwen2's split regex, ChatML special tokens and a ChatML chat template, saved as
tokenizer.json + tokenizer_config.json the way HF does.
"""
from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

CORPUS = """The quick brown fox jumps over the lazy dog. Quantized weights trade a little
accuracy for a lot of memory bandwidth: four bits per weight instead of sixteen, plus a scale
per group. A kernel reads the packed integers, converts them to half precision, and multiplies
by the activations. Tokenizers split text into pieces; byte-level BPE merges frequent pairs.
In 2024 there were 12 models, 345 tests and 6789 tokens per second. Hello, world! How are you?
""" * 4

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def build_tokenizer(vocab_size: int = 300):
    """A tiny byte-level BPE (qwen2 split regex) + ChatML specials; deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    return tok


@dataclass
class Spec:
    name: str
    arch: str = "qwen3"             # "qwen3" | "llama"
    hf_class: str | None = None     # "Mistral": a llama-arch model saved as MistralForCausalLM
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 384
    layers: int = 2
    vocab: int = 320                # >= the tokenizer's; the rest are padding rows, as Qwen has
    tied: bool = True
    rope_theta: float = 1e6
    eps: float = 1e-6
    dtype: str = "float32"          # dtype the checkpoint is saved in
    init_std: float = 0.08
    seed: int = 0
    extra: dict = field(default_factory=dict)   # more config keys (rope_parameters: Llama 3 RoPE)


SPECS = {
    # GQA 4:2, head_dim 64, tied, hidden and intermediate multiples of 128 (AWQ g128)
    "qwen3-gqa-hd64-tied": Spec("qwen3-gqa-hd64-tied"),
    # head_dim 128 (wider than hidden/heads), GQA 2:1, untied lm_head
    "qwen3-hd128-untied": Spec("qwen3-hd128-untied", hidden=128, heads=2, kv_heads=1, head_dim=128,
                               intermediate=256, tied=False, seed=1),
    # hidden 192 and intermediate 320: multiples of 64 but not 128 (AWQ needs --group-size 64)
    "qwen3-g64-only": Spec("qwen3-g64-only", hidden=192, heads=3, kv_heads=1, head_dim=64,
                           intermediate=320, seed=2),
    # llama arch (no q/k norms), GQA, untied; its GGUF gets llama.cpp's Q/K row permutation
    "llama-gqa": Spec("llama-gqa", arch="llama", hidden=128, heads=4, kv_heads=2, head_dim=32,
                      intermediate=256, tied=False, rope_theta=1e4, eps=1e-5, seed=3),
    # Llama 3 RoPE scaling: with head_dim 64 (one the fused GPU kernels take) and a 64-token
    # pre-training context, 4 frequencies are kept, 5 blended and 23 divided by the factor
    # (config.llama3_rope_factors)
    "llama3-rope": Spec("llama3-rope", arch="llama", hidden=256, heads=4, kv_heads=2, head_dim=64,
                        intermediate=256, tied=True, rope_theta=1e4, eps=1e-5, seed=4,
                        extra={"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    # Mistral v0.1-style: llama's architecture under MistralForCausalLM with a sliding window,
    # here 80 positions (the runner's context ends at the window; the tests stay inside it)
    "mistral-window": Spec("mistral-window", arch="llama", hf_class="Mistral", hidden=128, heads=4, kv_heads=1,
                           head_dim=32, intermediate=256, tied=False, rope_theta=1e4, eps=1e-5, seed=5,
                           extra={"sliding_window": 80}),
    # in_features that GGUF's 32-value blocks do not divide (a GGUF export stores those weights
    # F16, as llama.cpp's converter does): intermediate 200, so ffn_down alone ...
    "qwen3-ffn200": Spec("qwen3-ffn200", hidden=128, heads=2, kv_heads=1, head_dim=64, intermediate=200,
                         tied=False, seed=6),
    # ... and hidden 80: the embeddings, lm_head, q/k/v (llama: Q/K rows permuted) and gate/up,
    # while o_proj (4 x 32 = 128) and ffn_down (256) keep the format
    "llama-hidden80": Spec("llama-hidden80", arch="llama", hidden=80, heads=4, kv_heads=2, head_dim=32,
                           intermediate=256, tied=False, rope_theta=1e4, eps=1e-5, seed=7),
}


def hf_config(spec: Spec, tok_vocab: int, eos_id: int):
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                  rms_norm_eps=spec.eps, max_position_embeddings=512,
                  tie_word_embeddings=spec.tied, initializer_range=spec.init_std,
                  bos_token_id=None, eos_token_id=eos_id,
                  rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"})
    common.update(spec.extra)
    assert tok_vocab <= spec.vocab
    if spec.hf_class == "Mistral":
        c = MistralConfig(**common)
    elif spec.arch == "qwen3":
        c = Qwen3Config(**common)
    else:
        c = LlamaConfig(**common)
    c.architectures = [f"{spec.hf_class or ('Qwen3' if spec.arch == 'qwen3' else 'Llama')}ForCausalLM"]
    return c


def build_hf_model(spec: Spec):
    """A random transformers model for spec (fp32, eval mode), and its tokenizer."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    cfg = hf_config(spec, tok.get_vocab_size(), tok.token_to_id("<|im_end|>"))
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # norms are ones at init: give them some spread so a wrong norm shows in the logits
    g = torch.Generator().manual_seed(spec.seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval(), tok


def save_hf_dir(model, tok, path: Path, dtype: str = "float32", max_shard_size=None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # a copy: casting the model itself would round its RoPE inv_freq buffer to fp16 for good
    m = copy.deepcopy(model).to(getattr(torch, dtype))
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    m.save_pretrained(path, **kw)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": CHATML,
        "model_max_length": 512, "tokenizer_class": "Qwen2Tokenizer"}, indent=2))
    return path


def make_model_dir(spec_name: str, root: Path, dtype: str | None = None, **save_kw):
    """Build, save and return (path, model, tokenizer) for one of SPECS."""
    spec = SPECS[spec_name]
    model, tok = build_hf_model(spec)
    path = save_hf_dir(model, tok, Path(root) / f"{spec_name}-{dtype or spec.dtype}",
                       dtype=dtype or spec.dtype, **save_kw)
    return path, model, tok


def read_safetensors_dir(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF dir as float32 numpy (what the exporter quantizes)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k).float().numpy()
    return out


def load_into_transformers(model, weights: dict[str, np.ndarray]):
    """Copy float32 numpy weights (HF names) into a transformers model, every tensor checked."""
    sd = model.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            if name not in sd:
                continue
            assert tuple(sd[name].shape) == tuple(w.shape), (name, sd[name].shape, w.shape)
            sd[name].copy_(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


PROMPT = "The quick brown fox jumps over 12 models. Hello, world!"


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """Tiny models run fastest on one thread; with pytest-xdist's 2 workers on 2 cores, more
    threads oversubscribe the CPU (measured: 32 greedy steps 0.08 s on 1 thread, 4.7 s on 2
    under load). The conftest fixture one_torch_thread wraps it for whole test modules."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
