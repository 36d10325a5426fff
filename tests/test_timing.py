"""gdtool.profile: one row per decode step, host vs device time. CPU here; GPU checks are marked cuda."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

import gdtool
from gdtool.core import ranges
from gdtool.measure import timing


@pytest.fixture(scope="module")
def tiny(load):
    model = load("tiny-llama", device="cpu")
    prompt = gdtool.random_prompts(model, batch=2, lengths=(2, 5), seed=0)
    return model, prompt


@pytest.mark.parametrize("mode,poll", [("eager", 1), ("forward-graph", 1), ("step-graph", 2)])
def test_profile_rows_and_clocks_on_cpu(tiny, mode, poll):
    model, prompt = tiny
    res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode=mode, max_new_tokens=6,
                         eos_token_id=None, eos_poll_interval=poll, seed=0)
    steps, summary = res
    out = res.output
    assert list(steps.columns) == list(timing.COLUMNS)
    assert out.steps == 5 and steps["step"].tolist() == [1, 2, 3, 4, 5]
    assert (steps["wall_us"] > 0).all() and (steps["host_us"] > 0).all()
    assert (steps["host_us"] <= steps["wall_us"]).all()
    assert steps["wall_us"].sum() <= out.timings["decode_s"] * 1e6
    for column in ("device_span_us", "device_busy_us", "gpu_idle_us"):
        assert steps[column].isna().all()
    assert any("NaN" in note and "cpu" in note for note in res.notes)
    polled = [j % poll == 0 for j in steps["step"]]
    if mode == "step-graph":  # uncaptured on a CPU: only the EOS polls wait
        assert steps["syncs"].tolist() == [int(p) for p in polled]
    else:
        assert (steps["syncs"] >= 1).all()
    assert steps["syncs"].sum() <= out.host_syncs
    assert list(summary.index) == list(timing.METRICS)
    assert list(summary.columns) == ["median", "p20", "p80", "mean", "total", "per_token"]
    assert summary.loc["wall_us", "total"] == pytest.approx(steps["wall_us"].sum())
    assert summary.loc["host_us", "per_token"] == pytest.approx(steps["host_us"].sum() / (5 * out.batch))
    assert summary.loc["wall_us", "p20"] <= summary.loc["wall_us", "median"] <= summary.loc["wall_us", "p80"]
    assert summary.attrs["mode"] == mode and summary.attrs["steps"] == 5
    assert ranges._listeners == []


def test_host_time_excludes_sleeping(tiny):
    """The host clock counts the thread's work, not time it spends asleep inside a step."""
    model, prompt = tiny

    class Sleeper:
        def push(self, name, payload):
            if name == ranges.REPLAY:
                time.sleep(0.02)

        def pop(self, name):
            pass

    sleeper = Sleeper()
    ranges.add_listener(sleeper)
    try:
        steps, _ = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="step-graph",
                                  max_new_tokens=4, eos_token_id=None, warmup=0, seed=0)
    finally:
        ranges.remove_listener(sleeper)
    assert (steps["wall_us"] >= 20_000).all()
    assert (steps["wall_us"] - steps["host_us"] >= 19_000).all()


def test_profile_errors_leave_no_listener(tiny):
    model, prompt = tiny
    with pytest.raises(ValueError, match="warmup"):
        timing.profile(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=4, warmup=-1)
    with pytest.raises(ValueError, match="busy=True needs a CUDA device"):
        timing.profile(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=4, busy=True)
    with pytest.raises(ValueError, match="top_p"):
        timing.profile(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=4, do_sample=True, top_p=1.5,
                       warmup=0)
    assert ranges._listeners == []


def _event(name, start, end, id=0, gpu=False, **extra):
    """A stand-in for torch.profiler's FunctionEvent: the attributes busy_per_step reads."""
    device = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, id=id, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           **extra)


