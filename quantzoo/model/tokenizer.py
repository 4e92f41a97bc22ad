"""Tokenizer: a `tokenizers` BPE plus special ids and a jinja2 chat template.

Two ways in:
- HF directories: `Tokenizer.from_tokenizer_json(path, tokenizer_config)`.
- GGUF files: `Tokenizer.from_gguf_fields(fields, path)` rebuilds the BPE from the
  `tokenizer.ggml.*` metadata the way llama.cpp reads it (llama-vocab.cpp). Byte-level BPE
  (`gpt2`): tokens, merges, token types, and the pre-tokenizer `tokenizer.ggml.pre` names, each
  name a split regex; an unknown name is an error, never a silent default (a wrong split still
  produces tokens, just not the ones the model was trained on). SentencePiece BPE (`llama`):
  tokens, scores and types, the merges derived from the scores (`_sentencepiece_bpe`).
"""
from __future__ import annotations

import codecs
import json
import math
import os
import re
import warnings
from datetime import datetime

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .config import check_bool, is_int, special_token_id, token_ids

# The split regexes llama.cpp uses per `tokenizer.ggml.pre` value (same patterns as the
# models' own tokenizer.json files). The contractions' letters are spelled [sS], not by (?i):
# case-folding would also match the long s U+017F as 's', which llama.cpp's splitters do not.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gpt2():   # ByteLevel's built-in regex is GPT-2's
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():   # starcoder/smollm: every digit on its own, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# name -> (pre-tokenizer factory, ignore_merges: a word found whole in the vocab is one token)
PRE_TOKENIZERS = {
    "gpt-2": (_gpt2, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3), True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3), True),
    "llama-v3": (lambda: _split_then_bytes(_LLAMA3), True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2), False),
    "smollm": (_digits_then_gpt2, False),
    "starcoder": (_digits_then_gpt2, False),
}

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_TYPE_NAMES = dict(enumerate(("NORMAL", "UNKNOWN", "CONTROL", "USER_DEFINED", "UNUSED", "BYTE"), 1))
# llama.cpp (llama-vocab.cpp, load) finds some special tokens by their text when the file's
# `tokenizer.ggml.<key>_token_id` does not name them: key -> the texts it looks for.
_FOUND_BY_TEXT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_DEPRECATED_KEY = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}   # read after the new key
# End of generation, as llama.cpp: the fim pad / repo / file-separator tokens, every token of
# these texts, and the eos, eot and eom ids. (gpt-oss's <|return|> / <|call|> are left out: its
# tokenizer needs more of llama.cpp's special cases than this runner's archs use.)
_EOG_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def _generation_tag():
    """jinja2 extension for `{% generation %}...{% endgeneration %}` (transformers marks the
    assistant's part with it, for training masks): renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def _library_error(e: BaseException) -> bool:
    """An error of the `tokenizers` package: an Exception, or a Rust panic, which pyo3 raises as
    PanicException, a BaseException that no `except Exception` (nor the CLI) catches."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


# what apply_chat_template itself passes to a chat template (as transformers does)
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token",
                               "eos_token")


# what a token id past the `tokenizers` range is not (decode's message)
_U32 = f"a u32 (the tokenizer's ids run 0 to {2**32 - 1})"


def check_template_variables(variables: dict, what: str = "chat template variables") -> dict:
    """Extra chat-template variables, or one clear error (what: the argument, for the message)."""
    if not isinstance(variables, dict):
        raise ValueError(f"{what}: expected an object of variables, got {type(variables).__name__}")
    taken = sorted(set(variables) & set(RESERVED_TEMPLATE_VARIABLES))
    if taken:
        raise ValueError(f"{what}: {taken} are set by the renderer itself "
                         f"({', '.join(RESERVED_TEMPLATE_VARIABLES)})")
    return variables


