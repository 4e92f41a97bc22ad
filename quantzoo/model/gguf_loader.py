"""Load a .gguf file (arch qwen3 or llama) into a ModelConfig, HF-named weights and a Tokenizer.

gguf-py's GGUFReader memory-maps the file; block-quantized tensors (Q4_0 ... Q8_0) are wrapped
as QuantizedTensors over the file's own bytes (`fmt.from_bytes`: no repacking, our layout IS
the GGUF layout). F32/F16/BF16 tensors become torch float tensors.

Types quantzoo has no kernel for (Q6_K, Q4_K and the other K-quants, i-quants, ...) are
dequantized to float32 at load by gguf-py (`gguf.quants.dequantize`) and run as dense linears,
with a warning and the type kept in the tensor's `dequantized_from` attribute (Model.formats
shows it). This is what makes llama.cpp's own files load: `llama-quantize` to Q4_0, Q4_1, Q5_0
or Q5_1 stores output.weight (or a tied token_embd.weight) as Q6_K unless told otherwise
(llama.cpp src/llama-quant.cpp: the output tensor becomes Q6_K for every type but Q8_0).

Facts this rests on (DESIGN.md §5):
- GGUF dims are listed ne0 first, ne0 = in_features, so the numpy shape is (out, in): torch
  orientation already.
- llama.cpp's converter permutes the rows of Q and K of `llama` models so that its "normal"
  RoPE can rotate adjacent pairs (x0, x1), (x2, x3), ...: within each head, HF row
  j*hd/2 + i (half j, index i) is stored at row 2*i + j. The runner rotates halves (HF order),
  so `unpermute_qk` puts the rows back. A row of a block-quantized tensor is a run of whole
  blocks along K, so permuting rows of block bytes is exact. qwen2/qwen3 files are not
  permuted (llama.cpp rotates halves for them: "NEOX" RoPE).
- Optional keys take llama.cpp's defaults: head_count_kv = head_count, key_length =
  embedding_length / head_count, rope.freq_base = 10000. The RMS epsilon is required.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import torch

from .. import formats
from ..formats import QuantizedTensor
from ..formats.base import warn
from .config import ModelConfig, check_finite, positive, special_token_id
from .tokenizer import Tokenizer

FLOAT_TYPES = ("F32", "F16", "BF16")
# ggml type name -> registry name, from the registry itself (Format.gguf_type)
BLOCK_TYPES = {formats.get(n).gguf_type: n for n in formats.names()
               if formats.get(n).gguf_type and formats.get(n).gguf_type not in FLOAT_TYPES}

TENSOR_NAMES = {  # GGUF name (per layer: blk.N.<x>) -> HF name
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in TENSOR_NAMES:
        return TENSOR_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    return None


def hf_to_gguf_name(name: str) -> str:
    """Inverse of gguf_to_hf_name (for writers)."""
    for g, h in TENSOR_NAMES.items():
        if h == name:
            return g
    parts = name.split(".")
    inner = ".".join(parts[3:-1])
    for g, h in LAYER_NAMES.items():
        if h == inner:
            return f"blk.{parts[2]}.{g}.weight"
    raise KeyError(f"{name}: no GGUF name")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order -> HF's (rotate-half pairs). Works on block bytes too."""
    n = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, n // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class TensorInfoError(ValueError):
    """A tensor's info or a metadata value in the GGUF header is inconsistent (the message names
    the tensor or the key)."""


def shown_name(name: str) -> str:
    """A key or tensor name as a message shows it: cut to 80 characters as repr writes it, "..."
    included (a corrupt name of NULs is 4 characters each; GGUF allows 65535 bytes)."""
    if len(repr(name)) <= 82:
        return name
    name = name[:77]
    while len(repr(name)) > 79:
        name = name[:-1]
    return name + "..."


MAX_ARRAY_ITEMS = 1 << 22   # metadata arrays longer than this are refused (gguf-py parses item by item)


