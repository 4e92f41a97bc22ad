"""The runner's API on bad input (CPU): token ids, positions, sampling and generation settings,
model options, tokenizer arguments -- one clear ValueError naming what is wrong, never an index
crash deep in torch, a wrapped-around id or a NaN sample."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import helpers_models as H
from quantzoo.bench.model import make_config, synthetic_model
from quantzoo.model.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return synthetic_model("q4_0", make_config(1, tiny=True), "cpu")   # vocab 1024, no tokenizer


@pytest.mark.parametrize("ids,needle", [
    ([1024], "token id 1024 is not a row of the 1024-row embedding"),
    ([3, -1], "token id -1 is not a row"),           # would wrap around to the last row
    ([1.9], "1.9 is not a token id"),                 # would be truncated to 1
    ([True], "True is not a token id"),
    ("123", r"got str \(encode text with model.tokenizer.encode first\)"),
    ([[5]], r"\[5\] is not a token id"),
    (np.ones((1, 3), np.int64), r"expected a 1-D sequence of token ids, got shape \(1, 3\)"),
    ([], "empty"),
])
def test_bad_token_ids(model, ids, needle):
    for call in (model.logits, model.prefill, model.generate):
        with pytest.raises(ValueError, match=needle):
            call(ids)


def test_good_token_ids_of_every_kind_agree(model):
    want = model.logits([1, 2, 3])
    for ids in ((1, 2, 3), np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), 2, 3]):
        assert torch.equal(model.logits(ids), want)


def test_positions_and_cache(model):
    fresh = synthetic_model("q4_0", make_config(1, tiny=True), "cpu")
    with pytest.raises(ValueError, match="no KV cache yet; run prefill first"):
        fresh.decode_step(5, 0)
    with pytest.raises(ValueError, match="start=3 continues a sequence, but there is no KV cache yet"):
        fresh.prefill([1, 2], start=3)        # (ran on a zero cache)
    model.prefill([1] * 10)
    big = model.prefill([1] * 300)          # a longer prompt from 0 grows the cache (was an error)
    assert big.shape == (1024,) and model.k_cache.shape[3] >= 300
    for pos in (-1, 10**6, 1.5):
        with pytest.raises(ValueError, match="is not in the KV cache"):
            model.decode_step(5, pos)
    with pytest.raises(ValueError, match="token id 5000 is not a row"):
        model.decode_step(5000, 3)
    # a CPU tensor is checked as an id (-1 read the last embedding row); a GPU one, e.g. generate's
    # argmax, is taken as it is (checking it would wait for the GPU)
    for tok, needle in ((torch.tensor(-1), "token id -1 is not a row"), (torch.tensor(2.5), "2.5 is not a token id"),
                        (torch.tensor([1, 2]), "a tensor of 2 elements; one token id is needed")):
        with pytest.raises(ValueError, match=needle):
            model.decode_step(tok, 3)
    # numpy integers are positions too (they were refused as "not in the KV cache")
    assert torch.equal(model.decode_step(torch.tensor(5), np.int64(3)), model.decode_step(5, 3))
    assert model.prefill([4], start=np.int64(3)).shape == (1024,)
    with pytest.raises(ValueError, match="start=-3"):
        model.prefill([1], start=-3)
    with pytest.raises(ValueError, match="exceed the model's max_seq 4096"):
        model.logits([1] * 4097)


def test_prefill_from_a_later_start_continues_the_sequence(model):
    """prefill(ids, start=p) writes K/V at positions p.. and rotates by them: a prompt fed in two
    pieces ends with the logits of the whole prompt fed at once (teacher forcing from 0)."""
    ids = [5, 17, 300, 2, 999, 41, 7, 8]
    full = model.logits(ids)
    model.prefill(ids[:5])
    last = model.prefill(ids[5:], start=5)
    torch.testing.assert_close(last, full[-1], rtol=1e-4, atol=1e-4 * float(full[-1].abs().max()))
    model.prefill(ids[:3])
    step = model.decode_step(ids[3], 3)      # and one decode step after the pieces
    torch.testing.assert_close(step, full[3], rtol=1e-4, atol=1e-4 * float(full[3].abs().max()))


def test_rope_tables_past_fp16_integers():
    """cos / sin of pos * theta^(-2i/hd) against float64, at positions where an fp16 (or
    otherwise rounded) position would be off by one or more: 2049, 4097, 8191."""
    from types import SimpleNamespace

    from quantzoo.model.llm import rope_tables

    cfg = SimpleNamespace(head_dim=64, rope_theta=1e4, rope_freq_factors=None)
    cos, sin = rope_tables(cfg, 8192, "cpu", torch.float32)
    pos = np.array([0, 1, 2047, 2049, 4097, 8191], dtype=np.float64)
    inv = 1.0 / 1e4 ** (np.arange(0, 64, 2, dtype=np.float64) / 64)
    ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], axis=1)       # (i, i + hd/2)
    sign = np.concatenate([-np.ones(32), np.ones(32)])                             # signed sin
    # float32 angles: |error| <= pos * 2^-23 (4097 * 1.2e-7 = 5e-4 rad at most)
    tol = pos[:, None] * 2.0 ** -22 + 1e-6
    assert np.all(np.abs(cos[pos.astype(int)].numpy() - np.cos(ang)) <= tol)
    assert np.all(np.abs(sin[pos.astype(int)].numpy() - sign * np.sin(ang)) <= tol)


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature="1"), "temperature='1' must be a finite number"),
    (dict(temperature=float("inf")), "temperature=inf must be a finite number"),
    (dict(top_k=2.5), "top_k=2.5 must be an integer"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(min_p=-0.1, temperature=1.0), r"min_p=-0.1 must be in \[0, 1\]"),
    (dict(min_p=float("nan"), temperature=1.0), r"min_p=nan must be in \[0, 1\]"),
    (dict(seed=2**70, temperature=1.0), "seed=1180591620717411303424 must be an integer"),
    # sampling settings with greedy decoding: ignored without a word (the CLI refused them)
    (dict(top_p=0.5), r"top_p=0.5: filters sampled tokens, but temperature 0 \(the default\) decodes greedily"),
    (dict(top_k=5), "top_k=5: filters sampled tokens"),
    (dict(min_p=0.1, temperature=0.0), "min_p=0.1: filters sampled tokens"),
    (dict(seed=5), "seed=5: seeds sampled tokens, but temperature 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be an integer"),
    (dict(eos_token_ids=["x"]), "eos_token_ids: 'x' is not a token id"),
    (dict(look_ahead="yes"), "look_ahead='yes' must be True, False or None"),
    (dict(look_ahead=True, temperature=0.7), r"look_ahead=True needs greedy decoding \(temperature 0\)"),
    (dict(eos_token_ids=5.0), "eos_token_ids=5.0: expected a token id or a sequence of them"),
    (dict(eos_token_ids=[3, -1]), r"eos_token_ids: -1 is not a token id \(ids are >= 0\)"),
    # a number was a raw "not iterable", 0 no stop at all, a dict its keys
    (dict(stop=5), "stop: 5; a str or a list of them"),
    (dict(stop=0), "stop: 0; a str or a list of them"),
    (dict(stop={"a": 1}), r"stop: \{'a': 1\}; a str or a list of them"),
])
def test_bad_generation_settings(model, kw, needle):
    with pytest.raises(ValueError, match=needle):
        model.generate([1, 2], **kw)


def test_tiny_temperature_samples_the_top_token(model):
    """1e-45 used to overflow logits / T to inf and give NaN probabilities, and 1e-46 (0 as a
    float32) made the top logit 0 / 0 = NaN: the top token now."""
    greedy = model.generate([1, 2], max_new_tokens=4)
    for t in (1e-45, 1e-46, 1e-300):
        assert model.generate([1, 2], max_new_tokens=4, temperature=t, seed=0) == greedy, t


class _Scripted:
    """Just what generate() asks of a model: it emits `script` token by token (greedy)."""

    def __init__(self, tok, script):
        from types import SimpleNamespace

        self.tokenizer, self.script, self.i = tok, list(script), 0
        self.config = SimpleNamespace(vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)
        self.k_cache, self.max_seq, self.is_cuda = None, 4096, False
        self.steps = 0   # decode steps run

    def setup_cache(self, n, keep=False):
        self.k_cache = torch.zeros(1, 1, 1, n)

    def ensure_graph(self):
        pass

    def cached_prefix(self, ids):
        return 0

    def fed(self, start, tokens):
        pass

    def _logits(self):
        lg = torch.zeros(self.config.vocab_size)
        lg[self.script[min(self.i, len(self.script) - 1)]] = 10.0
        self.i += 1
        return lg

    def prefill(self, ids, start=0):
        self.i = 0
        return self._logits()

    def decode_step(self, tok, pos):
        assert 0 <= pos < self.k_cache.shape[3]
        self.steps += 1
        return self._logits()


@pytest.mark.parametrize("max_new", [0, 1, 2, 3, 9, 60])
@pytest.mark.parametrize("end", ["eos", "stop", "length"])
def test_look_ahead_gives_what_step_by_step_gives(max_new, end):
    """Greedy steps queued ahead of the host (generate's look_ahead, on by default on CUDA; here
    forced on the CPU) give the same tokens, text, streamed pieces and stop reason as one step at
    a time, and run at most AHEAD steps past what the generation uses. The script's multi-byte
    characters stream split across byte tokens."""
    from quantzoo.model.generate import AHEAD, generate

    tok = Tokenizer.from_tokenizer_json(H.build_tokenizer(300).to_str(), {})
    eos = tok.encode("<|im_end|>")
    assert len(eos) == 1
    script = tok.encode("Zürich 😀 ist groß.\nUser: und Köln?") + eos + tok.encode(" mehr")
    kw = dict(max_new_tokens=max_new, eos_token_ids=eos if end == "eos" else [],
              stop=["User:"] if end == "stop" else None)
    runs = []
    for look_ahead in (False, True):
        m, chunks = _Scripted(tok, script), []
        g = generate(m, [1], look_ahead=look_ahead, stream=chunks.append, **kw)
        runs.append((g.tokens, g.text, "".join(chunks), g.stop_reason, g.decode_tokens))
        assert g.text == "".join(chunks)
        assert g.decode_tokens == max(len(g.tokens) - 1, 0)
        assert g.decode_tokens + (AHEAD if look_ahead else 0) >= m.steps >= g.decode_tokens, m.steps
    assert runs[0] == runs[1]
    if max_new == 60:
        assert runs[0][3] == end


def test_stop_strings_cut_at_the_earliest_whatever_their_order():
    """Stops "User:" and "\nUser:" both occur; the text ends before the earlier one in either
    order (cutting at each in turn had left the newline in, streamed too)."""
    from quantzoo.model.generate import generate

    tok = Tokenizer.from_tokenizer_json(H.build_tokenizer(300).to_str(), {})
    for stops in (["User:", "\nUser:"], ["\nUser:", "User:"]):
        chunks = []
        g = generate(_Scripted(tok, tok.encode("Paris.\nUser: and Rome?")), [1], max_new_tokens=20,
                     stop=stops, stream=chunks.append)
        assert (g.text, "".join(chunks), g.stop_reason) == ("Paris.", "Paris.", "stop"), stops


def test_non_finite_weights_are_an_error_not_garbage():
    """A NaN weight makes every logit NaN; sampling them emitted token after token of garbage
    with no error (argmax of NaNs). generate() checks the prompt's logits."""
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.model import build_model

    cfg = make_config(1, tiny=True)
    w = synthetic_weights("fp16", cfg, "cpu")
    w["model.layers.0.input_layernorm.weight"][0] = float("nan")
    m = build_model(cfg, w, None, device="cpu")
    with pytest.raises(ValueError, match=r"logits are not finite \(NaN/inf\): the model's weights"):
        m.generate([1, 2, 3], max_new_tokens=4)


