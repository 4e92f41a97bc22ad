"""`quantzoo quantize SRC DST --format F`: the same weights into every format.

SRC: an HF model directory (fp16/bf16/fp32 or AWQ), a .gguf file or a KuiperLLama .bin; a
weight it already stores in the target format (AWQ of the same group, the same GGUF type) is
copied as is, every other one dequantized and quantized again.
DST: a directory (HF AWQ checkpoint, or plain fp16), a .gguf file (llama.cpp block formats, or
F16), or a .bin (KuiperLLama AWQ).

A .gguf stores a weight whose in_features (K) is not a multiple of the format's 32-value block
as F16 instead (llama.cpp's converter's rule for its Q8_0 output), and says so in one warning
naming them; general.file_type stays the requested format (llama.cpp's "mostly" type), and
`quantzoo run` shows such tensor types as f16 in its formats line. AWQ refuses such a model
instead (K must be a multiple of --group-size; the error suggests a group that fits, where one
does).
"""
from __future__ import annotations


def register(sub) -> None:
    import argparse

    from quantzoo.model.export import DESTINATIONS, FORMATS

    p = sub.add_parser("quantize", help="convert a model to an HF AWQ dir, a GGUF file or a KuiperLLama .bin",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="HF model directory, .gguf file or KuiperLLama .bin")
    where = {"dir": "directory", "gguf": ".gguf", "bin": ".bin"}
    p.add_argument("dst", metavar="DST", help="output: " + ", ".join(
        f"{where[kind]} ({', '.join(fmts)})" for kind, fmts in DESTINATIONS.items()))
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="weight format of the linears (.gguf: a weight whose in_features is not a "
                        "multiple of 32 is stored F16, with a warning)")
    p.add_argument("--group-size", type=int, default=None,
                   help="AWQ group size along in_features: 32, 64 or 128 (default: an AWQ SRC's own "
                        "group, so AWQ -> AWQ copies the weights losslessly; else 128; awq only)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from quantzoo.formats.awq import GROUP_SIZES
    from quantzoo.model.export import awq_group_of, export

    if args.group_size is not None and args.format != "awq":
        raise ValueError(f"--group-size applies to --format awq only (here --format {args.format})")
    if args.group_size is not None and args.group_size not in GROUP_SIZES:   # (before SRC is read)
        raise ValueError(f"--group-size {args.group_size} is not supported; choose one of {GROUP_SIZES}")
    out = export(args.src, args.dst, args.format, group_size=args.group_size, progress=not args.quiet)
    group = awq_group_of(out) if args.format == "awq" else None   # (the one written: maybe the source's)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else os.path.getsize(out)
    print(f"wrote {out} ({args.format}{f', group {group}' if args.format == 'awq' else ''}, "
          f"{size / 2**20:.1f} MiB)")
    return 0