def _reader(path: str):
    """GGUFReader that checks every tensor's byte range before mapping it (names the tensor)."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    class Reader(GGUFReader):
        # gguf-py walks an array's count item by item, and past the end of the file its reads come
        # back empty without moving on: a corrupt count (2**40) looped until the OOM killer. The
        # count is checked against the bytes left first, and a value that fails to parse is named
        # by its key (the last string read outside any value: gguf-py reads the key, then its value).
        _depth, _key, _ntokens = 0, None, None

        def _get_str(self, offset):
            if self._depth == 0:   # a key or tensor name: GGUF caps keys at 65535 bytes (a corrupt
                n = int(self.data[offset:offset + 8].view("<u8")[0]) if offset + 8 <= len(self.data) else 0
                if n > 65535:      # length put the rest of the file into the key, and every message)
                    raise TensorInfoError(f"the metadata key (or tensor name) at byte {offset} is {n} bytes "
                                          "long (GGUF keys are at most 65535): corrupt file?")
            out = super()._get_str(offset)
            if self._depth == 0:
                self._key = shown_name(bytes(out[1]).decode("utf-8", "replace"))
            return out

        def _get_field_parts(self, orig_offs, raw_type):
            key = self._key
            self._depth += 1
            try:
                if int(raw_type) == GGUFValueType.ARRAY and orig_offs + 12 <= len(self.data):
                    itype = int(self.data[orig_offs:orig_offs + 4].view("<u4")[0])
                    count = int(self.data[orig_offs + 4:orig_offs + 12].view("<u8")[0])
                    item = self.gguf_scalar_to_np.get(itype)   # (a string: 8 bytes of length at least)
                    least = np.dtype(item).itemsize if item is not None else 8 if itype == GGUFValueType.STRING else 12
                    if count * least > len(self.data) - orig_offs - 12:
                        raise TensorInfoError(f"metadata key {key!r}: an array of {count} items of type "
                                              f"{itype} runs past the end of the file")
                    # gguf-py parses an array item by item (~30k items a second): a corrupt count
                    # that still fits in the file would run for minutes, and grow gigabytes
                    if self._depth == 1 and key == "tokenizer.ggml.tokens":
                        self._ntokens = count
                    if (self._depth == 1 and key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")
                            and self._ntokens is not None and count != self._ntokens):
                        raise TensorInfoError(f"metadata key {key!r} has {count} entries, tokenizer.ggml.tokens "
                                              f"{self._ntokens}")
                    if count > MAX_ARRAY_ITEMS:
                        raise TensorInfoError(f"metadata key {key!r}: an array of {count} items, more than "
                                              f"{MAX_ARRAY_ITEMS} (a vocabulary's are ~10^5): corrupt file?")
                return super()._get_field_parts(orig_offs, raw_type)
            except TensorInfoError:
                raise
            except Exception as e:
                if self._depth > 1:
                    raise
                raise TensorInfoError(f"metadata key {key!r} (or the one before it): cannot parse its value "
                                      f"({type(e).__name__}: {e}); corrupt file?") from None
            finally:
                self._depth -= 1

        _tensor = None   # the last tensor whose info parsed

        def _get_tensor_info_field(self, orig_offs):
            # gguf-py's own errors here name no tensor (a numpy message about views, or the length
            # of a "key" read from the bytes after a corrupt dimension count): named here
            self._key = None   # (_get_str sets it to the name once that is read)
            after = f"the tensor after {self._tensor!r}" if self._tensor else "the first tensor"
            n = int(self.data[orig_offs:orig_offs + 8].view("<u8")[0]) if orig_offs + 8 <= len(self.data) else 0
            if n > 65535:   # (the bytes after a corrupt dimension count or type, read as a name's length)
                raise TensorInfoError(f"the name of {after} is {n} bytes long, read at byte {orig_offs} (GGUF "
                                      "names are at most 65535 bytes): corrupt tensor info?")
            try:
                field = super()._get_tensor_info_field(orig_offs)
            except TensorInfoError:
                raise
            except Exception as e:
                what = f"tensor {self._key!r}" if self._key is not None else after
                raise TensorInfoError(f"the info of {what} cannot be parsed ({type(e).__name__}): a corrupt "
                                      "length or count, or a truncated file?") from None
            n_dims = int(field.parts[2][0])
            if n_dims > 4:   # ggml's GGML_MAX_DIMS (llama.cpp refuses more); the rest would be misread
                raise TensorInfoError(f"tensor {self._key!r}: {n_dims} dimensions (GGUF tensors have at most 4): "
                                      "corrupt tensor info?")
            self._tensor = self._key
            return field

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            spans = []
            expect = 0   # ggml's rule: tensor data is laid out in info order, each padded to the alignment
            order = []
            for field in fields:
                _nl, name_data, _nd, dims, raw_dtype, off = field.parts
                name = shown_name(bytes(name_data).decode("utf-8", "replace"))   # (for the messages below)
                try:
                    t = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise TensorInfoError(f"tensor {name!r}: unknown ggml type number {int(raw_dtype[0])}") from None
                bs, ts = GGML_QUANT_SIZES[t]
                n = 1
                for d in dims:   # Python ints: np.prod would wrap around on huge dims
                    n *= int(d)
                row = int(dims[0]) if len(dims) else 1   # ne0: a row is whole blocks (ggml's rule; gguf-py's
                if row % bs:                              # own error for a row that is not names no tensor)
                    raise TensorInfoError(f"tensor {name!r}: its rows of {row} values are not whole {t.name} "
                                          f"blocks of {bs}")
                if int(off[0]) % self.alignment:
                    raise TensorInfoError(f"tensor {name!r}: data offset {int(off[0])} is not a multiple of "
                                          f"the file's alignment ({self.alignment})")
                a = int(start_offs) + int(off[0])   # Python ints: uint64 + int wraps around in numpy
                b = a + n * ts // bs
                if b > size:
                    raise TensorInfoError(f"tensor {name!r}: its data (bytes {a}..{b}) runs past the end "
                                          f"of the file ({size} bytes): truncated file?")
                spans.append((a, b, name))
                order.append((name, int(off[0]), f"{t.name}{[int(d) for d in dims]}", b - a))
            spans.sort()
            for (_a0, b0, n0), (a1, _b1, n1) in zip(spans, spans[1:]):
                if a1 < b0:
                    raise TensorInfoError(f"tensor {n1!r}: its data (from byte {a1}) overlaps tensor {n0!r}'s "
                                          f"(to byte {b0})")
            # llama.cpp (ggml gguf.cpp) refuses a file unless every tensor's offset is the padded sum
            # of the sizes before it: a corrupt type or shape that shrinks a tensor (Q8_0 read as
            # Q4_0, F32 as F16) otherwise reads part of its bytes as a different, wrong weight
            prev = None
            for name, off, what, nbytes in order:
                if off != expect:
                    after = (f"tensor {prev[0]!r} before it ({prev[1]}) ends at {expect}" if prev else
                             "the first tensor's data starts at 0")
                    raise TensorInfoError(f"tensor {name!r}: data offset {off}, but {after} (llama.cpp "
                                          "wants the tensors back to back, padded): corrupt tensor info?")
                expect += -(-nbytes // int(self.alignment)) * int(self.alignment)
                prev = (name, what)
            # and the file ends where the last tensor's (padded) data does, as gguf-py and llama.cpp
            # write it: a last tensor whose type or shape shrank (F32 read as F16) leaves bytes over
            if order and size > int(start_offs) + expect:
                end = int(start_offs) + expect
                raise TensorInfoError(f"{size - end} byte(s) follow the last tensor's data (tensor {prev[0]!r}, "
                                      f"{prev[1]}, ends at byte {end} of {size}): corrupt tensor info, or data "
                                      "appended to the file?")
            return super()._build_tensors(start_offs, fields)

    return Reader(path)


def open_gguf(path: str):
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version = int.from_bytes(head[4:], "little") if len(head) == 8 else None
    if version and not version & 0xFFFF:   # a byte-swapped version: gguf-py reads it, the loader does not
        raise ValueError(f"{path}: a big-endian GGUF (version {int.from_bytes(head[4:], 'big')}); only "
                         "little-endian files are supported")
    if version is not None and version not in READER_SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (gguf-py reads versions "
                         f"{', '.join(map(str, READER_SUPPORTED_VERSIONS))})")
    try:
        return _reader(path)
    except TensorInfoError as e:
        raise ValueError(f"{path}: {e}") from None
    except Exception as e:  # truncated metadata: short memmap slices fail in many ways (numpy's
        # ValueErrors about views among them), so none of their own messages is shown alone
        raise ValueError(f"{path}: cannot parse the GGUF header/metadata "
                         f"({type(e).__name__}: {e}); truncated or corrupt file?") from None


def read_metadata(reader, path: str, prefix: str | None = None) -> dict:
    meta = {}
    for k, fl in reader.fields.items():
        if prefix and not k.startswith(prefix):
            continue
        try:
            meta[k] = fl.contents()
        except Exception as e:
            raise ValueError(f"{path}: metadata key {k!r} cannot be decoded ({e})") from None
    return meta


def config_from_metadata(meta: dict, path: str, vocab_size: int, tied: bool) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: metadata key 'general.architecture' is missing")
    if arch not in ("qwen3", "llama"):
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported "
                         "(the runner reads 'qwen3' and 'llama')")

    def key(name, default=KeyError, kind=int):
        """{arch}.name as a positive int (kind int) or a positive finite number (kind float)."""
        k = f"{arch}.{name}"
        if k not in meta:
            if default is KeyError:
                raise ValueError(f"{path}: metadata key {k!r} is missing")
            return default
        v = meta[k]
        if isinstance(v, list):   # a per-layer array: the runner takes one value for all layers
            if not v:
                raise ValueError(f"{path}: metadata key {k!r} is an empty array")
            if any(x != v[0] for x in v):
                raise ValueError(f"{path}: metadata key {k!r} varies per layer ({v[:8]!r}...); "
                                 "the runner takes one value for every layer")
            v = v[0]
        if kind is float and not isinstance(v, float):   # (an int is no float key's value: one bit of
            # the type field (F32 6 -> U32 4) reads the float's bits as 897,988,541; llama.cpp refuses it)
            raise ValueError(f"{path}: metadata key {k!r}={v!r} is not a float (llama.cpp reads it as F32 only)")
        return positive(v, kind, f"{path}: metadata key {k!r}")

    hidden, heads = key("embedding_length"), key("attention.head_count")
    if f"{arch}.attention.key_length" not in meta and heads > hidden:   # (had said "head_dim=0", a key no file has)
        raise ValueError(f"{path}: {arch}.attention.head_count={heads} is more than {arch}.embedding_length="
                         f"{hidden}: without {arch}.attention.key_length the head size, their quotient, is 0")
    head_dim = key("attention.key_length", hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:   # (the values, and where key_length came from)
        absent = "" if f"{arch}.attention.key_length" in meta else " (absent: embedding_length / head_count)"
        raise ValueError(f"{path}: {arch}.attention.value_length={key('attention.value_length')} != "
                         f"key_length={head_dim}{absent} is not supported")
    rope_dims = key("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rope_dims} (partial RoPE) is not "
                         f"supported; head_dim is {head_dim}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "linear")   # llama.cpp's default type
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported yet")
    # llama.cpp: freq_scale = 1/factor from rope.scaling.factor, else the old rope.scale_linear,
    # applied whenever the type is not "none" (an absent type means linear)
    for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        if k in meta:
            if not isinstance(meta[k], float):
                raise ValueError(f"{path}: metadata key {k!r}={meta[k]!r} is not a float (llama.cpp reads it as F32 only)")
            if scaling != "none" and meta[k] not in (0, 1):
                raise ValueError(f"{path}: {k}={meta[k]!r} asks for linear RoPE scaling, which is "
                                 "not supported yet")
            break
    dims = dict(intermediate_size=key("feed_forward_length"), num_layers=key("block_count"),
                num_kv_heads=key("attention.head_count_kv", heads),
                rms_norm_eps=key("attention.layer_norm_rms_epsilon", kind=float),
                rope_theta=key("rope.freq_base", 10000.0, kind=float), max_position=key("context_length"),
                # (quantzoo's export of a Mistral writes it; llama.cpp's llama arch does not read it and
                # attends to the whole context: the runner's context ends at the window instead. Read
                # for llama only: a Qwen3 export never writes it, and llama.cpp's qwen3 reads none)
                sliding_window=key("attention.sliding_window", None) if arch == "llama" else None)
    # with tokenizer metadata the Tokenizer reads (and reports on) the special ids
    bos = eos = None
    if "tokenizer.ggml.model" not in meta:
        bos, eos = (special_token_id(meta.get(f"tokenizer.ggml.{k}_token_id"), vocab_size,
                                     f"{path}: tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    try:
        return ModelConfig(arch=arch, vocab_size=vocab_size, hidden_size=hidden, num_heads=heads,
                           head_dim=head_dim, tie_word_embeddings=tied, qk_norm=(arch == "qwen3"),
                           bos_token_id=bos, eos_token_ids=[] if eos is None else [eos], **dims)
    except ValueError as e:   # e.g. a head count that does not divide
        raise ValueError(f"{path}: {e}") from None


@functools.lru_cache(maxsize=None)
def dequantized_at_load(tname: str) -> bool:
    """Whether a weight of ggml type `tname` loads by dequantization (no quantzoo kernel for it,
    and the installed gguf-py can dequantize it: it raises NotImplementedError otherwise)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    if tname in FLOAT_TYPES or tname in BLOCK_TYPES or tname not in GGMLQuantizationType.__members__:
        return False
    t = GGMLQuantizationType[tname]
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[t][1], np.uint8), t)
    except NotImplementedError:
        return False
    return True


