"""Token generation: prefill the prompt once, then one decode step per new token.

Sampling: temperature 0 is greedy (argmax). Otherwise logits / temperature, then top-k (keep
the k largest), then top-p (keep the smallest set of tokens whose probability reaches p,
always at least one), then min-p (drop a token less likely than min_p times the most likely
one), in transformers' order; then a draw by inverse CDF from one uniform of a seeded
torch.Generator on the CPU, so a seed gives the same text on CPU and GPU up to the logits
themselves.

Stopping: an end-of-generation id (tokenizer.eos_token_ids, or `eos_token_ids=`) or a stop
string in the decoded text. Streaming: `stream(text)` receives the new text as it becomes
final: bytes of an unfinished UTF-8 character, and any tail that could still grow into a stop
string, are held back until they resolve. The text is decoded incrementally (tokenizer.py
TextSoFar), so a token costs the same host time at 10 tokens and at 4,000.

Greedy decoding on CUDA queues the next steps on the GPU, fed the previous step's argmax there,
before the host reads their tokens (`look_ahead`): the host's work per token then overlaps the
GPU's (the loop below says what that costs).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .config import is_int, is_real, token_ids
from .tokenizer import TextSoFar

AHEAD = 2   # greedy decode steps queued on the GPU ahead of the host (look_ahead)


@dataclass
class Generation:
    """What generate() returns (Model.generate returns its tokens): the new ids, their text, why
    generation stopped, and the prompt's and the decode's token counts and seconds."""

    tokens: list[int]                 # new ids (the stop id included when one ended it)
    text: str = ""                    # decoded new text, cut before a stop string
    stop_reason: str = "length"       # "length" | "eos" | "stop"
    prompt_tokens: int = 0
    cached_tokens: int = 0            # of the prompt's, found in the KV cache (reuse_cache) and not prefilled
    prefill_s: float = 0.0
    decode_s: float = 0.0             # time of the decode steps after the first new token
    decode_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")


def check_sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed=None,
                   min_p: float = 0.0, flags: bool = False) -> None:
    """A clear error naming each sampling setting out of its range, or the first one greedy
    decoding (temperature 0) would ignore; flags: named as the CLI's (--top-k 40), not top_k=40."""
    bad = [f"{name}={v!r} {rule}" for name, v, ok, rule in (
        ("temperature", temperature, is_real(temperature) and temperature >= 0,
         "must be a finite number >= 0 (0 = greedy)"),
        ("top_k", top_k, is_int(top_k) and top_k >= 0, "must be an integer >= 0 (0 = off)"),
        ("top_p", top_p, is_real(top_p) and 0 < top_p <= 1, "must be in (0, 1] (1 = off)"),
        ("min_p", min_p, is_real(min_p) and 0 <= min_p <= 1, "must be in [0, 1] (0 = off)"),
        ("seed", seed, seed is None or is_int(seed) and 0 <= seed < 2**63, "must be an integer in [0, 2^63)"))
        if not ok]
    if bad:
        raise ValueError("sampling: " + "; ".join(bad))
    if temperature == 0:   # greedy: a filter or a seed would be ignored, the text not sampled
        for name, v, off in (("top_k", top_k, 0), ("top_p", top_p, 1.0), ("min_p", min_p, 0.0), ("seed", seed, None)):
            if v != off:
                what = f"--{name.replace('_', '-')} {v}" if flags else f"{name}={v!r}"
                t = "--temperature" if flags else "temperature"
                raise ValueError(f"{what}: {'seeds' if name == 'seed' else 'filters'} sampled tokens, but {t} 0 "
                                 f"(the default) decodes greedily; set {t} > 0")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, min_p: float = 0.0) -> int:
    """One token id from a (V,) logits vector: the filters in transformers' order (temperature,
    top-k, top-p, then min-p: a token stays if its probability is at least min_p times the top
    one's, which no renormalisation changes)."""
    check_sampling(temperature, top_k, top_p, min_p=min_p)
    if temperature == 0:
        return int(torch.argmax(logits))
    # The filtering and the sort run on the logits' device (copying the logits to the host and
    # sorting them there cost 7 ms a token on the lent H100's host: decode 129 tok/s sampled
    # against 1,194 greedy, SmolLM2); the running sums run on the CPU in float64, because a GPU
    # cumsum adds in an order that varies from run to run, and with many near-equal
    # probabilities that moved a seeded draw (seen on the H100 with a random-weight model).
    lg = logits.float()
    # <= 0 and the top at 0: no overflow at any temperature. Below float32's smallest normal the
    # temperature is taken as that (the top token(s) only, either way): a smaller one would become
    # a float32 subnormal or 0, and the top 0 / 0 = NaN.
    lg = (lg - lg.max()) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k and top_k < lg.numel():
        kth = torch.topk(lg, top_k).values[-1]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    # min-p: p / p_top = exp(lg), the top's lg being 0. Masked here unless top-p is on, which
    # must see the mass of the tokens min-p drops (its set is then cut to min-p's below).
    log_min_p = math.log(min_p) if min_p > 0 else None
    if log_min_p is not None and top_p == 1.0:
        lg = lg.masked_fill(lg < log_min_p, float("-inf"))
    p, order = torch.softmax(lg, dim=-1), None
    if top_p < 1.0:
        # The smallest set, most likely first, whose mass reaches top_p (at least one token). It is
        # a prefix of the sorted tokens, so only a prefix that holds it comes to the host (1,024
        # tokens, more while their mass is short of top_p and the rest are not all 0). Copying and
        # scanning the whole vocabulary made a call 688 us on the H100's host against 299 now (V =
        # 49,152; bench/NOTES.md, session 36). The prefix's sums are the whole list's, so the draw
        # is the same.
        p, order = torch.sort(p, descending=True, stable=True)
        n = min(p.numel(), 1024)
        while True:
            head = p[:n].cpu()
            cdf = head.cumsum(0, dtype=torch.float64)
            if n == p.numel() or cdf[-1] >= top_p or head[-1] == 0:
                break
            n = min(p.numel(), 8 * n)
        # the tokens whose preceding mass is below top_p, none of probability 0
        keep = min(n, 1 + int(torch.searchsorted(cdf, torch.tensor([top_p], dtype=torch.float64))),
                   int(torch.count_nonzero(head)))
        if log_min_p is not None:   # min-p's set is a prefix of the sorted tokens too
            keep = min(keep, int((head >= head[0] * min_p).sum()))
        keep = max(1, keep)
    else:   # token order: every token (one of probability 0 adds nothing to cdf, so is never drawn)
        cdf = p.cpu().cumsum(0, dtype=torch.float64)
        keep = cdf.numel()
    # the draw, by inverse CDF: one uniform u from the (CPU) generator, then the first token whose
    # cumulative probability exceeds u (right=True never picks a token of probability 0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    j = int(torch.searchsorted(cdf[:keep], (u * cdf[keep - 1]).reshape(1), right=True).clamp_max(keep - 1))
    return j if order is None else int(order[j])