def test_norm_weights_placed_contiguous_and_aligned():
    """A norm weight given as a strided view or a view 4 bytes into its storage is copied when
    placed (the fused layer ops read 16 bytes at a time, and layer_ops.Repeated checks only a
    shape's first tensors); an aligned contiguous one is taken as it is, and the values stay."""
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.model import build_model

    cfg = make_config(1, tiny=True)
    w = synthetic_weights("fp16", cfg, "cpu")
    h = cfg.hidden_size
    strided = torch.randn(2 * h)[::2]
    offset = torch.randn(h + 1)[1:]
    aligned = torch.randn(h)
    w["model.layers.0.input_layernorm.weight"] = strided
    w["model.layers.0.post_attention_layernorm.weight"] = offset
    w["model.norm.weight"] = aligned
    m = build_model(cfg, w, None, device="cpu")
    for got, given in ((m.layers[0].attn_norm, strided), (m.layers[0].mlp_norm, offset), (m.norm, aligned)):
        assert got.is_contiguous() and got.data_ptr() % 16 == 0 and torch.equal(got, given)
    assert offset.data_ptr() % 16 and m.norm is aligned


def test_model_options():
    cfg = make_config(1, tiny=True)
    with pytest.raises(ValueError, match="dtype=torch.float16: the runner computes in torch.float32 on cpu"):
        synthetic_model("q4_0", cfg, "cpu", dtype=torch.float16)
    for bad in (-5, 2.5, "16"):
        with pytest.raises(ValueError, match="max_seq="):
            synthetic_model("q4_0", cfg, "cpu", max_seq=bad)
    with pytest.raises(ValueError, match=f"max_seq={cfg.max_position + 1}: the model takes at most "
                                         f"{cfg.max_position} positions"):   # (was cut to it silently)
        synthetic_model("q4_0", cfg, "cpu", max_seq=cfg.max_position + 1)
    assert synthetic_model("q4_0", cfg, "cpu", max_seq=cfg.max_position).max_seq == cfg.max_position
    from quantzoo.model import build_model

    with pytest.raises(ValueError, match="device='gpu': not a torch device"):
        build_model(cfg, {}, None, device="gpu")   # the device is checked before the weights
    for dev in ("meta", "mps", torch.device("meta")):   # torch devices, but no runner path
        with pytest.raises(ValueError, match="the runner runs on cpu, cuda or cuda:N, not on"):
            build_model(cfg, {}, None, device=dev)
    # switches read with bool(): "no" turned them on; fuse / fused_ops also take None (auto)
    for name in ("fuse", "fused_ops", "persistent", "cuda_graph", "pdl", "progress"):
        with pytest.raises(ValueError, match=f"{name}='no' must be a boolean"):
            synthetic_model("q4_0", cfg, "cpu", **{name: "no"})
    with pytest.raises(ValueError, match="use_persistent: on='no' must be a boolean"):
        synthetic_model("q4_0", cfg, "cpu").use_persistent("no")