def test_busy_per_step_joins_kernels_to_launches_by_correlation():
    events = [
        _event("cudaLaunchKernel", 1, 2, id=5),                      # launched before any step
        _event(timing._MARK + "1", 10, 20, id=900),
        _event("aten::mm", 11, 14, id=7),                            # an op: its id is not a CUPTI id
        _event("cudaLaunchKernel", 12, 13, id=7),
        _event("cudaGraphLaunch", 15, 16, id=8),
        _event(timing._MARK + "2", 30, 40, id=901),
        _event("cuLaunchKernelEx", 31, 32, id=9),
        _event("cudaMemcpyAsync", 33, 34, id=10),
        _event("cudaLaunchKernel", 45, 46, id=11),                   # between steps
        # kernels run later than their launch, on the device clock
        _event("gemm", 100, 103, id=7, gpu=True),
        _event("graph_kernel_a", 103, 110, id=8, gpu=True),          # every kernel of a replay shares its id
        _event("graph_kernel_b", 110, 111.5, id=8, gpu=True),
        _event("gemv", 120, 122.5, id=9, gpu=True),
        _event("Memcpy DtoH (Device -> Pinned)", 123, 173, id=10, gpu=True),   # not a kernel
        _event("add", 180, 220, id=11, gpu=True),
        _event("early", 3, 4, id=5, gpu=True),
        _event("orphan", 230, 231, id=99, gpu=True),                 # no launch record
    ]
    busy, outside = timing.busy_per_step(events)
    assert busy == {1: 11.5, 2: 2.5}
    assert outside == 40 + 1 + 1


def test_busy_per_step_counts_launched_work_only():
    """A device-side record correlated with a synchronizing call is waiting, not work of the step."""
    events = [
        _event(timing._MARK + "1", 10, 20, id=900),
        _event("cudaLaunchKernel", 11, 12, id=7),
        _event("cudaStreamSynchronize", 13, 19, id=8),
        _event("gemv", 100, 102, id=7, gpu=True),
        _event("Stream Sync", 103, 140, id=8, gpu=True),
    ]
    busy, outside = timing.busy_per_step(events)
    assert busy == {1: 2}
    assert outside == 0  # a sync record is not a kernel: neither inside a step nor outside


def test_busy_per_step_ignores_the_gpu_copies_of_user_annotations():
    """The H200's eager batch-1 outliers, rebuilt: Kineto reports each user annotation again on the device
    (``gpu_user_annotation``, the GPU span of the kernels launched in it), under the mark's name and with the
    annotation's own id, from torch's op counter. Where that id equals the CUPTI correlation id of a launch,
    the old join counted the whole span as a kernel of that launch's step (30-70 ms where a step's kernels
    take 2.2 ms); the spans of steps that ran late on the device also stood in for host-side marks."""
    ann = dict(is_user_annotation=True, activity_type="user_annotation")
    gpu_ann = dict(is_user_annotation=True, activity_type="gpu_user_annotation")
    kernel = dict(is_user_annotation=False, activity_type="kernel")
    launch = dict(is_user_annotation=False, activity_type="cuda_runtime")
    events = [
        _event(timing._MARK + "1", 10, 20, id=3, **ann),
        _event("cudaLaunchKernel", 11, 12, id=3, **launch),      # CUPTI id 3: the same number as mark 1's id
        _event(timing._MARK + "2", 30, 40, id=9, **ann),
        _event("cudaLaunchKernel", 35, 36, id=4, **launch),
        _event("gemv", 13, 15, id=3, gpu=True, **kernel),
        _event("gemv", 37, 39, id=4, gpu=True, **kernel),
        # the device-side copies of the marks: step 1's span ran late, over step 2's host time
        _event(timing._MARK + "1", 13, 38, id=3, gpu=True, **gpu_ann),
        _event(timing._MARK + "2", 37, 39, id=9, gpu=True, **gpu_ann),
    ]
    busy, outside = timing.busy_per_step(events)
    assert busy == {1: 2, 2: 2} and outside == 0
    # torch without activity_type: is_user_annotation, or the name of a host-side annotation, tells the spans apart
    for e in events:
        del e.activity_type
    assert timing.busy_per_step(events) == ({1: 2, 2: 2}, 0)
    region = [_event("my_region", 30, 40, id=12, is_user_annotation=True),
              _event("my_region", 37, 39, id=4, gpu=True, is_user_annotation=False)]   # copy not flagged
    inductor = [_event("triton_poi_fused_add_0", 35.2, 35.8, id=13, is_user_annotation=False),  # host range named
                _event("cudaLaunchKernel", 35.3, 35.4, id=14, is_user_annotation=False),         # after its kernel
                _event("triton_poi_fused_add_0", 38, 38.5, id=14, gpu=True, is_user_annotation=False)]
    assert timing.busy_per_step(events + region + inductor) == ({1: 2, 2: 2.5}, 0)
    for e in events:       # nor is_user_annotation: gdtool's marks are still known by their names
        del e.is_user_annotation
    assert timing.busy_per_step(events) == ({1: 2, 2: 2}, 0)