class HostTokens:
    """Token ids copied from the GPU to the host without waiting for the work queued after them:
    int(tensor) would wait for the whole stream, the steps queued ahead included. Each id goes
    through a pinned slot and an event; `slots` ids may be in flight. Ids of a CPU tensor are
    read at once."""

    def __init__(self, slots: int):
        self.slots, self.n, self.buf, self.events = slots, 0, None, None

    def put(self, t: torch.Tensor):
        """Start copying the one-element tensor t to the host; returns a function that returns
        its value once it is there."""
        if t.device.type != "cuda":
            value = int(t)
            return lambda: value
        if self.buf is None:
            self.buf = torch.empty(self.slots, dtype=torch.int64, pin_memory=True)
            self.events = [torch.cuda.Event() for _ in range(self.slots)]
        k = self.n % self.slots
        self.n += 1
        self.buf[k].copy_(t, non_blocking=True)
        self.events[k].record(torch.cuda.current_stream(t.device))

        def get() -> int:
            self.events[k].synchronize()
            return int(self.buf[k])
        return get


def warm_up(model, ids, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, tries: int = 3,
            min_p: float = 0.0) -> None:
    """generate()'s timed region once, untimed (CUDA; after prepare): the kernels load (CUDA loads
    each lazily, on first use: up to tens of ms) and the prefill's launch plans are recorded. A
    workspace that grows inside a prefill (its first use at this M) drops every plan recorded
    before it (cuda_launch.workspaces_changed): such a prefill left 14 of a 4-layer model's 16
    plans (H100 GPU tier, bench/NOTES.md session 32), and the timed one recorded the others. So
    the prefill runs again until one grows nothing: workspaces only grow, so a second prefill of
    the same prompt finds them large enough. The sample takes a throwaway generator: a seed's
    draws stay as they were."""
    from quantzoo.cuda_launch import workspace_generation

    if not model.is_cuda:
        return
    for _ in range(tries):
        gen = workspace_generation()
        sample(model.prefill(ids), temperature, top_k, top_p, torch.Generator(), min_p)
        if workspace_generation() == gen:
            return


def _sync(model):
    if model.is_cuda:
        torch.cuda.synchronize(model.device)