def test_load_model_checks_its_options_before_loading(tmp_path):
    """A misspelt option, a bad value or device failed only after the whole load (minutes for an
    8B model), naming Model.__init__; a path that is no path was os.fspath's TypeError. A dtype
    other than the device's (float32 on the CPU) was refused only once the weights were loaded."""
    import quantzoo as qz

    missing = tmp_path / "never-read.gguf"   # (not even looked at: the options come first)
    for kw, needle in ((dict(cuda_graphs=False), r"unknown option\(s\) \['cuda_graphs'\]; the model takes \['max_seq'"),
                       (dict(max_seq=0), "max_seq=0: a positive number"),
                       (dict(matmul_mode="x"), "matmul_mode='x': choose one of"),
                       (dict(fuse="no"), "fuse='no' must be a boolean"),
                       (dict(device="gpu"), "device='gpu': not a torch device"),
                       # (the load itself had run first: the model then refused it)
                       (dict(dtype=torch.float16), "dtype=torch.float16: the runner computes in torch.float32 on cpu")):
        with pytest.raises(ValueError, match=needle):
            qz.load_model(missing, **kw)
    with pytest.raises(ValueError, match=r"path: 5 is not a path \(a \.gguf file"):
        qz.load_model(5)


def test_positions_past_the_sequence_and_cache_sizes_are_refused():
    """decode_step / prefill(start=) at a position the sequence has not reached attended to stale
    rows of an earlier sequence (or zeros) without a word: max |dlogit| 0.47, another argmax.
    setup_cache took 0 as "all", 2.5 as 2, "8" as 8, sizes past max_seq, and a negative size
    dropped the cache before torch refused it. A prompt that fills the context takes one new token
    (the first comes from the prefill), which prepare() had refused."""
    cfg = make_config(1, tiny=True)
    m = synthetic_model("q4_0", cfg, "cpu", max_seq=64)
    ref = m.logits([5, 6, 7, 9])[-1]
    m.prefill(list(range(100, 140)))
    m.prefill([5, 6, 7])
    with pytest.raises(ValueError, match=r"decode_step: position 50 skips positions 3\.\.49; this sequence holds 3"):
        m.decode_step(9, 50)
    with pytest.raises(ValueError, match=r"prefill: start=50 skips positions 3\.\.49; this sequence holds 3"):
        m.prefill([3], start=50)
    assert torch.allclose(m.decode_step(9, 3), ref, atol=1e-4)   # the next position is fine, and
    assert torch.allclose(m.prefill([9], start=3), ref, atol=1e-4)   # so is writing it again
    cache = m.k_cache
    for bad in (-5, 0, 2.5, "8", 65):
        with pytest.raises(ValueError, match=rf"setup_cache: max_seq={bad!r} must be a number of positions 1\.\.64"):
            m.setup_cache(bad)
    assert m.k_cache is cache   # (kept: checked before anything is dropped)
    assert len(m.generate([1] * 64, max_new_tokens=1, eos_token_ids=[])) == 1
    with pytest.raises(ValueError, match=r"prompt \(64\) \+ max_new_tokens \(2\) takes 65 positions"):
        m.generate([1] * 64, max_new_tokens=2)