def sentencepiece_merges(tokens: list, vocab: dict, scores: list, types: list) -> list:
    """Every split of a NORMAL, UNUSED or USER_DEFINED token into two tokens, highest-scoring token
    first. (llama.cpp joins a pair into whatever token its text is; a user-defined token is also
    cut out of the raw text before, which misses one that holds U+2581 (a space's mark, as in
    U+2581 "the"): the merges then make it, as llama.cpp's do.)"""
    mergeable = sorted((i for i, ty in enumerate(types)
                        if ty in (NORMAL, UNUSED, USER_DEFINED) and vocab[tokens[i]] == i),
                       key=lambda i: -scores[i])
    merges = []
    for i in mergeable:
        t = tokens[i]
        merges += [(t[:j], t[j:]) for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab]
    return merges


def _sentencepiece_bpe(tokens: list, vocab: dict, scores: list, types: list, unk: str,
                       add_space_prefix: bool, path: str = "<gguf>") -> HFTokenizer:
    """llama.cpp's SPM tokenizer (tokenizer.ggml.model 'llama': Llama 1/2, TinyLlama, Mistral v0.1)
    as a `tokenizers` BPE.

    llama.cpp (and SentencePiece's BPE encoder) start from the UTF-8 characters of the text, with
    " " written as U+2581 and one U+2581 in front (add_space_prefix; llama.cpp also puts one after
    every special token), and repeatedly join the adjacent pair whose joined text is the vocabulary
    entry of highest score; a character left outside the vocabulary becomes its bytes' <0xXX>
    tokens (or <unk> without them). The same result as a BPE: every split of a vocabulary entry
    into two entries is a merge, ranked by the joined entry's score. (Where two different pairs
    tie on score, both encoders join the leftmost and a BPE the lower-ranked one; SentencePiece's
    vocabularies give every entry its own score, llama.cpp's converter gives every token of a
    tokenizer.json-only Llama -1000: a warning says so.) The normalizer runs on each piece between
    special tokens, so the prefix goes where llama.cpp puts it."""
    from tokenizers import normalizers

    merges = sentencepiece_merges(tokens, vocab, scores, types)
    made = {a + b for a, b in merges}
    joined = [scores[vocab[t]] for t in made]
    if len(set(joined)) < len(joined):
        warnings.warn(f"{path}: {len(joined) - len(set(joined))} of the {len(joined)} tokens that merges make "
                      "share their score with another; where such pairs compete llama.cpp joins the leftmost, "
                      "this tokenizer the earlier token in the vocabulary, so a few texts may split differently",
                      stacklevel=3)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                 byte_fallback=any(ty == BYTE for ty in types)))
    prefix = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + strip)
    return tok