def prepare(model, prompt_tokens: int, max_new_tokens: int, keep: bool = False) -> None:
    """What generate() sets up before its timed region: a KV cache that holds the whole sequence,
    and on GPU the decode graph for it (keep: a larger cache keeps the current sequence's rows,
    for reuse_cache). The warm-up prefill comes after this call: until session 44 a capture grew
    the cached workspaces, which dropped every recorded launch plan (kernels.run_planned), and
    `quantzoo run model`'s timed 38-token prefill of the default model took 27 ms with its warm-up
    before the capture, 9 ms after (H100); a capture's workspaces are now its own
    (kernels/workspaces.py)."""
    # the prompt's positions, and one per decode step: the first new token comes from the prefill
    # and the last is never fed back, so max_new_tokens - 1 steps
    need = prompt_tokens + max(max_new_tokens - 1, 0)
    if model.k_cache is None or model.k_cache.shape[3] < need:
        if need > model.max_seq:
            raise ValueError(f"prompt ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) takes {need} positions "
                             f"(the last new token is not fed back); that exceeds the model's max_seq {model.max_seq}")
        model.setup_cache(min(model.max_seq, max(256, -(-need // 256) * 256)), keep=keep)
    model.ensure_graph()   # once per cache size, outside the timed region


def _holding_the_model(fn):
    """fn(model, ...) with the model's lock held throughout: a generation is many calls on the
    model's one KV cache and sequence, and another thread's prefill or step between two of them
    gave both wrong tokens (or a "skips positions" error); the other thread now waits. (An
    object that only looks like a Model, with no lock, is run as it is.)"""
    import contextlib
    import functools

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with getattr(model, "_lock", None) or contextlib.nullcontext():
            return fn(model, *args, **kwargs)
    return wrapper


@_holding_the_model
def generate(model, ids, max_new_tokens: int = 48, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop=None, stream=None,
             eos_token_ids=None, look_ahead: bool | None = None, min_p: float = 0.0,
             reuse_cache: bool = False) -> Generation:
    """Prefill ids, then decode up to max_new_tokens new ones (the module docstring says how
    they are sampled and when generation stops). look_ahead: queue greedy decode steps on the GPU
    ahead of the host (below); None = on for greedy decoding on CUDA. reuse_cache: prefill only
    what follows the longest prefix of ids that the KV cache already holds (model.cached_prefix:
    the tokens last run at positions 0, 1, ..; after a generation its prompt and the tokens it fed
    back), as a chat's next turn needs. The same sums split at another place: float32 rounding on
    the CPU; on CUDA a piece of another length may take a kernel that sums in another order, so a
    near-tie may pick another token than a whole prefill (README). The model is held (its lock)
    for the whole call, `stream` callbacks included: a callback that waits for another thread's
    call on this model waits for ever."""
    ids = token_ids(ids, model.config.vocab_size)
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    check_sampling(temperature, top_k, top_p, seed, min_p)
    if look_ahead is None:
        look_ahead = temperature == 0 and model.is_cuda
    elif look_ahead is not True and look_ahead is not False:
        raise ValueError(f"look_ahead={look_ahead!r} must be True, False or None")
    elif look_ahead and temperature != 0:
        raise ValueError("look_ahead=True needs greedy decoding (temperature 0): a sampled token is "
                         "drawn on the host, so no step can be queued before it")
    tok = model.tokenizer
    if eos_token_ids is None:
        eos_token_ids = list(tok.eos_token_ids) if tok is not None else list(model.config.eos_token_ids)
    elif is_int(eos_token_ids) or getattr(eos_token_ids, "ndim", None) == 0:   # one id (a 0-d array too)
        eos_token_ids = [eos_token_ids.item() if hasattr(eos_token_ids, "item") else eos_token_ids]
    elif not hasattr(eos_token_ids, "__len__") or isinstance(eos_token_ids, (str, bytes)):
        raise ValueError(f"eos_token_ids={eos_token_ids!r}: expected a token id or a sequence of them")
    # any integer >= 0 may be a stop id (one past the vocabulary never comes)
    neg = [i for i in list(eos_token_ids) if is_int(i) and i < 0]
    if neg:
        raise ValueError(f"eos_token_ids: {neg[0]} is not a token id (ids are >= 0)")
    eos = set(token_ids(eos_token_ids, 2**63, "eos_token_ids")) if len(eos_token_ids) else set()
    if stop is not None and not isinstance(stop, (str, list, tuple)):   # (a dict gave its keys, 0 none)
        raise ValueError(f"stop: {stop!r}; a str or a list of them")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop: {stop!r}; stop strings must be non-empty str")
    if stream is not None and not callable(stream):
        raise ValueError(f"stream: {type(stream).__name__} is not callable (it is given each new piece of text)")
    if (stops or stream) and tok is None:
        raise ValueError("stop strings and streaming need a tokenizer; this model has none")
    if reuse_cache is not True and reuse_cache is not False:
        raise ValueError(f"reuse_cache={reuse_cache!r} must be True or False")
    gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None   # (numpy ints too)
    prepare(model, len(ids), max_new_tokens, keep=reuse_cache)
    # (at least the last prompt token is run: its logits give the first new token)
    cached = min(model.cached_prefix(ids), len(ids) - 1) if reuse_cache and max_new_tokens else 0

    out = Generation(tokens=[], prompt_tokens=len(ids), cached_tokens=cached)
    emitted = 0  # characters of text already streamed
    text_so_far = TextSoFar(tok.decode, context=ids) if tok is not None else None

    def flush(final: bool) -> bool:
        """Decode, cut at a stop string, stream what is final; True when a stop string hit."""
        nonlocal emitted
        if tok is None:
            return False
        text = text_so_far.text
        # cut at the earliest stop string, whatever the order of `stops` (cutting at each in turn
        # let the front of an earlier, overlapping one through)
        cuts = [j for j in (text.find(s) for s in stops) if j >= 0]
        hit = bool(cuts)
        if hit:
            text = text[:min(cuts)]
        out.text = text
        safe = len(text)
        if not final and not hit:
            if text.endswith("\ufffd"):           # an unfinished UTF-8 character
                safe = len(text.rstrip("\ufffd"))
            for s in stops:                       # a tail that may become a stop string
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text.endswith(s[:n], 0, safe):
                        safe -= n
                        break
        if stream is not None and safe > emitted:
            stream(text[emitted:safe])
            emitted = safe
        return hit

    if max_new_tokens == 0:
        return out
    _sync(model)
    t0 = time.perf_counter()
    logits = model.prefill(ids[cached:], start=cached)
    dev = torch.argmax(logits) if look_ahead else None   # the token on the device, for the steps queued ahead
    nxt = int(dev) if look_ahead else sample(logits, temperature, top_k, top_p, gen, min_p)
    _sync(model)
    out.prefill_s = time.perf_counter() - t0
    # (after the clock: a first isfinite on the GPU loads its kernels, which took ~45 ms on the H100)
    if not bool(torch.isfinite(logits).all()):   # sampling NaNs would emit garbage without a word
        raise ValueError("the prompt's next-token logits are not finite (NaN/inf): the model's weights hold "
                         "non-finite values, or its activations overflowed")
    # Look-ahead (greedy): up to AHEAD decode steps are queued on the GPU, each fed the previous
    # one's argmax there, before the host reads their tokens; the host's per-token work (stop
    # checks, detokenizing, streaming, the launch itself) then overlaps the GPU's instead of
    # leaving it idle between steps. A stop leaves up to AHEAD steps wasted; what they wrote to
    # the KV cache lies past the tokens generated, where the next prefill or step overwrites it
    # before any attention reads it (reuse_cache reads it only where the host knows the token
    # such a step was fed: Model.fed). (A sampled token is drawn on the host, so a seed draws the
    # same on CPU and GPU; launching its step as soon as it was drawn, before the host handled it,
    # gained nothing measurable on the H100: bench/NOTES.md, session 36.)
    reader = HostTokens(AHEAD)
    queued = deque()   # functions returning the queued steps' tokens, oldest first
    launched = 0       # decode steps launched so far
    t1 = time.perf_counter()   # decode timing starts once the first new token is on the host
    try:
        while True:
            while look_ahead and len(queued) < AHEAD and launched < max_new_tokens - 1:
                dev = torch.argmax(model.decode_step(dev, len(ids) + launched))
                queued.append(reader.put(dev))
                launched += 1
            out.tokens.append(nxt)
            if nxt in eos:
                out.stop_reason = "eos"
                break
            if text_so_far is not None:
                text_so_far.add(nxt)
            if flush(final=False):
                out.stop_reason = "stop"
                break
            if len(out.tokens) >= max_new_tokens:
                break
            if look_ahead:
                nxt = queued.popleft()()
            else:
                nxt = sample(model.decode_step(nxt, len(ids) + launched), temperature, top_k, top_p, gen, min_p)
                launched += 1
            out.decode_tokens += 1
        if out.decode_tokens:
            out.decode_s = time.perf_counter() - t1   # (every token is on the host by now)
    finally:
        # the tokens look-ahead steps fed from the GPU are known now (model.cached_prefix; also
        # after a Ctrl-C); steps queued past a stop fed tokens the host never read: unknown
        model.fed(len(ids), out.tokens[:launched])
    _sync(model)   # (steps queued past a stop finish here, outside the timing)
    if out.stop_reason != "stop":
        flush(final=True)
    return out