@pytest.mark.parametrize("mode", ["cached", "dequant"])
def test_a_cpu_index_is_the_cpu(mode):
    """torch takes "cpu:1" as the one CPU; the runner's CPU branches tested device == "cpu", so
    it ran every linear through the numpy emulation whatever matmul_mode said."""
    from quantzoo.bench.model import synthetic_weights
    from quantzoo.model import build_model

    cfg = make_config(1, tiny=True)
    w = synthetic_weights("q4_0", cfg, "cpu")
    want = build_model(cfg, w, None, device="cpu", matmul_mode=mode).logits([1, 2, 3])
    for dev in ("cpu:1", torch.device("cpu", 0)):
        m = build_model(cfg, w, None, device=dev, matmul_mode=mode)
        down = m.layers[0].down
        assert m.device == "cpu" and not m.is_cuda and m.matmul_mode == mode, dev
        assert (down.w is not None) == (mode == "cached") and (down.qt is None or down.mode == mode), dev
        assert torch.equal(m.logits([1, 2, 3]), want), dev


def test_bos_from_the_post_processor_when_the_config_does_not_say():
    """Llama 3's tokenizer_config.json has no add_bos_token: its BOS comes from tokenizer.json's
    post-processor, and transformers' encoding starts with it. An explicit add_bos_token wins."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    raw = H.build_tokenizer(300)
    bos = "<|im_start|>"
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, raw.token_to_id(bos))])
    cfg = {"bos_token": bos, "eos_token": "<|im_end|>"}
    tok = Tokenizer.from_tokenizer_json(raw.to_str(), cfg)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, **cfg)
    assert tok.add_bos and tok.encode("the moon") == hf("the moon")["input_ids"]
    assert tok.encode("the moon")[0] == raw.token_to_id(bos)
    assert not Tokenizer.from_tokenizer_json(raw.to_str(), {**cfg, "add_bos_token": False}).add_bos
    assert not Tokenizer.from_tokenizer_json(H.build_tokenizer(300).to_str(), cfg).add_bos   # no post-processor BOS


def test_eos_from_the_post_processor_when_the_config_does_not_say():
    """A post-processor that appends EOS (and BOS) is followed as transformers follows it;
    an explicit add_eos_token wins; a chat prompt never gets the EOS (run model --chat)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    raw = H.build_tokenizer(300)
    bos, eos = "<|im_start|>", "<|im_end|>"
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}",
        special_tokens=[(bos, raw.token_to_id(bos)), (eos, raw.token_to_id(eos))])
    cfg = {"bos_token": bos, "eos_token": eos}
    tok = Tokenizer.from_tokenizer_json(raw.to_str(), cfg)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, **cfg)
    assert tok.add_eos and tok.encode("the moon") == hf("the moon")["input_ids"]
    assert tok.encode("the moon")[-1] == raw.token_to_id(eos)
    assert tok.encode("the moon", add_eos=False) == hf("the moon")["input_ids"][:-1]
    assert not Tokenizer.from_tokenizer_json(raw.to_str(), {**cfg, "add_eos_token": False}).add_eos
    assert Tokenizer.from_tokenizer_json(raw.to_str(), {**cfg, "add_eos_token": None}).add_eos   # null: unset
    tok.chat_template = H.CHATML
    msgs = [{"role": "user", "content": "the moon"}]
    text = tok.apply_chat_template(msgs)      # starts with the BOS text, "<|im_start|>"
    assert tok.encode_chat(msgs) == tok.encode(text)[1:-1]   # so neither a second BOS nor the EOS
    tok.chat_template = "hello {{ messages[0]['content'] }}"
    assert tok.encode_chat(msgs) == tok.encode("hello the moon")[:-1]   # BOS added, no EOS