class Tokenizer:
    """encode/decode text, special ids, chat template. Wraps a `tokenizers.Tokenizer` (`tok`).

    Attributes: bos_token_id (or None), eos_token_ids (the ids generation stops at), add_bos /
    add_eos (what encode adds by default), bos_token / eos_token (their text, for templates),
    chat_template (the default template or None) and chat_templates (name -> template)."""

    def __init__(self, tok: HFTokenizer, *, bos_token_id=None, eos_token_ids=(), add_bos=False,
                 add_eos=False, chat_template: str | None = None, bos_token: str = "", eos_token: str = "",
                 chat_templates: dict | None = None):
        self.tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos) and bool(self.eos_token_ids)   # appends eos_token_ids[0]
        self.chat_templates = dict(chat_templates or {})     # every named one (name -> template)
        if chat_template is not None:
            self.chat_templates.setdefault("default", chat_template)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.piece_bytes: SentencePieceText | None = None   # a GGUF SentencePiece vocabulary's decode
        # (token, id) of the largest id where it is past vocab_size - 1 (a tokenizer.json's ids need
        # not be dense: `tokenizers` counts the entries), else None: ModelConfig.check_tokenizer's
        self.stray_id: tuple[str, int] | None = None

    @property
    def chat_template(self) -> str | None:
        """The default chat template (chat_templates["default"]), or None."""
        return self.chat_templates.get("default")

    @chat_template.setter
    def chat_template(self, text: str | None) -> None:
        if text is None:
            self.chat_templates.pop("default", None)
        else:
            self.chat_templates["default"] = text

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added (special) tokens included; may differ from the model's
        config.vocab_size (embedding rows)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """Token ids of text; BOS in front and EOS behind where the model's tokenizer adds them
        (add_bos / add_eos; None: the tokenizer's own setting), as llama.cpp and HF do."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        check_bool(add_bos, "add_bos", none_ok=True)
        check_bool(add_eos, "add_eos", none_ok=True)
        try:
            ids = self.tok.encode(text, add_special_tokens=False).ids
        except TypeError as e:   # e.g. a lone surrogate, which no UTF-8 text holds
            raise ValueError(f"text: cannot be encoded ({e})") from None
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if (self.add_eos if add_eos is None else add_eos) and self.eos_token_ids:
            ids = ids + [self.eos_token_ids[0]]
        return ids

    # Ids are integers in tokenizers' u32 range; one past the vocabulary (a model's embedding may
    # have padding rows past the tokenizer's) decodes to nothing, as in `tokenizers` itself.
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ids (a sequence, 1-D array or tensor of ints; may be empty); special tokens
        dropped with skip_special_tokens. An id the vocabulary lacks decodes to nothing; ValueError
        for a str, a non-integer or an id outside 0..2^32 - 1."""
        ids = token_ids(ids, 2**32, bound=_U32, empty_ok=True)
        skip = check_bool(skip_special_tokens, "skip_special_tokens")
        if self.piece_bytes is not None:
            return self.piece_bytes.decode(ids, skip)
        return self.tok.decode(ids, skip_special_tokens=skip)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary's token string for id i (byte-level BPE: in its byte alphabet, "Ġ" for a
        space), or None for an id it lacks; ValueError for a non-integer or an id outside 0..2^32 - 1."""
        return self.tok.id_to_token(token_ids([i], 2**32, "id", bound=_U32)[0])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, **variables) -> str:
        """The conversation rendered by the model's chat template: the default one, or the named
        one `template` (a model may ship several: tokenizer_config.json's list of {name, template},
        a GGUF's tokenizer.chat_template.<name>). Like transformers, a model whose templates are
        all named and none "default" needs a name. `variables` reach the template as
        transformers' apply_chat_template(**kwargs) passes them, e.g. Qwen3's
        enable_thinking=False (CLI: --chat-template-kwargs). tools / documents: lists of dicts (JSON
        schemas of functions; retrieved documents) for templates that take them, as transformers
        passes them (it also turns Python functions into schemas; here they are given as dicts);
        an assistant message may then carry `tool_calls` and no content, a "tool" one the result."""
        check_template_variables(variables)
        for name, v in (("tools", tools), ("documents", documents)):
            if v is not None and not (isinstance(v, list) and all(isinstance(d, dict) for d in v)):
                raise ValueError(f"{name}: expected a list of dicts (JSON schemas / documents), got {v!r}")
        check_bool(add_generation_prompt, "add_generation_prompt")
        names = sorted(self.chat_templates)
        if template is not None:
            if not isinstance(template, str):   # (a list was a raw "unhashable type")
                raise ValueError(f"template: expected a chat template's name (a str) or None, got {template!r}")
            if template not in self.chat_templates:
                raise ValueError(f"chat template {template!r}: this model has "
                                 + (f"the named templates {names}" if names else "no named templates"))
            source = self.chat_templates[template]
        elif self.chat_template:
            source = self.chat_template
        elif self.chat_template == "":
            raise ValueError("this model's chat template is empty (tokenizer.chat_template / "
                             "tokenizer_config.json chat_template): prompt it without --chat")
        elif names:
            raise ValueError(f"this model has the named chat templates {names} and no default: name "
                             "one (--chat-template NAME)")
        else:
            raise ValueError("this model has no chat template (tokenizer.chat_template / "
                             "tokenizer_config.json chat_template): prompt it without --chat")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and (
                    isinstance(m.get("content"), str) or m.get("content") is None and "tool_calls" in m)
                for m in messages):
            raise ValueError("messages: expected a list of {'role': str, 'content': str} dicts (content may be "
                             "None beside tool_calls)")
        # keys holding None dropped, as transformers does (a template would print "None")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        # What transformers' apply_chat_template gives a template (chat_template_utils): its
        # {% generation %} tag (a no-op when rendering), strftime_now (Llama 3.2's "Today Date"),
        # raise_exception, a tojson that does not HTML-escape, and tools/documents (None unless given).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_tag(), "jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)
        try:
            return env.from_string(source).render(
                messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **variables)
        except jinja2.TemplateError as e:   # a broken template, or one that refuses the messages
            where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise ValueError(f"the model's chat template{where}: {type(e).__name__}: {e}") from None
        except Exception as e:   # what its Python operations raise: {{ 1/0 }}, the sandbox's
            # OverflowError for a range past MAX_RANGE, a MemoryError for {{ 'x' * 10**10 }}, ...
            raise ValueError(f"the model's chat template fails: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template: str | None = None, tools: list[dict] | None = None,
                    documents: list[dict] | None = None, **variables) -> list[int]:
        """The ids of a rendered conversation: BOS in front unless the template renders one, and
        no EOS behind it whatever add_eos says (the model is to continue it). tools, documents,
        variables: as apply_chat_template's."""
        text = self.apply_chat_template(messages, add_generation_prompt, template, tools, documents, **variables)
        renders_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_bos=False if renders_bos else None, add_eos=False)

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_tokenizer_json(cls, path_or_str, tokenizer_config: dict | None = None) -> "Tokenizer":
        """From an HF tokenizer.json (a path, or its JSON text) and tokenizer_config.json."""
        s = str(path_or_str)
        is_file = os.path.exists(s)
        try:
            tok = HFTokenizer.from_file(s) if is_file else HFTokenizer.from_str(s)
        except BaseException as e:   # the tokenizers package raises a bare Exception (or panics)
            if not _library_error(e):
                raise
            raise ValueError(f"{s if is_file else 'tokenizer.json text'}: not a tokenizer the "
                             f"`tokenizers` package reads ({e})") from None
        cfg = tokenizer_config or {}
        # `tokenizers` loads a vocabulary with two tokens at one id (text of either encodes to it, which the
        # model reads as one of them): said, not refused, as transformers loads it
        # (one get_vocab, ~0.25 s for 151,936 tokens, for this and the largest id below)
        vocab = tok.get_vocab(with_added_tokens=True)
        seen = {}
        for t, i in vocab.items() if len(set(vocab.values())) < len(vocab) else ():
            if seen.setdefault(i, t) != t:
                warnings.warn(f"{s if is_file else 'tokenizer.json text'}: tokens {min(seen[i], t)!r} and "
                              f"{max(seen[i], t)!r} share id {i}: text holding either encodes to it; a corrupt "
                              "vocabulary?", UserWarning, stacklevel=2)
                break
        top = max(vocab, key=vocab.get, default=None)
        stray = (top, vocab[top]) if top is not None and vocab[top] >= tok.get_vocab_size(with_added_tokens=True) \
            else None

        def tok_str(key):
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if v is not None and not isinstance(v, str):
                raise ValueError(f"tokenizer_config.json: {key}={v!r} must be a token string")
            return v

        bos, eos = tok_str("bos_token"), tok_str("eos_token")
        bos_id = tok.token_to_id(bos) if bos else None
        eos_ids = [tok.token_to_id(eos)] if eos and tok.token_to_id(eos) is not None else []
        tmpl, named = cfg.get("chat_template"), {}
        if isinstance(tmpl, list):  # [{name, template}, ...]
            named = {t["name"]: t["template"] for t in tmpl if isinstance(t, dict)
                     and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
            if not named:
                raise ValueError("tokenizer_config.json: chat_template is a list without "
                                 "{name, template} entries")
            tmpl = named.get("default")
        if tmpl is not None and not isinstance(tmpl, str):
            raise ValueError(f"tokenizer_config.json: chat_template must be a string, got {type(tmpl).__name__}")
        add_bos, add_eos = cfg.get("add_bos_token"), cfg.get("add_eos_token")
        for key, v, name, found in (("add_bos_token", add_bos, bos, bos_id is not None),
                                    ("add_eos_token", add_eos, eos, bool(eos_ids))):
            if v is not None:   # null, as no key: unset, found below
                check_bool(v, f"tokenizer_config.json: {key}")
            tk = key[4:7] + "_token"
            if v and name and not found:   # (the token had been left out of every prompt without a word)
                raise ValueError(f"tokenizer_config.json: {key} is true, but {tk}={name!r} is not in "
                                 "tokenizer.json's vocabulary")
            if v and not name:   # (transformers' Llama tokenizer refuses it, its Qwen2 one adds nothing)
                warnings.warn(f"tokenizer_config.json: {key} is true, but no {tk} is given: none is added",
                              UserWarning, stacklevel=2)
        if add_bos is None or add_eos is None:   # e.g. Llama 3: tokenizer.json's post_processor adds BOS
            try:
                with_special = tok.encode("a", add_special_tokens=True).ids
            except BaseException as e:   # a post_processor naming a token the vocab lacks panics
                if not _library_error(e):
                    raise
                raise ValueError(f"{s if is_file else 'tokenizer.json text'}: the tokenizer fails to "
                                 f"encode with its special tokens ({type(e).__name__}: {e}); is its "
                                 "post_processor consistent with its vocabulary?") from None
            if add_bos is None:
                add_bos = bos_id is not None and with_special[:1] == [bos_id]
            if add_eos is None:
                add_eos = bool(eos_ids) and with_special[-1:] == eos_ids
        out = cls(tok, bos_token_id=bos_id, eos_token_ids=eos_ids,
                  add_bos=add_bos and bos_id is not None, add_eos=add_eos and bool(eos_ids),
                  chat_template=tmpl, bos_token=bos or "", eos_token=eos or "", chat_templates=named)
        out.stray_id = stray
        return out

    @classmethod
    def from_gguf_fields(cls, meta: dict, path: str = "<gguf>") -> "Tokenizer":
        """From `tokenizer.ggml.*` values (key -> python value, as gguf ReaderField.contents())."""
        def need(key):
            if key not in meta:
                raise ValueError(f"{path}: metadata key {key!r} is missing (needed for the tokenizer)")
            return meta[key]

        model = need("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"{path}: tokenizer.ggml.model={model!r} is not supported yet "
                             "(byte-level BPE 'gpt2' and SentencePiece BPE 'llama' are)")

        def array_of(key, kind, default=None):
            v = need(key) if default is None else meta.get(key) or default
            if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
                raise ValueError(f"{path}: {key} must be an array of {kind.__name__}")
            return v

        tokens = array_of("tokenizer.ggml.tokens", str)
        empty = [i for i, t in enumerate(tokens) if not t]
        if empty:   # llama.cpp names each "[EMPTY_<id>]" (warning "empty token at index"), then loads it
            warnings.warn(f"{path}: tokenizer.ggml.tokens: {len(empty)} empty token(s), e.g. id {empty[0]}; "
                          "named [EMPTY_<id>] as llama.cpp does", UserWarning, stacklevel=2)
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = list(array_of("tokenizer.ggml.token_type", int, [NORMAL] * len(tokens)))
        bad = next((i for i, t in enumerate(types) if not 0 <= t <= BYTE), None)
        if bad is not None:   # (a SentencePiece merge of such a token was silently not made)
            raise ValueError(f"{path}: tokenizer.ggml.token_type[{bad}] = {types[bad]} (token {tokens[bad]!r}) "
                             f"is no llama.cpp token type (0..{BYTE})")
        if len(types) != len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries, "
                             f"tokenizer.ggml.tokens {len(tokens)}")
        vocab = {}
        for i, t in enumerate(tokens):   # a string of two ids would encode to one of them (llama.cpp aborts)
            j = vocab.setdefault(t, i)
            if j != i:
                raise ValueError(f"{path}: tokenizer.ggml.tokens holds {t!r} twice, as ids {j} and {i}")

        def flag(key, default):   # llama.cpp refuses a key of any type but BOOL
            return check_bool(meta.get(key, default), f"{path}: {key}")

        # llama.cpp's special ids for an SPM vocabulary where the file names none, or one out of
        # range ("bad special token ... using default id"); a BPE vocabulary's default (11) is not
        # taken: such an id is ignored with a warning
        default_ids = {"tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
                       "tokenizer.ggml.eos_token_id": 2} if model == "llama" else {}

        def token_id(key):
            d = default_ids.get(key)
            d = d if d is not None and d < len(tokens) else None
            v = meta.get(key)
            if v is None:
                return d
            if d is not None and is_int(v) and not 0 <= v < len(tokens):
                warnings.warn(f"{path}: {key}={v!r} is not one of the {len(tokens)} token ids: using "
                              f"llama.cpp's default {d}", stacklevel=3)
                return d
            return special_token_id(v, len(tokens), f"{path}: {key}")

        # llama.cpp reads every special id it knows (pad, unknown, sep, mask, ...) and refuses a
        # file where one is no integer; the runner uses only some, but a corrupt one is said here
        # (the type only: the range of an id in use is checked, and warned of once, where it is read)
        for key in sorted(k for k in meta if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")):
            if meta[key] is not None and not is_int(meta[key]):
                raise ValueError(f"{path}: {key}={meta[key]!r} is not a token id")

        if model == "llama":
            scores = array_of("tokenizer.ggml.scores", float)
            if len(scores) != len(tokens):
                raise ValueError(f"{path}: tokenizer.ggml.scores has {len(scores)} entries, "
                                 f"tokenizer.ggml.tokens {len(tokens)}")
            if not all(map(math.isfinite, scores)):   # the merge order sorts by them
                i = next(i for i, x in enumerate(scores) if not math.isfinite(x))
                raise ValueError(f"{path}: tokenizer.ggml.scores[{i}] is {scores[i]} (token {tokens[i]!r})")
            add_bos_default = True   # llama.cpp's default for an SPM vocabulary
            # a character outside the vocabulary (without <0xXX> tokens) becomes the unk id
            unk = token_id("tokenizer.ggml.unknown_token_id")
            if unk is None:   # (only a vocabulary of no tokens has no id 0)
                raise ValueError(f"{path}: an SPM vocabulary needs an unknown token; "
                                 "tokenizer.ggml.unknown_token_id names none of its ids")
            add_space_prefix = flag("tokenizer.ggml.add_space_prefix", True)
            tok = _sentencepiece_bpe(tokens, vocab, scores, types, tokens[unk], add_space_prefix, path)
        else:
            pre = meta.get("tokenizer.ggml.pre", "default")
            if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:   # (an absent key had been shown as 'default')
                what = (f"tokenizer.ggml.pre={pre!r}" if "tokenizer.ggml.pre" in meta else "metadata key "
                        "'tokenizer.ggml.pre' is missing; llama.cpp then splits as 'default', which")
                raise ValueError(f"{path}: {what} is not supported; known: {sorted(PRE_TOKENIZERS)}")
            make_pre, ignore_merges = PRE_TOKENIZERS[pre]
            merges = []
            for m in array_of("tokenizer.ggml.merges", str):
                i = m.find(" ", 1)   # from 1, as llama.cpp: a first token may itself be " "
                if i < 0:
                    raise ValueError(f"{path}: tokenizer.ggml.merges entry {m!r} is not 'a b'")
                merges.append((m[:i], m[i + 1:]))
            try:
                bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges,
                                 fuse_unk=False, byte_fallback=False)
            except Exception as e:   # e.g. a merge of tokens the vocabulary lacks (a bare Exception)
                raise ValueError(f"{path}: tokenizer.ggml.tokens / merges do not make a BPE ({e})") from None
            tok = HFTokenizer(bpe)
            tok.pre_tokenizer = make_pre()
            # a byte the vocabulary has no token for (SmolLM2's lacks 21: some control bytes, the
            # UTF-8 lead bytes C0, C1, F1, F2, F5-FF) is dropped, as llama.cpp drops it -- but there
            # it stays a symbol until then, so its neighbours never merge across it ("!\x04!" is
            # "!", "!", not "!!"): split it off as a piece of its own. (Not for the llama3 family,
            # ignore_merges: there llama.cpp first looks a whole word up, which a split would miss;
            # their vocabularies hold all 256 bytes.)
            missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab]
            if missing and not ignore_merges:
                alone = Regex("[" + "".join(f"\\x{{{ord(c):x}}}" for c in sorted(missing)) + "]")
                tok.pre_tokenizer = pre_tokenizers.Sequence(
                    [tok.pre_tokenizer, pre_tokenizers.Split(alone, behavior="isolated")])
            tok.decoder = decoders.ByteLevel()
            add_bos_default = ignore_merges   # llama.cpp: true for the llama3 family only

        def control(i):   # llama.cpp types a control-looking token CONTROL, warning if the file did not
            if types[i] != CONTROL:
                was = _TYPE_NAMES.get(types[i], types[i])
                warnings.warn(f"{path}: token {i} {tokens[i]!r} looks like a control token but "
                              f"tokenizer.ggml.token_type gives {was}: typed CONTROL, as llama.cpp does",
                              stacklevel=3)
                types[i] = CONTROL

        found = {}
        for what, names in _FOUND_BY_TEXT.items():
            keys = [f"tokenizer.ggml.{what}_token_id"]
            if what in _DEPRECATED_KEY:
                keys.append(f"tokenizer.ggml.{_DEPRECATED_KEY[what]}_token_id")
            ids = [i for i in map(token_id, keys) if i is not None]
            if ids:
                found[what] = ids[-1]
            else:   # the first of these texts the vocabulary holds (llama.cpp: whichever its map yields)
                i = next((vocab[n] for n in names if n in vocab), None)
                if i is not None:
                    found[what] = i
                    control(i)
        eog = [found[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in found]
        for name in _EOG_NAMES:
            if name in vocab:
                control(vocab[name])
                eog.append(vocab[name])

        added = []
        for t, ty in zip(tokens, types):
            if ty in (CONTROL, USER_DEFINED, UNKNOWN):   # llama.cpp's special set
                added.append(AddedToken(t, special=(ty != USER_DEFINED), normalized=False))
        if added:
            # ids come from the vocab (the tokens are already in it): order does not matter
            tok.add_tokens([a for a in added if not a.special])
            tok.add_special_tokens([a for a in added if a.special])

        # llama.cpp: add_bos from the file; when absent, true for SPM and the llama3 BPE family
        add_bos = flag("tokenizer.ggml.add_bos_token", add_bos_default)
        raw_bos = meta.get("tokenizer.ggml.bos_token_id")
        if add_bos and isinstance(raw_bos, int) and not 0 <= raw_bos < len(tokens) and \
                "tokenizer.ggml.bos_token_id" not in default_ids:   # (SPM: the default takes its place)
            raise ValueError(f"{path}: tokenizer.ggml.add_bos_token asks for a BOS token, but "
                             f"tokenizer.ggml.bos_token_id={raw_bos!r} is none of the {len(tokens)} token ids")
        bos = token_id("tokenizer.ggml.bos_token_id")
        eos = token_id("tokenizer.ggml.eos_token_id")
        eos_ids = []   # the declared eos first; generation stops on any of them
        for i in [eos, found.get("eot"), found.get("eom")] + eog:
            if i is not None and i not in eos_ids:
                eos_ids.append(i)
        add_eos = flag("tokenizer.ggml.add_eos_token", False) and eos is not None
        tmpl = meta.get("tokenizer.chat_template")
        if tmpl is not None and not isinstance(tmpl, str):
            raise ValueError(f"{path}: tokenizer.chat_template must be a string, got {type(tmpl).__name__}")
        named = {}   # llama.cpp's named templates: tokenizer.chat_templates lists the names
        names = meta.get("tokenizer.chat_templates") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{path}: tokenizer.chat_templates must be an array of names")
        for name in names:
            t = meta.get(f"tokenizer.chat_template.{name}")
            if not isinstance(t, str):
                raise ValueError(f"{path}: tokenizer.chat_templates names {name!r}, but "
                                 f"tokenizer.chat_template.{name} is {'missing' if t is None else 'not a string'}")
            named[name] = t
        out = cls(tok, bos_token_id=bos, eos_token_ids=eos_ids, add_bos=add_bos and bos is not None,
                  add_eos=add_eos, chat_template=tmpl, bos_token="" if bos is None else tokens[bos],
                  eos_token="" if eos is None else tokens[eos], chat_templates=named)
        if model == "llama":
            out.piece_bytes = SentencePieceText(tokens, types, add_space_prefix)
        return out


# sentencepiece's (and `tokenizers`' ByteFallback's) count: one U+FFFD for every byte of an invalid
# stretch, where Python's "replace" writes one for each maximal invalid subsequence
_ONE_FFFD_A_BYTE = "quantzoo.one_fffd_a_byte"
codecs.register_error(_ONE_FFFD_A_BYTE, lambda e: ("\ufffd" * (e.end - e.start), e.end))


class SentencePieceText:
    """decode for a GGUF SentencePiece vocabulary: the pieces' bytes (U+2581 as a space, a BYTE
    token <0xXX> as that byte) joined, then read as UTF-8 with one U+FFFD per invalid byte, as
    sentencepiece does (llama.cpp hands the raw bytes over); one leading space dropped where the
    encoder puts one in front (add_space_prefix). The `tokenizers` decoder this replaces turned a
    whole run of byte tokens into one U+FFFD per byte when any byte of the run was invalid, so
    <0x0A> <0xE6> lost its newline, and a stream that began inside such a run printed U+FFFDs for
    a whole emoji."""

    def __init__(self, tokens: list, types: list, add_space_prefix: bool):
        self.pieces = [bytes([int(t[3:5], 16)]) if ty == BYTE and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t)
                       else t.replace("\u2581", " ").encode("utf-8") for t, ty in zip(tokens, types)]
        # skip_special_tokens drops what the `tokenizers` object holds as special added tokens
        self.special = {i for i, ty in enumerate(types) if ty in (CONTROL, UNKNOWN)}
        self.strip = add_space_prefix

    def decode(self, ids: list, skip_special_tokens: bool) -> str:
        n = len(self.pieces)   # an id past the vocabulary decodes to nothing, as in `tokenizers`
        text = b"".join(self.pieces[i] for i in ids if i < n and not (skip_special_tokens and i in self.special)
                        ).decode("utf-8", _ONE_FFFD_A_BYTE)
        return text[1:] if self.strip and text.startswith(" ") else text