def test_busy_per_step_of_a_stand_in_eager_decode_matches_its_kernels():
    """Many steps, each launching the same kernels, with annotation ids that run through the launch ids:
    every step gets exactly its own kernels' time, the mean equals the median (as nsys sees it)."""
    events, next_cupti = [], 1
    for step in range(1, 48):
        t = step * 100.0
        events.append(_event(timing._MARK + str(step), t, t + 90, id=step * 7, is_user_annotation=True,
                             activity_type="user_annotation"))
        for k in range(5):
            events.append(_event("cudaLaunchKernel", t + k + 1, t + k + 1.5, id=next_cupti,
                                 activity_type="cuda_runtime"))
            events.append(_event("kernel", t + k + 2, t + k + 2.4, id=next_cupti, gpu=True, activity_type="kernel"))
            next_cupti += 1
        events.append(_event(timing._MARK + str(step), t + 2, t + 6.4, id=step * 7, gpu=True,
                             is_user_annotation=True, activity_type="gpu_user_annotation"))
    busy, outside = timing.busy_per_step(events)
    assert set(busy) == set(range(1, 48)) and outside == 0
    assert all(v == pytest.approx(2.0) for v in busy.values()), busy


def test_per_token_gives_the_mean_and_the_typical_step(tiny):
    """per_token: total / (steps x batch), first step and polls included; median_per_token: the median
    step / batch. A first step that costs far more than the rest moves the first, not the second."""
    model, prompt = tiny
    res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", max_new_tokens=6,
                         eos_token_id=None, seed=0, warmup=0)
    res.steps.loc[0, "host_us"] = 1000 * res.steps["host_us"].max()   # as a first replay after capture would
    res.summary = timing.summarize(res.steps, res.output.batch)
    figures = timing.per_token(res)
    steps, batch = len(res.steps), res.output.batch
    assert figures["host_us_per_token"] == pytest.approx(res.steps["host_us"].sum() / (steps * batch))
    assert figures["host_us_median_per_token"] == pytest.approx(res.steps["host_us"].median() / batch)
    assert figures["host_us_per_token"] > 10 * figures["host_us_median_per_token"]
    assert figures["host_us_p20_per_token"] <= figures["host_us_median_per_token"] <= figures["host_us_p80_per_token"]
    assert "syncs_per_token" in figures


def test_profile_passes_kernels_to_decode_and_reads_a_bool_as_busy(tiny, monkeypatch):
    model, prompt = tiny
    seen = []
    import importlib
    decode_module = importlib.import_module("gdtool.loops.decode")
    real = decode_module.decode
    monkeypatch.setattr(decode_module, "decode", lambda *a, **k: seen.append(k.get("kernels")) or real(*a, **k))
    timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="eager", max_new_tokens=3, warmup=0,
                   kernels="hf")
    assert seen == ["hf"]
    with pytest.warns(DeprecationWarning, match="busy"):
        res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="eager", max_new_tokens=3,
                             warmup=0, kernels=False)
    assert seen[-1] is None and res.steps["device_busy_us"].isna().all()


def test_kernel_pass_marks_every_step(tiny):
    """The profiler pass starts at step 1 (after capture) and marks each step; on a CPU no kernels."""
    model, prompt = tiny

    def run():
        return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", max_new_tokens=5,
                             eos_token_id=None, seed=0)

    busy, outside, steps = timing._kernel_pass(run, torch.device("cpu"))
    assert steps == 4 and busy == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0} and outside == 0.0
    assert ranges._listeners == []