def test_tokenizer_arguments():
    tok = Tokenizer.from_tokenizer_json(H.build_tokenizer(300).to_str(), {"chat_template": H.CHATML})
    for text in (None, 5, b"hi"):
        with pytest.raises(ValueError, match="text: expected a str"):
            tok.encode(text)
    with pytest.raises(ValueError, match="text: cannot be encoded"):
        tok.encode("\ud800")
    # 5, None and a 0-d tensor had raised TypeError about len()
    for ids, needle in (([-1], "token id -1 is not a u32"), ([1.5], "1.5 is not a token id"),
                        ([2**40], r"token id 1099511627776 is not a u32 \(the tokenizer's ids run 0 to 4294967295\)"),
                        (5, "ids: expected a sequence of token ids, got int"), (None, "got NoneType"),
                        (torch.tensor(5), r"ids: expected a 1-D sequence of token ids, got shape \(\)")):
        with pytest.raises(ValueError, match=needle):
            tok.decode(ids)
    ids = tok.encode("the moon")
    assert tok.decode([]) == "" and tok.decode(ids) == "the moon"
    assert tok.decode(torch.tensor(ids)) == tok.decode(np.array(ids)) == "the moon"
    assert tok.decode([300]) == ""   # an embedding's padding row past the tokenizer: nothing
    for messages in (None, [{"role": "user", "content": None}], [{"content": "hi"}]):
        with pytest.raises(ValueError, match="messages: expected a list of"):
            tok.apply_chat_template(messages)


_MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("call,needle", [
    # bool("no") is True: the EOS had been added, the generation prompt rendered, ...
    (lambda t: t.encode("hi", add_eos="no"), "add_eos='no' must be a boolean or None, not str"),
    (lambda t: t.encode("hi", add_bos=0), "add_bos=0 must be a boolean or None, not int"),
    (lambda t: t.encode_chat(_MSGS, add_generation_prompt="no"), "add_generation_prompt='no' must be a boolean"),
    (lambda t: t.decode([1], skip_special_tokens="no"), "skip_special_tokens='no' must be a boolean"),
    # had raised TypeError: unhashable type: 'list'
    (lambda t: t.encode_chat(_MSGS, template=["default"]),
     r"template: expected a chat template's name \(a str\) or None, got \['default'\]"),
])
def test_tokenizer_argument_types(call, needle):
    tok = Tokenizer.from_tokenizer_json(H.build_tokenizer(300).to_str(), {"chat_template": H.CHATML})
    with pytest.raises(ValueError, match=needle):
        call(tok)


