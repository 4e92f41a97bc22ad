"""PNG plots for the report (matplotlib is an optional extra: `pip install quantzoo[plot]`).

    roofline.png   achieved TFLOP/s vs M, one panel per bench shape, one line per format, under
                   both measured ceilings: cuBLAS fp16 TFLOP/s (flat) and, per format, what the
                   copy bandwidth allows for that format's bytes, copy_bw * flops / bytes(M)
                   (dashed, the format's colour); the roofline is the lower of the two
    speedup.png    one Qwen3-8B layer's linears: cuBLAS fp16 time / format time vs M
    nmse.png       NMSE on the standard workload vs bits/weight (weights alone and the kernel's
                   function, Q8_1 activations included for GGUF formats)
"""
from __future__ import annotations

import os


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _colors(names):
    plt = _plt()
    cyc = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: ("black" if n == "fp16" else cyc[i % len(cyc)]) for i, n in enumerate(names)}


def roofline(res: dict, path: str) -> str:
    from . import speed

    plt = _plt()
    ceil = res["ceilings"]
    copy_bps, peak = ceil["copy_tbps"] * 1e12, ceil["cublas_fp16_tflops"]
    shapes = []
    for r in res["results"]:
        if (r["k"], r["n"]) not in shapes:
            shapes.append((r["k"], r["n"]))
    names = speed.formats_in(res)
    col = _colors(names)
    ncol = 2 if len(shapes) > 1 else 1
    nrow = (len(shapes) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 4.4 * nrow), squeeze=False)
    ms_all = speed.ms_in(res)
    lo, hi = ms_all[0], ms_all[-1]
    dense = [lo * (hi / lo) ** (i / 63) for i in range(64)] if hi > lo else [lo]
    for ax, (k, n) in zip(axes.flat, shapes):
        for name in names:
            pts = sorted((r["m"], r["tflops"], r["weight_bytes"]) for r in speed.ok_rows(res)
                         if r["format"] == name and (r["k"], r["n"]) == (k, n)
                         and r.get("tflops") is not None and r.get("weight_bytes") is not None)
            if not pts:
                continue
            ms = [p[0] for p in pts]
            ax.plot(ms, [p[1] for p in pts], "o-", ms=3.5, lw=1.6, color=col[name], label=name)
            wb = pts[0][2]
            mem = [copy_bps * 2 * m * n * k / (wb + 2 * m * k + 2 * m * n) / 1e12 for m in dense]
            ax.plot(dense, [min(v, peak) for v in mem], "--", lw=0.9, color=col[name], alpha=0.6)
        ax.axhline(peak, color="grey", lw=1.2, ls=":")
        ax.text(ms_all[0], peak * 1.08, f"cuBLAS fp16 {peak:.0f} TFLOP/s", fontsize=8, color="grey")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (activation rows)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{k} -> {n}", fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 8), fontsize=9, frameon=False)
    fig.suptitle(f"achieved TFLOP/s vs M; dashed: copy bandwidth {ceil['copy_tbps']:.2f} TB/s "
                 f"for each format's bytes; dotted: cuBLAS fp16", fontsize=10, y=0.005, va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speedup(res: dict, path: str) -> str:
    from . import speed

    plt = _plt()
    names = speed.formats_in(res)
    col = _colors(names)
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for name in names:
        pts = [(m, speed.aggregate(res, name, m)) for m in speed.ms_in(res)]
        pts = [(m, a["x_cublas"]) for m, a in pts if a and a["x_cublas"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3.5, color=col[name], label=name)
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("M (activation rows)")
    _, real = speed.layer_weights(res)
    ax.set_ylabel("x cuBLAS fp16 (time ratio)")
    ax.set_title("speed vs cuBLAS fp16, " + ("one Qwen3-8B layer's 7 linears" if real else "bench shapes summed"),
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def nmse_vs_bits(rows: list[dict], path: str) -> str:
    """rows: [{format, bits, nmse_weights, nmse_kernel}] (fractions, not %)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    pts = [r for r in rows if r.get("nmse_weights")]
    ax.plot([r["bits"] for r in pts], [100 * r["nmse_weights"] for r in pts], "o", color="C0",
            label="dequantized weights")
    ax.plot([r["bits"] for r in pts], [100 * r["nmse_kernel"] for r in pts], "x", color="C3", ms=8,
            label="kernel function (emulated)")
    for r in pts:
        ax.annotate(r["format"], (r["bits"], 100 * r["nmse_kernel"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (scales, zeros, mins counted)")
    ax.set_ylabel("NMSE %")
    ax.set_title("error on the standard Gaussian workload vs size", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(out_dir: str, bench: dict | None, nmse_rows: list[dict]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = [nmse_vs_bits(nmse_rows, os.path.join(out_dir, "nmse.png"))]
    if bench is not None:
        from . import speed

        if speed.ok_rows(bench):
            written.append(roofline(bench, os.path.join(out_dir, "roofline.png")))
            written.append(speedup(bench, os.path.join(out_dir, "speedup.png")))
    return written
