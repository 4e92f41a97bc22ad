"""generate(reuse_cache=True): a prompt that begins with what the KV cache already holds (the last
generation's prompt and the tokens it fed back, as a chat's next turn does) prefills only the rest,
and gives what a whole prefill gives (CPU, float32: the same sums split at another place)."""
from __future__ import annotations

import pytest
import torch

from quantzoo.bench.model import make_config, synthetic_model
from quantzoo.model.generate import generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return synthetic_model("q4_0", make_config(1, tiny=True), "cpu")   # vocab 1024, no tokenizer


def _fresh_logits(model, ids):
    return model.logits(ids)[-1]


@pytest.mark.parametrize("look_ahead", [False, True])
def test_a_next_turn_prefills_only_what_is_new(model, look_ahead):
    """Turn 1 leaves its prompt and the fed-back tokens in the cache (all but the last new token,
    which no step was fed); turn 2's prompt extends them, so only its tail is prefilled, and its
    tokens equal those of a generation from an empty cache. look_ahead=True (forced on the CPU)
    feeds its steps from the device tensor, whose values the sequence learns afterwards."""
    ids1 = [(7 * i + 3) % 1000 for i in range(37)]
    g1 = generate(model, ids1, max_new_tokens=9, eos_token_ids=[], look_ahead=look_ahead)
    assert g1.cached_tokens == 0 and len(g1.tokens) == 9
    assert model.cached_prefix(ids1 + g1.tokens) == len(ids1) + 8
    ids2 = ids1 + g1.tokens + [5, 6, 7]
    g2 = generate(model, ids2, max_new_tokens=12, eos_token_ids=[], look_ahead=look_ahead, reuse_cache=True)
    assert g2.cached_tokens == len(ids1) + 8 and g2.prompt_tokens == len(ids2)
    model.setup_cache(model.k_cache.shape[3] + 256)   # a cache of another size holds no sequence (without keep)
    assert model.cached_prefix(ids2) == 0
    want = generate(model, ids2, max_new_tokens=12, eos_token_ids=[], look_ahead=look_ahead)
    assert want.cached_tokens == 0 and g2.tokens == want.tokens


def test_the_common_prefix_only_and_the_last_token_always(model):
    """Only the common prefix is reused: a prompt that diverges inside the cached sequence is
    prefilled from the divergence on; the same prompt again still runs its last token (its
    logits give the first new token); reuse_cache=False prefills the whole prompt."""
    ids = [(11 * i + 1) % 1000 for i in range(20)]
    model.prefill(ids)
    for other, cached in ((ids[:12] + [999, 998], 12), (ids, 19), ([4] + ids, 0), (ids[:5], 4)):
        g = generate(model, other, max_new_tokens=1, reuse_cache=True)
        assert g.cached_tokens == cached, other
        assert g.tokens[0] == int(torch.argmax(_fresh_logits(model, other)))
        model.prefill(ids)
    assert generate(model, ids, max_new_tokens=1).cached_tokens == 0
    with pytest.raises(ValueError, match="reuse_cache=1 must be True or False"):
        generate(model, ids, max_new_tokens=1, reuse_cache=1)


def test_reused_logits_equal_a_whole_prefill(model):
    """The first new token's logits after a reused prefix agree with the whole prompt's, at the
    float32 rounding of another split of the same sums."""
    ids = [(13 * i + 2) % 1000 for i in range(50)]
    model.prefill(ids[:30])
    part = model.prefill(ids[model.cached_prefix(ids):], start=model.cached_prefix(ids))
    whole = _fresh_logits(model, ids)
    torch.testing.assert_close(part, whole, rtol=1e-4, atol=1e-4 * float(whole.abs().max()))


def test_a_growing_cache_keeps_the_sequence(model):
    """A turn that needs a larger cache than the last one allocated moves the sequence's rows into
    the new one (prepare's keep) instead of prefilling everything again."""
    model.setup_cache(256)
    ids1 = [(3 * i + 5) % 1000 for i in range(200)]
    g1 = generate(model, ids1, max_new_tokens=4, eos_token_ids=[])
    assert model.k_cache.shape[3] == 256
    ids2 = ids1 + g1.tokens + [(5 * i) % 1000 for i in range(100)]
    g2 = generate(model, ids2, max_new_tokens=4, eos_token_ids=[], reuse_cache=True)
    assert model.k_cache.shape[3] == 512 and g2.cached_tokens == 203
    model.setup_cache(256)
    model.setup_cache(512)   # (without keep: an empty cache)
    assert generate(model, ids2, max_new_tokens=4, eos_token_ids=[]).tokens == g2.tokens