# Pieces of real templates that lean on what transformers' apply_chat_template gives a template:
# Llama 3.2's date line (strftime_now), a {% generation %} block (templates made for training
# masks), and a tools/documents test written without `is defined` (transformers passes None).
_LLAMA32_DATE = ('{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}'
                 '{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}'
                 '{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- endif %}'
                 '{{- "Today Date: " + date_string + "\\n\\n" }}'
                 "{%- for m in messages %}{{- m['role'] + ': ' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}")
_GENERATION = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
               "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}"
               "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_TOOLS_NONE = ("{% if tools is not none %}[TOOLS]{% for t in tools %}{{ t | tojson }}{% endfor %}[/TOOLS]"
               "{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
               "{% for m in messages %}{{ m.content }}{% endfor %}")


# a Qwen3-style tool section: the schemas up front, an assistant's tool_calls, a tool's result
_TOOL_CALLS = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
               "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
               "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
               "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
               "{% endif %}")
_WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city, °C",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("template", [_LLAMA32_DATE, _GENERATION, _TOOLS_NONE, _TOOL_CALLS])
def test_chat_template_renders_as_transformers_does(template):
    """The same string as transformers' apply_chat_template: the date was "26 Jul 2024" (no
    strftime_now), {% generation %} was a TemplateSyntaxError, and `tools is not none` rendered
    an empty tool list (tools undefined). tools and documents reach the template (they were
    refused, so no tool-calling template could be used), with an assistant's tool_calls beside
    no content and the tool's answer."""
    from transformers import PreTrainedTokenizerFast

    raw = H.build_tokenizer(300)
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    tok = Tokenizer.from_tokenizer_json(raw.to_str(), {**cfg, "chat_template": template})
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=template, **cfg)
    for msgs in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"}]):
        for agp in (True, False):
            assert tok.apply_chat_template(msgs, add_generation_prompt=agp) == \
                hf.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False), (msgs, agp)
    calls = [{"role": "user", "content": "Paris?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "21"}]
    docs = [{"title": "a", "text": "b"}]
    for kw in (dict(tools=[_WEATHER]), dict(tools=[_WEATHER], documents=docs), dict(documents=docs)):
        got = tok.apply_chat_template(calls, **kw)
        assert got == hf.apply_chat_template(calls, tokenize=False, add_generation_prompt=True, **kw), kw
        text = tok.encode(got, add_bos=False, add_eos=False)
        assert tok.encode_chat(calls, **kw)[-len(text):] == text   # (encode_chat: the same, BOS or not)
    for bad in ({"name": "weather"}, [1], "x"):
        with pytest.raises(ValueError, match="tools: expected a list of dicts"):
            tok.apply_chat_template(calls, tools=bad)


def test_an_empty_chat_template_is_said():
    """An empty template (tokenizer.chat_template = "") read as "no default" beside the named
    list ['default'], which contradicted itself; it is named as empty now."""
    raw = H.build_tokenizer(300)
    tok = Tokenizer.from_tokenizer_json(raw.to_str(), {"chat_template": ""})
    with pytest.raises(ValueError, match=r"^this model's chat template is empty \(tokenizer.chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


_NAMED = [{"name": "default", "template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"},
          {"name": "tool_use", "template": "{% for m in messages %}<tool>{{ m.content }}{% endfor %}"}]


def test_named_chat_templates_as_transformers_and_llama_cpp_store_them(tmp_path):
    """tokenizer_config.json's list of {name, template}: the default renders as transformers
    renders it, a named one by name (--chat-template); a list with no "default" needs a name, as
    transformers says (it rendered the first one silently); a GGUF keeps them as gguf-py's
    add_chat_template writes them (tokenizer.chat_template[.NAME], tokenizer.chat_templates)."""
    from types import SimpleNamespace

    import gguf
    from transformers import PreTrainedTokenizerFast

    from quantzoo.model.export import _write_tokenizer_files
    from quantzoo.model.gguf_loader import read_metadata

    raw = H.build_tokenizer(300)
    msgs = [{"role": "user", "content": "hi"}]
    for named in (_NAMED, _NAMED[1:]):
        tok = Tokenizer.from_tokenizer_json(raw.to_str(), {"chat_template": named})
        hf = PreTrainedTokenizerFast(tokenizer_object=raw, chat_template={t["name"]: t["template"] for t in named})
        assert tok.apply_chat_template(msgs, template="tool_use") == \
            hf.apply_chat_template(msgs, chat_template="tool_use", tokenize=False) == "<tool>hi"
        if len(named) == 2:
            assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False) == "[user] hi"
        else:
            with pytest.raises(ValueError, match="no default"):
                hf.apply_chat_template(msgs, tokenize=False)
            with pytest.raises(ValueError, match=r"the named chat templates \['tool_use'\] and no default"):
                tok.apply_chat_template(msgs)
        with pytest.raises(ValueError, match=r"chat template 'chatml': this model has the named templates"):
            tok.apply_chat_template(msgs, template="chatml")
        w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
        w.add_chat_template(named)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        meta = read_metadata(gguf.GGUFReader(tmp_path / "t.gguf"), "t.gguf", prefix="tokenizer.")
        g = Tokenizer.from_gguf_fields({**_gguf_vocab(), **meta}, "t.gguf")
        assert g.chat_templates == tok.chat_templates and g.chat_template == tok.chat_template
        out = tmp_path / f"hf{len(named)}"   # a GGUF's named templates exported to an HF dir
        out.mkdir()
        _write_tokenizer_files(SimpleNamespace(hf_config=None, path=tmp_path, tokenizer=tok, gguf_meta=[]), out)
        tc = json.loads((out / "tokenizer_config.json").read_text())
        back = Tokenizer.from_tokenizer_json(str(out / "tokenizer.json"), tc)
        assert back.chat_templates == tok.chat_templates and back.chat_template == tok.chat_template
    plain = Tokenizer.from_tokenizer_json(raw.to_str(), {"chat_template": H.CHATML})
    assert plain.apply_chat_template(msgs, template="default") == plain.apply_chat_template(msgs)
    with pytest.raises(ValueError, match="no named templates"):
        Tokenizer.from_tokenizer_json(raw.to_str(), {}).apply_chat_template(msgs, template="x")



def test_named_chat_templates_saved_as_files_as_transformers_does(tmp_path):
    """transformers' save_pretrained writes several templates as files, not in
    tokenizer_config.json: the default in chat_template.jinja, the others in
    additional_chat_templates/NAME.jinja; from_pretrained reads both. The loader read only the
    first (--chat-template tool_use: "this model has the named templates ['default']"), and an
    export of such a directory dropped the others."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from quantzoo.model.export import _write_tokenizer_files
    from quantzoo.model.hf_loader import load_tokenizer

    raw = H.build_tokenizer(300)
    msgs = [{"role": "user", "content": "hi"}]
    for named in (_NAMED, _NAMED[1:]):
        src, out = tmp_path / f"src{len(named)}", tmp_path / f"out{len(named)}"
        PreTrainedTokenizerFast(tokenizer_object=raw, chat_template={t["name"]: t["template"] for t in named}
                                ).save_pretrained(src)
        assert (src / "additional_chat_templates" / "tool_use.jinja").exists()
        hf = AutoTokenizer.from_pretrained(src)
        out.mkdir()
        _write_tokenizer_files(SimpleNamespace(hf_config={}, path=src, tokenizer=None, gguf_meta=[]), out)
        for d in (src, out):
            tok = load_tokenizer(d)
            assert tok.chat_templates == {t["name"]: t["template"] for t in named}, d
            assert tok.apply_chat_template(msgs, template="tool_use") == \
                hf.apply_chat_template(msgs, chat_template="tool_use", tokenize=False) == "<tool>hi"
            if len(named) == 2:
                assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False)
            else:
                with pytest.raises(ValueError, match="no default"):
                    tok.apply_chat_template(msgs)

def test_named_chat_template_reaches_the_ids(tmp_path, monkeypatch, capsys):
    """encode_chat(template=NAME) and `run model --chat --chat-template NAME` tokenize the named
    template's text -- the ids transformers gives for chat_template=NAME -- not the default's."""
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast

    import quantzoo.model
    import quantzoo.model.generate as gen
    from quantzoo.cli import main

    raw = H.build_tokenizer(300)
    tok = Tokenizer.from_tokenizer_json(raw.to_str(), {"chat_template": _NAMED})
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, chat_template={t["name"]: t["template"] for t in _NAMED})
    msgs = [{"role": "user", "content": "hi"}]
    want = hf.apply_chat_template(msgs, chat_template="tool_use", tokenize=True)["input_ids"]
    assert tok.encode_chat(msgs, template="tool_use") == want
    assert tok.encode_chat(msgs) == hf.apply_chat_template(msgs, tokenize=True)["input_ids"] != want
    seen = []

    def warm_up(m, ids, *a, **k):
        seen.append(list(ids))
        raise ValueError("stop here")

    monkeypatch.setattr(quantzoo.model, "load_model", lambda *a, **k: SimpleNamespace(is_cuda=False, tokenizer=tok))
    monkeypatch.setattr(gen, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(gen, "warm_up", warm_up)
    for extra, ids in ((["--chat-template", "tool_use"], want), ([], tok.encode_chat(msgs))):
        assert main(["run", "model", "--model", str(tmp_path), "--device", "cpu", "--chat", "--prompt", "hi",
                     *extra]) == 2
        assert "stop here" in capsys.readouterr().err and seen[-1] == ids, extra


@pytest.mark.parametrize("kv,needle", [
    ({"tokenizer.chat_templates": ["tool_use"]}, "names 'tool_use', but tokenizer.chat_template.tool_use is missing"),
    ({"tokenizer.chat_templates": ["tool_use"], "tokenizer.chat_template.tool_use": 5},
     "tokenizer.chat_template.tool_use is not a string"),
    ({"tokenizer.chat_templates": "tool_use", "tokenizer.chat_template.tool_use": "x"},
     "tokenizer.chat_templates must be an array of names"),
    ({"tokenizer.chat_templates": [5]}, "tokenizer.chat_templates must be an array of names"),
])
def test_gguf_named_chat_template_keys_of_the_wrong_shape(kv, needle):
    """gguf-py's add_chat_template writes tokenizer.chat_templates as an array of names, each
    with its tokenizer.chat_template.NAME string: any other shape is one clear error."""
    with pytest.raises(ValueError, match=needle):
        Tokenizer.from_gguf_fields({**_gguf_vocab(), **kv}, "t.gguf")


def test_a_single_gguf_chat_template_exported_as_transformers_writes_it(tmp_path):
    """A GGUF's one template, exported to an HF directory: tokenizer_config.json's chat_template
    is the string (what transformers writes for one template; the list is for named ones), and
    transformers' from_pretrained renders it as the runner does."""
    from types import SimpleNamespace

    import gguf
    from transformers import AutoTokenizer

    from quantzoo.model.export import _write_tokenizer_files
    from quantzoo.model.gguf_loader import read_metadata

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_chat_template(H.CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    meta = read_metadata(gguf.GGUFReader(tmp_path / "t.gguf"), "t.gguf", prefix="tokenizer.")
    tok = Tokenizer.from_gguf_fields({**_gguf_vocab(), **meta}, "t.gguf")
    assert tok.chat_templates == {"default": H.CHATML}
    out = tmp_path / "hf"
    out.mkdir()
    _write_tokenizer_files(SimpleNamespace(hf_config=None, path=tmp_path, tokenizer=tok, gguf_meta=[]), out)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == H.CHATML
    msgs = [{"role": "user", "content": "hi"}]
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) \
        == tok.apply_chat_template(msgs)


def _gguf_vocab():
    toks = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": toks,
            "tokenizer.ggml.token_type": [1] * len(toks), "tokenizer.ggml.merges": []}


def test_warm_up_prefills_again_when_a_workspace_grew():
    """generate.warm_up (quantzoo run model's untimed pass, CUDA): a prefill during which a
    workspace grew has lost the plans recorded before the growth, so it prefills again -- until
    one grows nothing, at most `tries` times; a CPU model is not warmed up."""
    from types import SimpleNamespace

    from quantzoo import cuda_launch as cl
    from quantzoo.model.generate import warm_up

    def fake(grows):
        calls = []

        def prefill(ids):
            calls.append(1)
            if len(calls) <= grows:
                cl.workspaces_changed()
            return torch.tensor([0.0, 1.0])
        return SimpleNamespace(is_cuda=True, prefill=prefill), calls

    for grows, want in ((0, 1), (1, 2), (2, 3), (5, 3)):
        m, calls = fake(grows)
        warm_up(m, [1, 2], tries=3)
        assert len(calls) == want, (grows, len(calls))
    m, calls = fake(1)
    m.is_cuda = False
    warm_up(m, [1, 2])
    assert calls == []


def test_steps_queued_past_a_stop_leave_the_sequence_intact(model):
    """Greedy look-ahead queues steps past the token that ends a generation; they write the KV
    cache past the sequence. A continuation from the sequence's end (prefill with start) must
    still equal the whole sequence's logits, and the next generation a fresh model's."""
    ids = [5, 9, 2, 7]
    greedy = model.generate(ids, max_new_tokens=12, eos_token_ids=[], look_ahead=False)
    for k in (0, 3, 8):
        got = model.generate(ids, max_new_tokens=12, eos_token_ids=[greedy[k]], look_ahead=True)
        assert got == greedy[:k + 1]
        seq = ids + got
        tail = model.prefill(seq[-1:] + [11, 12], start=len(seq) - 1)
        torch.testing.assert_close(tail.float(), model.logits(seq + [11, 12])[-1], rtol=1e-5, atol=1e-5)
    assert model.generate(ids, max_new_tokens=12, eos_token_ids=[], look_ahead=True) == greedy


def test_logits_are_an_ordinary_tensor_and_numpy_seeds_work(model):
    """m.logits had returned the inference-mode tensor itself (on CPU), which refuses an in-place
    edit and autograd; a numpy integer seed passed the checks and then crashed manual_seed."""
    lg = model.logits([1, 2, 3])
    assert lg.dtype == torch.float32 and lg.device.type == "cpu" and not lg.is_inference()
    lg[0, 5] = -1e9
    w = torch.ones(lg.shape[-1], requires_grad=True)
    (lg[1:] * w).sum().backward()
    assert torch.equal(w.grad, lg[1:].sum(0))
    a = model.generate([1, 2], max_new_tokens=6, temperature=1.0, seed=np.int64(7))
    assert a == model.generate([1, 2], max_new_tokens=6, temperature=1.0, seed=7)