def test_profiler_records_hold_what_function_events_hold(tiny):
    """The kernel pass reads Kineto's records directly instead of building torch's FunctionEvent tree (25 s per
    500k records here, which an eager MoE decode makes), and only those busy_per_step reads: every attribute it
    reads must be the same, record for record, times included, and so its answer."""
    _records_match_events(*tiny, "eager")


def _records_match_events(model, prompt, mode):
    cuda = model.device.type == "cuda"
    marks = timing._KernelMarks(cuda=cuda)
    ranges.add_listener(marks)
    try:
        gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode=mode, max_new_tokens=4,
                      eos_token_id=None, seed=0)
    finally:
        ranges.remove_listener(marks)
        if cuda:
            torch.cuda.synchronize()
        marks.profiler.stop()
    every_event, records = marks.profiler.events(), timing.profiler_records(marks.profiler)
    assert len(every_event) > 100  # the ops, which busy_per_step does not read and the records skip

    def read(e):  # what busy_per_step reads: marks, user annotations, launch calls, device records
        return (e.name.startswith(timing._MARK) or timing._launch(e.name) or e.is_user_annotation
                or e.device_type != torch.autograd.DeviceType.CPU)
    events = [e for e in every_event if read(e)]
    assert all(read(r) for r in records)

    def key(e):
        return e.id, e.name, str(e.device_type), e.is_user_annotation, getattr(e, "activity_type", None)
    assert len(records) == len(events) >= 3
    pairs = list(zip(sorted(events, key=lambda e: (key(e), e.time_range.start)),
                     sorted(records, key=lambda e: (key(e), e.time_range.start))))
    assert all(key(e) == key(r) for e, r in pairs)
    assert all(r.time_range == (e.time_range.start, e.time_range.end) for e, r in pairs)
    # three steps' marks on the host (on a GPU, Kineto also keeps each one's GPU span, under the same name)
    assert sum(e.name.startswith(timing._MARK) and e.device_type == torch.autograd.DeviceType.CPU for e in records) == 3
    busy = timing.busy_per_step(records)
    assert busy == timing.busy_per_step(every_event)
    assert all(v > 0 for v in busy[0].values()) if cuda else not any(busy[0].values())


