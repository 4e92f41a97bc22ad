"""`quantzoo formats`: every registry entry with its size and the NMSE measured on the spot."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("formats", help="table of every registered format, NMSE measured now",
                       description="Every registry entry: kind, bits/weight, block, bytes per block, "
                                   "compression against fp16, and the NMSE of its dequantized weights and "
                                   "of its kernel's emulation, measured now on a seeded Gaussian workload "
                                   "(CPU, a few seconds).")
    p.add_argument("--tablefmt", default="github", metavar="FMT",
                   help="tabulate table format (default: github; e.g. plain, grid, latex)")
    p.set_defaults(func=run)


def bytes_per_block(fmt) -> str:
    """Storage bytes of one block (a GGUF block; for AWQ one column's group of block_size weights
    along K: 64 bytes of nibbles, its fp16 scale and its half-byte zero point, 66.5 at g128)."""
    return f"{fmt.bits_per_weight * fmt.block_size / 8:g}"


def run(args) -> int:
    from tabulate import tabulate, tabulate_formats

    if args.tablefmt not in tabulate_formats:
        raise ValueError(f"--tablefmt {args.tablefmt!r}: one of {', '.join(sorted(tabulate_formats))}")

    from .. import formats, workload

    x, w, y_exact = workload.gaussian(**workload.STANDARD)
    rows = []
    for name in formats.names():
        fmt = formats.get(name)
        row = [name, fmt.kind, f"{fmt.bits_per_weight:.4g}", fmt.block_size, bytes_per_block(fmt),
               f"{16 / fmt.bits_per_weight:.2f}x"]
        if fmt.kind == "activation":
            row += ["-", "-"]
        else:
            e = workload.format_errors(fmt, x, w, y_exact)
            row += [f"{100 * e['nmse_weights']:.4f}", f"{100 * e['nmse_kernel']:.4f}"]
        rows.append(row)
    s = workload.STANDARD
    print(tabulate(rows, headers=["format", "kind", "bits/weight", "block/group", "bytes/block",
                                  "x fewer bits than fp16", "NMSE % (weights)", "NMSE % (kernel)"],
                   tablefmt=args.tablefmt, disable_numparse=True))
    print(f"\nNMSE on a seeded Gaussian workload: W ~ N(0, {s['sigma']}^2) of {s['n']}x{s['k']}, "
          f"x ~ N(0, 1) with M={s['m']}, against float64 with the unquantized W. 'weights': "
          "dequantized W in float64; 'kernel': what the GPU kernel computes (Q8_1 activations "
          "for GGUF formats, fp16 activations for AWQ/fp16), emulated in numpy.")
    return 0