def test_an_interrupted_pass_leaves_its_rows_unknown(model, monkeypatch):
    """A prefill or step interrupted (Ctrl-C) while it rewrites rows from start on must not leave
    those rows counted as the old tokens': cached_prefix stops at start."""
    ids = [(17 * i + 4) % 1000 for i in range(24)]
    model.prefill(ids)
    assert model.cached_prefix(ids) == 24

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "_forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.prefill([1, 2, 3], start=10)
    assert model.cached_prefix(ids) == 10
    with pytest.raises(KeyboardInterrupt):
        model.decode_step(9, 6)
    assert model.cached_prefix(ids) == 6 and model._length == 6


def test_an_interrupted_or_refused_growth_keeps_no_stale_rows(model, monkeypatch):
    """setup_cache(keep=True) counts the sequence as written only once the new cache is whole: an
    interrupt part way (here in the RoPE tables, after the rows were copied) leaves no cache and
    no sequence, not rows a later reuse would read from a half-built cache. Where the old and the
    new cache do not fit in memory together, the sequence goes and the new cache comes alone."""
    import quantzoo.model.llm as llm

    ids = [(3 * i + 1) % 1000 for i in range(40)]
    model.setup_cache(64)
    model.prefill(ids)
    real = llm.rope_tables

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm, "rope_tables", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.setup_cache(128, keep=True)
    assert model.k_cache is None and model.cached_prefix(ids) == 0
    monkeypatch.setattr(llm, "rope_tables", real)
    g = generate(model, ids, max_new_tokens=3, eos_token_ids=[], reuse_cache=True)
    assert g.cached_tokens == 0 and model.cached_prefix(ids) == 40

    calls, refuse = [], [True]

    def fits_alone(nbytes, positions, device):   # refuses the first check (both caches at once)
        calls.append(positions)
        if refuse.pop() if refuse else False:
            raise MemoryError("both do not fit")

    monkeypatch.setattr(llm, "check_cache_fits", fits_alone)
    model.setup_cache(model.k_cache.shape[3] + 64, keep=True)
    assert len(calls) == 2 and model.cached_prefix(ids) == 0 and model.k_cache is not None
    calls.clear()
    model.prefill(ids)
    model.setup_cache(model.k_cache.shape[3] + 64, keep=True)
    assert len(calls) == 1 and model.cached_prefix(ids) == 40



def test_two_threads_generating_on_one_model(model):
    """A generation is many calls on the model's one KV cache and sequence. A second thread's
    generate ran between the first one's steps (here: while its first decode step waits), whose
    prefill rewrote the cache: the first got another prompt's tokens, or a "skips positions"
    error. Now the second waits for the first, and both get what each gets alone."""
    import threading

    pa, pb = [(7 * i + 3) % 1000 for i in range(40)], [(11 * i + 5) % 1000 for i in range(30)]
    want = [generate(model, p, max_new_tokens=6, eos_token_ids=[]).tokens for p in (pa, pb)]
    forward, started, b_done = model._forward, threading.Event(), threading.Event()

    def slow_first_step(ids, pos, *a, **k):   # the first thread's first decode step: time for the second
        if threading.current_thread() is threading.main_thread() and len(ids) == 1 and not started.is_set():
            started.set()
            b_done.wait(0.3)
        return forward(ids, pos, *a, **k)

    got = {}

    def second():
        started.wait(5)
        try:
            got["b"] = generate(model, pb, max_new_tokens=6, eos_token_ids=[]).tokens
        finally:
            b_done.set()

    model._forward = slow_first_step
    try:
        t = threading.Thread(target=second, daemon=True)
        t.start()
        try:
            got["a"] = generate(model, pa, max_new_tokens=6, eos_token_ids=[]).tokens
        finally:
            t.join(30)
            assert not t.is_alive(), "the second thread never finished (a deadlock?)"
    finally:
        del model._forward
    assert [got["a"], got.get("b")] == want