def test_cli_writes_steps_summary_and_env(tmp_path, capsys):
    import json

    import pandas as pd

    from gdtool.frontends import profile as profile_cli
    rc = profile_cli.main(["--model", "tiny-llama", "--batch", "1,2", "--modes", "eager,step-graph", "--max-new-tokens",
                           "4", "--prompt-length", "3", "--no-eos", "--set", "eos_poll_interval=2", "--out",
                           str(tmp_path), "--json", "--no-progress"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out)
    assert [(r["batch"], r["mode"]) for r in last["per_token"]] == [(1, "eager"), (1, "step-graph"), (2, "eager"),
                                                                   (2, "step-graph")]
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert len(steps) == 4 * 3 and set(timing.COLUMNS) <= set(steps.columns)
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert len(summary) == 4 * len(timing.METRICS)
    from gdtool.measure import record
    env = json.loads((tmp_path / "env.json").read_text())["environment"]
    assert tuple(env) == record.ENV_KEYS and env["torch"] == torch.__version__


def test_cli_times_every_config_before_any_kernel_pass(tmp_path, monkeypatch, capsys):
    """torch.profiler leaves CUPTI attached and taxes every later launch: the CLI must not time a config
    after a kernel pass has run."""
    events = []
    real_profile = timing.profile

    def timed(*args, **kwargs):
        assert kwargs["busy"] is False
        events.append(("timed", kwargs["mode"]))
        return real_profile(*args, **kwargs)

    def busy(result):
        events.append(("kernels", result.output.mode))
        return timing._finish(result)

    from gdtool.frontends import profile as profile_cli
    monkeypatch.setattr(timing, "profile", timed)
    monkeypatch.setattr(timing, "add_device_busy", busy)
    monkeypatch.setattr(profile_cli, "_cuda", lambda: True)   # as on a GPU: a kernel pass per config
    assert profile_cli.main(["--model", "tiny-llama", "--batch", "1,2", "--modes", "eager,step-graph",
                             "--max-new-tokens", "3", "--prompt-length", "3", "--no-eos", "--out", str(tmp_path),
                             "--no-progress"]) == 0
    assert [kind for kind, _ in events] == ["timed"] * 4 + ["kernels"] * 4
    assert [mode for _, mode in events[4:]] == ["eager", "step-graph"] * 2


def test_add_device_busy_needs_a_profile_result_on_cuda(load):
    model = load("tiny-llama")
    prompt = gdtool.random_prompts(model, batch=1, lengths=(3, 3), seed=0)
    res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", max_new_tokens=3)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        timing.add_device_busy(res)
    with pytest.raises(ValueError, match="not made by gdtool.profile"):
        timing.add_device_busy(timing.ProfileResult(res.steps, res.summary))
    res._pass["run"] = None  # as after a kernel pass
    with pytest.raises(ValueError, match="already has its device busy time"):
        timing.add_device_busy(res)


def test_add_device_busy_fills_busy_and_idle_from_the_kernel_pass(load, monkeypatch):
    """The plumbing of a later kernel pass, on a CPU: a stand-in pass returns busy time per step; the
    result gets busy and idle columns, a recomputed summary, and lets go of its decode."""
    model = load("tiny-llama")
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 3), seed=0)
    res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", max_new_tokens=4,
                         eos_token_id=None)
    steps = res.steps["step"].tolist()
    res.steps["device_span_us"] = 10.0  # as CUDA events would give
    res._pass["device"] = torch.device("cuda")
    seen = []
    monkeypatch.setattr(timing, "_kernel_pass",
                        lambda run, device, unit: seen.append(unit) or ({s: 4.0 for s in steps}, 0.0, len(steps)))
    assert timing.add_device_busy(res) is res and seen == [ranges.STEP]
    assert (res.steps["device_busy_us"] == 4.0).all() and (res.steps["gpu_idle_us"] == 6.0).all()
    assert res.summary.loc["device_busy_us", "per_token"] == pytest.approx(4.0 * len(steps) / (len(steps) * 2))
    assert any("kernel records of torch.profiler" in n for n in res.notes)
    assert not any("busy=False" in n for n in res.notes) and res._pass["run"] is None
    assert not any("more kernel time than their device span" in n for n in res.notes)


def test_add_device_busy_flags_steps_busier_than_their_span(load, monkeypatch):
    model = load("tiny-llama")
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 3), seed=0)
    res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", max_new_tokens=4,
                         eos_token_id=None)
    steps = res.steps["step"].tolist()
    res.steps["device_span_us"] = 10.0
    res._pass["device"] = torch.device("cuda")
    busy = {s: (40.0 if s == steps[0] else 4.0) for s in steps}   # one step's records exceed its span
    monkeypatch.setattr(timing, "_kernel_pass", lambda run, device, unit: (busy, 0.0, len(steps)))
    timing.add_device_busy(res)
    assert any(n.startswith(f"1 of {len(steps)} steps record more kernel time") for n in res.notes)


def test_summary_per_token_divides_by_steps_times_batch():
    import pandas as pd
    steps = pd.DataFrame({"step": [1, 2], "wall_us": [10.0, 30.0], "host_us": [5.0, 7.0],
                          "device_span_us": [math.nan] * 2, "device_busy_us": [math.nan] * 2,
                          "gpu_idle_us": [math.nan] * 2, "syncs": [1, 0]})
    summary = timing.summarize(steps, batch=4)
    assert summary.loc["wall_us", "per_token"] == 40.0 / 8
    assert summary.loc["wall_us", "median"] == 20.0
    assert math.isnan(summary.loc["device_busy_us", "total"])


# -- GPU --------------------------------------------------------------------------------------------

cuda = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny_cuda(load):
    model = load("tiny-llama", device="cuda")
    prompt = gdtool.random_prompts(model, batch=4, lengths=(3, 9), seed=0)
    return model, prompt


