"""quantzoo.bench.power: nvidia-smi's samples parsed and summarised, and sustained() driven by a
stand-in nvidia-smi (a Python script) and a stand-in replay, so it runs without a GPU."""
import subprocess
import sys
import textwrap
import time

import pytest

from quantzoo.bench import power


def test_parse_skips_what_is_not_a_sample():
    text = "1980, 119.45, 0x0000000000000000\n[N/A], 12.0, 0x0\nNo devices were found\n" \
           "1335, 700.12, 0x0000000000000004\n1, 2\n[Not Supported], [Not Supported], 0x0\n"
    assert power.parse(text) == [(1980.0, 119.45, 0), (1335.0, 700.12, 4)]


def test_summarize_takes_the_second_half():
    ramp = [(1980.0, 120.0, 0)] * 5   # the driver settling: dropped
    held = [(1300.0, 698.0, 0x4), (1350.0, 702.0, 0x4), (1320.0, 700.0, 0x4), (1500.0, 650.0, 0x0),
            (1310.0, 699.0, 0x24)]
    s = power.summarize_samples(ramp + held)
    assert s["sm_clock_mhz"] == 1320.0 and s["power_w"] == pytest.approx(689.8)   # median clock, mean power
    assert s["power_capped"] == pytest.approx(4 / 5)
    assert s["clock_reasons"] == ["sw power cap", "sw thermal"] and s["clock_reason_bits"] == 0x24
    with pytest.raises(ValueError, match="3 usable samples"):
        power.summarize_samples(held[:3])


def fake_smi(tmp_path, power_field="power.draw.instant", reason_field="clocks_event_reasons.active",
             line="1400, 690.5, 0x0000000000000004", stream=True):
    """An executable nvidia-smi stand-in: for --query-gpu lists that end in power_field,
    reason_field one sample (or, under -lms, one every 10 ms unless stream is False), the
    enforced limit for that query, and an error like the real one for anything else."""
    script = tmp_path / f"smi_{power_field}_{reason_field}_{stream}.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        q = [a for a in sys.argv if a.startswith("--query-gpu=")][0][len("--query-gpu="):]
        if q == "enforced.power.limit":
            print("700.00"); sys.exit(0)
        if q != "clocks.sm,{power_field},{reason_field}":
            print('Field "' + q.split(",")[-1] + '" is not a valid field to query.'); sys.exit(2)
        if "-lms" not in sys.argv:
            print("{line}"); sys.exit(0)
        while {stream}:
            print("{line}", flush=True); time.sleep(0.01)
        time.sleep(60)
    """))
    return (sys.executable, str(script))


def test_sustained_with_a_stand_in(tmp_path):
    calls = []

    def replay():
        calls.append(time.perf_counter())
        time.sleep(0.002)

    s = power.sustained(replay, lambda: None, calls_per_replay=4, seconds=0.3, cmd=fake_smi(tmp_path))
    assert s["sm_clock_mhz"] == 1400.0 and s["power_w"] == 690.5 and s["power_capped"] == 1.0
    assert s["clock_reasons"] == ["sw power cap"] and s["power_limit_w"] == 700.0
    # (the first replay is the warm-up; more run, uncounted, until the sampler answers)
    assert len(calls) - 1 >= 16 and s["sustained_s"] >= 0.3
    # a replay sleeps 2 ms for 4 launches: 500 us each at least (a fixed upper bound failed on a
    # busy CI core, where sleeps overrun); the stretch's replays are the last n calls, n = the
    # stretch over 4 x sustained_us, and the stretch runs from the first's start to the last's end
    assert s["sustained_us"] >= 500
    n = round(s["sustained_s"] / (4 * s["sustained_us"] * 1e-6))
    assert 16 <= n < len(calls)
    assert calls[-1] - calls[-n] < s["sustained_s"] < calls[-1] - calls[-n] + 0.1
    assert s["mj_per_call"] == pytest.approx(690.5 * s["sustained_us"] * 1e-3)


def test_older_drivers_fields_and_clear_errors(tmp_path):
    old = fake_smi(tmp_path, power_field="power.draw", reason_field="clocks_throttle_reasons.active")
    assert power.fields_for(old) == (("power.draw", "clocks_throttle_reasons.active"), 700.0)
    assert power.sustained(lambda: None, lambda: None, 1, seconds=0.1, cmd=old)["power_w"] == 690.5
    with pytest.raises(ValueError, match="no clock/power sample"):
        power.fields_for(fake_smi(tmp_path, reason_field="nothing.known"))
    with pytest.raises(ValueError, match="no clock/power sample"):   # a driver that gives no numbers
        power.fields_for(fake_smi(tmp_path, line="[N/A], [N/A], [N/A]"))
    with pytest.raises(ValueError, match="cannot run it"):
        power.fields_for((str(tmp_path / "no-such-smi"),))
    with pytest.raises(ValueError, match="0 usable samples"):   # answers once, then streams nothing
        power.sustained(lambda: None, lambda: None, 1, seconds=0.1, cmd=fake_smi(tmp_path, stream=False))


def test_the_sampler_is_stopped_when_the_replay_fails(tmp_path, monkeypatch):
    started = []
    real = subprocess.Popen

    def popen(args, *a, **k):   # subprocess.run's one-shot queries pass through too
        proc = real(args, *a, **k)
        if "-lms" in args:
            started.append(proc)
        return proc

    monkeypatch.setattr(power.subprocess, "Popen", popen)

    def replay():
        if started:   # past the warm-up: the sampler runs
            raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        power.sustained(replay, lambda: None, 1, seconds=5, cmd=fake_smi(tmp_path))
    assert len(started) == 1 and started[0].poll() is not None