def _to_weight(t, path: str):
    """ReaderTensor -> torch float tensor or QuantizedTensor (no copy for block types); its type
    was accepted by load_gguf's validation (a kernel format, a float, or dequantized_at_load)."""
    tname = t.tensor_type.name
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))   # (out, in)
    if tname == "F32" or tname == "F16":
        return torch.from_numpy(np.asarray(t.data).reshape(shape).copy())
    if tname == "BF16":
        u16 = np.asarray(t.data).view(np.uint16).reshape(shape)
        return torch.from_numpy(u16.astype(np.int16)).view(torch.bfloat16).float()
    if len(shape) != 2:
        raise ValueError(f"{path}: tensor {t.name!r} is {tname} with shape {shape}; "
                         "block-quantized tensors must be 2-D")
    if tname in BLOCK_TYPES:
        return formats.get(BLOCK_TYPES[tname]).from_bytes(t.data, shape)
    from gguf.quants import dequantize

    with np.errstate(invalid="ignore", over="ignore"):   # a bad scale: refused by load_gguf (check_finite)
        w = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32).reshape(shape)
    out = torch.from_numpy(w)
    out.dequantized_from = tname
    return out


def with_rope_freqs(cfg: ModelConfig, t, path: str) -> ModelConfig:
    """cfg with the divisors of the RoPE frequencies in `rope_freqs.weight` (Llama 3.1+ scaling;
    llama.cpp divides frequency i by value i): an F32 or F16 vector of head_dim / 2 values, each
    positive (ModelConfig checks the values)."""
    if cfg.arch != "llama":   # llama.cpp's qwen3 graph has no RoPE factors tensor
        raise ValueError(f"{path}: unexpected tensor 'rope_freqs.weight' for a {cfg.arch} model "
                         "(llama.cpp reads RoPE frequency factors for llama only)")
    dims = [int(d) for d in t.shape.tolist()]
    if t.tensor_type.name not in ("F32", "F16") or dims != [cfg.head_dim // 2]:
        raise ValueError(f"{path}: tensor 'rope_freqs.weight' is {t.tensor_type.name}{dims}; expected "
                         f"F32[{cfg.head_dim // 2}] (one factor per RoPE frequency of head_dim {cfg.head_dim})")
    try:
        return dataclasses.replace(cfg, rope_freq_factors=tuple(float(x) for x in np.asarray(t.data).reshape(-1)))
    except ValueError as e:
        raise ValueError(f"{path}: tensor 'rope_freqs.weight': {e}") from None


def load_gguf(path, progress: bool = True, reader=None):
    """-> (ModelConfig, weights {HF name: torch tensor | QuantizedTensor}, Tokenizer | None).
    reader: the file's open_gguf(path), where the caller reads more of it (parsing the metadata
    of a 49k-token vocabulary takes gguf-py seconds)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    reader = reader or open_gguf(path)
    meta = read_metadata(reader, path)
    for k, item in (("tokenizer.ggml.token_type", "INT32"), ("tokenizer.ggml.scores", "FLOAT32")):
        types = [t.name for t in reader.fields[k].types] if k in reader.fields else ["ARRAY", item]
        if types != ["ARRAY", item]:   # llama.cpp reads these as int32 / float32 whatever they hold
            raise ValueError(f"{path}: metadata key {k!r} is {' of '.join(types)}, expected ARRAY of {item}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    if len(tensors["token_embd.weight"].shape) != 2:
        raise ValueError(f"{path}: tensor 'token_embd.weight' has dims {tensors['token_embd.weight'].shape.tolist()};"
                         " expected 2 (embedding_length, vocabulary)")
    vocab = int(tensors["token_embd.weight"].shape[1])
    cfg = config_from_metadata(meta, path, vocab, tied="output.weight" not in tensors)
    if cfg.num_layers > len(tensors):   # before anything loops over the layers (a corrupt count)
        raise ValueError(f"{path}: {cfg.arch}.block_count={cfg.num_layers}, but the file holds only "
                         f"{len(tensors)} tensors")
    tok = None   # a file without tokenizer.ggml.* (synthetic, bench) loads without one
    if "tokenizer.ggml.model" not in meta and "tokenizer.ggml.tokens" in meta:
        # (the vocabulary had been dropped without a word: a model with no tokenizer; llama.cpp refuses it)
        raise ValueError(f"{path}: metadata key 'tokenizer.ggml.model' is missing, but the file has "
                         "tokenizer.ggml.tokens: the tokenizer's type is unknown")
    if "tokenizer.ggml.model" in meta:
        tok = Tokenizer.from_gguf_fields({k: v for k, v in meta.items() if k.startswith("tokenizer.")}, path)
        cfg.bos_token_id, cfg.eos_token_ids = tok.bos_token_id, list(tok.eos_token_ids)
        cfg.check_tokenizer(tok, path, strict=True)

    if "rope_freqs.weight" in tensors:
        cfg = with_rope_freqs(cfg, tensors.pop("rope_freqs.weight"), path)
    # validate names, shapes and types against the config before using any tensor
    want = cfg.expected_shapes()
    hf_of = {}
    foreign: dict[str, list[str]] = {}   # ggml type -> tensors dequantized at load
    for name, t in tensors.items():
        hf = gguf_to_hf_name(name)
        if hf is None or hf not in want:   # (a known name past the layers had been called unknown too)
            i = name.split(".")[1] if hf is not None and name.startswith("blk.") else None
            # (llama.cpp writes blk.<i> in plain ASCII decimal: "blk.01", or a digit that str.isdigit
            # takes and int() refuses (superscript two), names no layer: an unknown name, not a raw
            # int() error or "another architecture")
            odd = i is not None and not (i.isascii() and i == str(int(i)))
            past = i is not None and not odd and int(i) >= cfg.num_layers
            why = ("unknown name" if hf is None or odd else f"its layer is past {cfg.arch}.block_count="
                   f"{cfg.num_layers}" if past else "a name of another architecture")
            raise ValueError(f"{path}: unexpected tensor {shown_name(name)!r} for a {cfg.arch} model ({why})")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if shape != want[hf]:
            raise ValueError(f"{path}: tensor {name!r} has shape {shape}, the config "
                             f"({cfg.arch}, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
                             f"{cfg.num_kv_heads}x{cfg.head_dim}) wants {want[hf]}")
        tname = t.tensor_type.name
        if tname not in FLOAT_TYPES and tname not in BLOCK_TYPES:
            if not dequantized_at_load(tname):
                raise ValueError(f"{path}: tensor {name!r} has type {tname}, which is not supported yet "
                                 f"(quantzoo kernels: {', '.join(BLOCK_TYPES)}; floats: {', '.join(FLOAT_TYPES)}; "
                                 "types the installed gguf-py can dequantize load as float)")
            foreign.setdefault(tname, []).append(name)
        if len(want[hf]) == 1 and tname not in FLOAT_TYPES:
            raise ValueError(f"{path}: tensor {name!r} (a norm weight) has type {tname}; expected a float type")
        hf_of[name] = hf
    have = set(hf_of.values())
    for hf in want:
        if hf not in have:
            raise ValueError(f"{path}: tensor {hf_to_gguf_name(hf)!r} is missing")
    if foreign:
        what = "; ".join(f"{k}: {v[0] if len(v) == 1 else f'{len(v)} tensors'}" for k, v in foreign.items())
        warn(f"{path}: no quantzoo kernel for {what}: dequantized to float at load (gguf-py), "
             "run as dense linears (cuBLAS on CUDA, fp16 there)", UserWarning)
        # a file of K-quants grows ~7x in float32: refuse before the OOM killer ends the load
        from .host_memory import _size, available_bytes

        sizes = [4 * int(np.prod([int(d) for d in tensors[n].shape.tolist()])) for v in foreign.values() for n in v]
        need = sum(sizes) + max(sizes)   # (gguf-py's dequantize holds a second copy of the tensor it works on)
        avail = available_bytes()
        if avail is not None and need > avail:
            raise MemoryError(f"{path}: its {' and '.join(foreign)} tensors take {_size(need)} dequantized to "
                              f"float32 at load; {_size(max(avail, 0))} of memory is available")

    weights = {}
    items = list(hf_of.items())
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc=f"loading {os.path.basename(path)}", unit="tensor", leave=False)
    for name, hf in items:
        w = check_finite(_to_weight(tensors[name], path), path, name)
        if cfg.arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = cfg.num_heads if hf.endswith("q_proj.weight") else cfg.num_kv_heads
            if isinstance(w, QuantizedTensor):
                w = QuantizedTensor(w.format, w.shape, unpermute_qk(np.asarray(w.data), n_head), w.params)
            else:
                src, w = getattr(w, "dequantized_from", None), torch.from_numpy(unpermute_qk(w.numpy(), n_head))
                if src:
                    w.dequantized_from = src
        weights[hf] = w
    return cfg, weights, tok