class TextSoFar:
    """The text of a growing list of ids, kept current at a cost that does not grow with the list
    (decoding the whole list again for every new token took 0.4 ms at 2,000 tokens and 0.8 ms at
    4,000 on this project's CPU host: as long as a decode step of the default model on the H100,
    so a long generation became host-bound).

    The text of ids[:c] is kept once it ends on a whole character (no U+FFFD at its end: bytes of
    an unfinished UTF-8 character decode to one). A new id then decodes only the window ids[p:],
    p the commit point before c, and the new text is that window's text past the text of
    ids[p:c]. Starting the window one commit early gives a decoder that treats the first token
    specially (a SentencePiece-style leading space) the same first token in both decodes. For
    decoders that concatenate at a whole character (byte-level BPE, SentencePiece-style) the text
    is decode(context + ids) past the context's text; should a window's text not begin with
    ids[p:c]'s, the whole list is decoded (correct, only slower).

    context: the ids before the text (a prompt). The text begins after the context's last whole
    character: context ids that leave a character unfinished (up to 8) belong to the text, which
    then starts with the character the new ids finish, not with U+FFFD; the context id before
    them starts the first window (so a first-token rule applies to it, not to the text); all the
    ids of that character where it was spelled in byte tokens."""

    def __init__(self, decode, context=()):
        ctx = [int(i) for i in list(context)[-9:]]
        cut = len(ctx)
        while cut and decode(ctx[:cut]).endswith("\ufffd"):
            cut -= 1
        start = max(cut - 1, 0)   # back to where the character before the text begins: a window
        while start and decode(ctx[start:cut]).startswith("\ufffd"):   # from its last byte token
            start -= 1            # alone would start with U+FFFD, and a decoder may then spoil more
        self.decode, self.ids, self.text = decode, ctx[start:], ""
        self._p, self._c = 0, cut - start
        self._done, self._head = "", decode(self.ids[:self._c])
        self._context_text = self._head

    def add(self, i: int) -> str:
        """Append one id; the whole text so far."""
        self.ids.append(i)
        window = self.decode(self.ids[self._p:])
        if window.startswith(self._head):
            self.text = self._done + window[len(self._head):]
        else:
            whole = self.decode(self.ids)
            self.text = whole[len(self._context_text):] if whole.startswith(self._context_text) else whole
        if not self.text.endswith("\ufffd"):   # a whole character at the end: commit
            self._done, self._p, self._c = self.text, self._c, len(self.ids)
            self._head = self.decode(self.ids[self._p:self._c])
        return self.text
