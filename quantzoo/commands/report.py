"""`quantzoo report`: the comparison of every registry format (error, size, speed, accuracy).

Speed comes from a `quantzoo bench kernels` JSON (--bench); without one, on a CUDA machine the
quick bench is run first, and on a CPU-only machine the report has no kernel speed section (and
says so): error, size, accuracy and a given --model-bench need no GPU.
"""
from __future__ import annotations

import os
import shlex
import sys


def register(sub) -> None:
    p = sub.add_parser("report", help="markdown report: every format on error, size, speed, accuracy",
                       description=__doc__)
    p.add_argument("--bench", metavar="FILE.json", help="`quantzoo bench kernels` output")
    p.add_argument("--model-bench", metavar="FILE.json", help="`quantzoo bench model` output")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write report.md, report.json, CSVs and PNG plots in DIR; or give a path ending in "
                        ".md for the markdown, the rest going to the folder of that name "
                        "(default: print the markdown)")
    p.add_argument("--no-bench", action="store_true",
                   help="on a GPU machine, do not run the quick kernel bench when --bench is not given")
    p.add_argument("--no-accuracy", action="store_true", help="leave out the real-model accuracy section")
    p.add_argument("--accuracy-formats", metavar="A,B", default=None,
                   help="formats for the accuracy section (default: every weight format)")
    p.add_argument("--accuracy-tokens", type=int, default=None,
                   help="at most this many tokens of the shipped text (default 512: all of it)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="model for the accuracy section (default: the default SmolLM2 GGUF)")
    p.add_argument("--no-plots", action="store_true", help="no PNGs")
    p.set_defaults(func=run)


def run(args) -> int:
    from quantzoo import report
    from quantzoo.report import speed

    def log(s):
        print(s, file=sys.stderr, flush=True)

    # each input file checked whole here (quantzoo.report.checks), before any other work: a bad
    # value fails as one line naming the file and the field, not inside or halfway through a report
    model_bench = report.load_model_bench(args.model_bench) if args.model_bench else None
    if args.no_accuracy:   # (they would be ignored)
        given = [f"--{n.replace('_', '-')}" for n in ("accuracy_formats", "accuracy_tokens", "model")
                 if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: for the accuracy section, which --no-accuracy leaves out")
    if args.accuracy_tokens is None:
        args.accuracy_tokens = 512
    if args.accuracy_tokens < 2:
        raise ValueError(f"--accuracy-tokens {args.accuracy_tokens}: need at least 2")
    acc_formats = None
    if args.accuracy_formats is not None:
        from quantzoo import formats

        acc_formats = [s.strip() for s in args.accuracy_formats.split(",") if s.strip()]
        if not acc_formats:   # (it meant every format)
            raise ValueError(f"--accuracy-formats {args.accuracy_formats!r}: no format named")
        for n in acc_formats:
            formats.get_stored(n, "--accuracy-formats")
    if args.model is not None:
        from quantzoo.paths import check_no_symlink_loop

        check_no_symlink_loop(args.model, f"--model {args.model!r}")
        if not os.path.exists(args.model):
            raise FileNotFoundError(f"--model {args.model!r}: no such file or directory")
        if not os.path.isdir(args.model) and not args.model.lower().endswith((".gguf", ".bin")):
            # (read later, after a GPU machine's quick bench, it was named "SRC=", no argument here)
            raise ValueError(f"--model {args.model!r}: expected an HF model directory, a .gguf file or a "
                             "KuiperLLama .bin")
    if args.out is not None:
        report.check_out(args.out, f"--out {args.out}")
    # (every argument is checked above, before a minute of GPU bench below)
    bench = speed.load_bench(args.bench) if args.bench else None
    if bench is None and not args.no_bench:
        import torch

        if torch.cuda.is_available():
            from quantzoo.bench import kernels

            log("no --bench given and a GPU is here: running `quantzoo bench kernels --quick` first")
            names = kernels.bench_formats()
            bench = kernels.run_bench(shapes=[(k, n) for k, n, _, _ in kernels.QWEN3_8B_SHAPES],
                                      ms=kernels.QUICK_M, names=names, target_s=0.01, log=log)
    command = "quantzoo " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    if command and "report" not in command:
        command = None
    rep = report.build(bench, model_bench, accuracy=not args.no_accuracy, accuracy_formats=acc_formats,
                       accuracy_tokens=args.accuracy_tokens, model_path=args.model, command=command,
                       log=log)
    if args.out is not None:
        try:
            files = report.write(rep, args.out, plots=not args.no_plots)
        except OSError as e:   # what check_out could not foresee (a full disk, /proc as root)
            raise OSError(f"--out {args.out}: could not write {e.filename or args.out}: {e.strerror or e}") from None
        log(f"wrote {files['md']} and {len(files['plots'])} plots"
            + (f" ({rep['plots_skipped']})" if rep.get("plots_skipped") else ""))
    else:
        print(report.render(rep, []))
    return 0