@cuda
@pytest.mark.parametrize("mode", gdtool.MODES)
def test_profile_on_gpu(tiny_cuda, mode):
    model, prompt = tiny_cuda
    res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode=mode, max_new_tokens=12,
                         eos_token_id=None, seed=0)
    steps, out = res.steps, res.output
    assert out.steps == 11
    if mode == "device-loop":  # one row per graph launch: the whole rollout in one
        assert steps["step"].tolist() == [1] and out.replays == 1
    else:
        assert steps["step"].tolist() == list(range(1, out.steps + 1))
    metrics = [m for m in timing.METRICS if not (mode == "device-loop" and m in ("device_busy_us", "gpu_idle_us"))]
    assert not steps[metrics].isna().any().any(), res.notes
    assert (steps["host_us"] <= steps["wall_us"]).all()
    assert steps["wall_us"].sum() <= out.timings["decode_s"] * 1e6
    assert (steps["device_span_us"] > 0).all()
    if mode == "device-loop":  # torch.profiler sees no kernel inside the WHILE node (H200, torch 2.11)
        assert steps["device_busy_us"].isna().all() and any("NaN for device-loop" in n for n in res.notes)
        return
    assert (steps["device_busy_us"] > 0).all()
    # span and busy come from two identical decodes: allow run-to-run jitter per step, none in total
    assert (steps["device_busy_us"] <= steps["device_span_us"] * 1.05 + 2).all(), steps
    assert steps["device_busy_us"].sum() <= steps["device_span_us"].sum()
    # every kernel record belongs to a step, and no step carries a span that is not its kernels' (before the
    # GPU copies of the step marks were left out, every config had about one step span per step "outside")
    assert not any("outside any step range" in n for n in res.notes), res.notes
    busy = steps["device_busy_us"]
    assert abs(busy.mean() / busy.median() - 1) < 0.10, busy.tolist()
    assert any("blocking-sync" in note for note in res.notes), res.notes
    assert ranges._listeners == []


@cuda
def test_graph_step_costs_the_host_less_than_eager(tiny_cuda):
    model, prompt = tiny_cuda
    host = {mode: timing.profile(model, prompt.input_ids, prompt.attention_mask, mode=mode, max_new_tokens=12,
                                 eos_token_id=None, seed=0, busy=False).summary.loc["host_us", "median"]
            for mode in ("eager", "step-graph")}
    assert host["step-graph"] < host["eager"] / 3, host


def _cpu_share_of_wait(wait) -> float:
    torch.cuda._sleep(10)  # make sure the stream is idle and the context current
    torch.cuda.synchronize()
    wall0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
    wait()
    cpu, wall = time.thread_time_ns() - cpu0, time.perf_counter_ns() - wall0
    assert wall > 20e6, "the sleep kernel was too short to measure a wait"
    return cpu / wall


def _item():
    torch.ones((), device="cuda").item()


def _event_sync():
    # gdtool's deferred EOS poll waits on events made with blocking=True: those sleep under the switch.
    # A default event spins in cudaEventSynchronize whatever the context's scheduling (seen on the H200).
    event = torch.cuda.Event(blocking=True)
    event.record()
    event.synchronize()


@cuda
@pytest.mark.parametrize("wait", [torch.cuda.synchronize, _item, _event_sync],
                         ids=["device-sync", "item", "event-sync"])
def test_blocking_sync_makes_waits_sleep(wait):
    """The premise of host_us: under the switch, a wait costs the thread no CPU time; by default it spins."""
    device = torch.device("cuda")
    notes = []
    with timing._sched_blocking_sync(device, True, notes):
        sleeping = _cpu_share_of_wait(wait)
    spinning = _cpu_share_of_wait(wait)
    assert "blocking-sync" in notes[0], notes
    assert sleeping < 0.2, (sleeping, spinning)
    if wait is not _event_sync:  # an event made with blocking=True sleeps under any scheduling (seen on the H200)
        assert spinning > 0.5, (sleeping, spinning)


@cuda
@pytest.mark.parametrize("mode", ["eager", "step-graph"])
def test_profiler_records_hold_what_function_events_hold_on_cuda(tiny_cuda, mode):
    """The same with kernels: launch calls, kernel records and their correlation ids, eager and replayed."""
    _records_match_events(*tiny_cuda, mode)

