"""The device loop (gdtool.loops.devloop): its condition on CPU, the NVRTC kernel, and on a GPU the WHILE node.

CPU: `run_uncaptured` and an uncaptured `DeviceLoop` with a toy step (x += 1; step += 1; done = x >= target)
stop exactly, respect the limit and run in chunks. GPU (`-m cuda`): the same toy step captured and run as
the body of a CUDA graph WHILE node in one launch, and sampling that draws what sequential replays draw.
"""
import ctypes
import math
import struct

import pytest
import torch

from gdtool.loops import devloop
from gdtool.core import graphs
from gdtool.loops.devloop import DeviceLoop, run_uncaptured


def toy(target, device="cpu", rows=None, advance_step=True):
    """Tensors and step of the toy loop; `rows` gives per-row targets (done = every row reached its own)."""
    long = dict(dtype=torch.long, device=device)
    shape = () if rows is None else (len(rows),)
    x, goal = torch.zeros(shape, **long), torch.tensor(target if rows is None else rows, **long)
    done = torch.zeros(shape, dtype=torch.bool, device=device)
    step = torch.zeros((), **long)

    def body():
        x.add_(1)
        if advance_step:
            step.add_(1)
        torch.ge(x, goal, out=done)

    def reset(new_target=None):
        x.zero_()
        step.zero_()
        done.zero_()
        if new_target is not None:
            goal.fill_(new_target)

    return body, x, step, done, goal, reset


# -- CPU: the condition ---------------------------------------------------------------------------

@pytest.mark.parametrize("target", [1, 5, 37])
def test_stops_exactly_when_done(target):
    body, x, step, done, _, _ = toy(target)
    assert run_uncaptured(body, done, step, torch.tensor(100)) == target
    assert int(x) == int(step) == target and bool(done)


def test_limit_stops_first():
    body, x, step, done, _, _ = toy(50)
    assert run_uncaptured(body, done, step, torch.tensor(20)) == 20
    assert int(step) == 20 and not bool(done)


def test_nothing_runs_when_done_or_at_limit():
    body, x, step, done, _, _ = toy(5)
    done.fill_(True)
    assert run_uncaptured(body, done, step, torch.tensor(10)) == 0
    done.fill_(False)
    step.fill_(10)
    assert run_uncaptured(body, done, step, torch.tensor(10)) == 0
    assert int(x) == 0


def test_chunks_cover_the_rollout():
    body, x, step, done, _, _ = toy(37)
    calls = []
    while not bool(done):
        calls.append(run_uncaptured(body, done, step, torch.tensor(100), max_steps=8))
    assert calls == [8, 8, 8, 8, 5] and int(x) == 37
    assert run_uncaptured(body, done, step, torch.tensor(100), max_steps=8) == 0


def test_chunks_stop_at_the_limit():
    body, x, step, done, _, _ = toy(50)
    calls = [run_uncaptured(body, done, step, torch.tensor(20), max_steps=8) for _ in range(4)]
    assert calls == [8, 8, 4, 0] and int(step) == 20


def test_count_steps_advances_step():
    body, x, step, done, _, _ = toy(6, advance_step=False)
    assert run_uncaptured(body, done, step, torch.tensor(100), count_steps=True) == 6
    assert int(step) == 6


def test_all_rows_must_finish():
    body, x, step, done, _, _ = toy(None, rows=[3, 9, 1, 6])
    assert run_uncaptured(body, done, step, torch.tensor(100)) == 9
    assert done.all()


def test_uncaptured_device_loop_matches_reference():
    body, x, step, done, _, reset = toy(23)
    loop = DeviceLoop(body, done, step, 100)
    assert not loop.captured
    seen = []
    while not bool(done):
        loop.launch(max_steps=10)
        seen.append(loop.last_calls)
    assert seen == [10, 10, 3] and loop.launches == 3 and int(x) == 23
    reset(4)
    loop.launch()
    assert loop.last_calls == 4 and int(x) == 4
    assert loop.start_rollout() is None and loop.finish_rollout() is None  # nothing to hand back uncaptured
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.launch()


def test_body_with_replay_method():
    body, x, step, done, _, _ = toy(3)

    class StandIn:  # what gdtool.core.graphs.Uncaptured looks like
        def replay(self):
            body()

    loop = DeviceLoop(StandIn(), done, step, torch.tensor(10))
    loop.launch()
    assert int(x) == 3


def test_bad_arguments_say_what_to_pass():
    body, x, step, done, _, _ = toy(3)
    with pytest.raises(ValueError, match="bool or integer"):
        DeviceLoop(body, done.float(), step, 10)
    with pytest.raises(ValueError, match="one-element int64"):
        DeviceLoop(body, done, step.int(), 10)
    with pytest.raises(ValueError, match="one-element int64"):
        DeviceLoop(body, done, torch.zeros(2, dtype=torch.long), 10)
    with pytest.raises(ValueError, match="limit must be"):
        DeviceLoop(body, done, step, 2.5)
    with pytest.raises(TypeError, match="replay"):
        DeviceLoop(42, done, step, 10)
    with pytest.raises(ValueError, match="inner_clock must be"):   # a clock with no inner graphs to time
        DeviceLoop(body, done, step, 10, inner_clock=torch.zeros(2, dtype=torch.long))
    loop = DeviceLoop(body, done, step, 10)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_steps"):
            loop.launch(max_steps=bad)


# -- CPU: what the machine lacks, said with the fix -------------------------------------------------

GOOD = dict(torch_version="2.11.0+cu130", has_raw_graph=True, bindings_error=None, bindings_version="13.0.1",
            bindings_has_conditional=True, driver_version=13000, nvrtc_version=(13, 0), nvrtc_error=None)


@pytest.mark.parametrize("change, words", [
    (dict(torch_version="2.7.1", has_raw_graph=False), ["torch 2.7.1", "torch>=2.8"]),
    (dict(bindings_error="No module named 'cuda'"), ["pip install 'cuda-python>=12.4'"]),
    (dict(bindings_has_conditional=False, bindings_version="12.2.0"), ["12.2.0", "pip install 'cuda-python>=12.4'"]),
    (dict(driver_version=12020), ["CUDA 12.2", "CUDA 12.4", "driver"]),
    (dict(nvrtc_error="libnvrtc.so.13 not found"), ["nvidia-cuda-nvrtc"]),
    (dict(nvrtc_version=(12, 3)), ["NVRTC 12.3", "12.4"]),
])
def test_support_problems_name_the_version_needed(change, words):
    message = devloop._explain(**{**GOOD, **change})
    for word in words:
        assert word in message


def test_support_ok_when_everything_is_there():
    assert devloop._explain(**GOOD) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_without_cuda_the_loop_runs_uncaptured():
    assert "uncaptured" in devloop.device_loop_support()
    with pytest.raises(RuntimeError, match="uncaptured"):
        devloop.check_device_loop_support()


# -- CPU: the package's names are set where they are read ------------------------------------------

def test_the_package_refuses_a_setting_it_only_copies(monkeypatch):
    """gdtool.loops.devloop re-exports its modules' names; a test or probe that sets one on the package would
    change nothing the loop reads (silently), so the package refuses it and names the module(s) to set."""
    with pytest.raises(AttributeError, match=r"devloop\.MIN_TORCH is a copy of devloop\.support\.MIN_TORCH: set it"):
        devloop.MIN_TORCH = (2, 0)
    with pytest.raises(AttributeError, match=r"devloop\._bindings is a copy of devloop\.support\._bindings: set it"):
        monkeypatch.setattr(devloop, "_bindings", lambda: None)
    with pytest.raises(AttributeError, match=r"devloop\.decode_philox is a copy of devloop\.nodes\.decode_philox:"):
        devloop.decode_philox = None
    assert devloop.MIN_TORCH == devloop.support.MIN_TORCH == (2, 8)
    assert devloop._bindings is devloop.support._bindings
    # one home for cuda-python's modules: the compile and the loop read them through support
    assert not hasattr(devloop.nvrtc, "_bindings") and not hasattr(devloop.loop, "_bindings")
    assert devloop.DeviceLoop is devloop.loop.DeviceLoop and devloop.compile_kernels is devloop.nvrtc.compile_kernels
    monkeypatch.setattr(devloop.support, "MIN_TORCH", (99, 0))   # where _explain reads it
    assert "torch>=99.0" in devloop._explain(**GOOD)
    devloop._not_a_copy = 1   # a name of its own is the package's to hold
    assert devloop._not_a_copy == 1
    del devloop._not_a_copy


# -- CPU: reading torch's RNG arguments out of kernel nodes ----------------------------------------

def philox(seed_ptr=0x7F0000001000, offset_ptr=0x7F0000002000, intragraph=8, captured=True):
    return struct.pack("<QQQ?7x", seed_ptr, offset_ptr, intragraph, captured)


def test_decode_philox():
    assert devloop.decode_philox(philox()) == (0x7F0000001000, 0x7F0000002000, 8)
    assert devloop.decode_philox(philox(captured=False)) is None      # eager launch: values, not pointers
    assert devloop.decode_philox(philox(intragraph=6)) is None        # torch keeps offsets multiples of 4
    assert devloop.decode_philox(philox()[:24]) is None
    assert devloop.decode_philox(philox(), is_device_pointer=lambda p: False) is None


def test_kernel_param_bytes_from_pointer_array_and_packed_buffer():
    number, state = ctypes.c_longlong(-7), ctypes.create_string_buffer(philox(), 32)
    array = (ctypes.c_void_p * 2)(ctypes.addressof(number), ctypes.addressof(state))
    assert devloop.kernel_param_bytes(ctypes.addressof(array), 0, 1, 0, 32) == philox()
    assert devloop.kernel_param_bytes(ctypes.addressof(array), 0, 0, 0, 8) == struct.pack("<q", -7)
    packed = ctypes.create_string_buffer(struct.pack("<q8x", -7) + philox(), 48)
    size = ctypes.c_size_t(48)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(packed), 2, ctypes.addressof(size), 0)
    assert devloop.kernel_param_bytes(0, ctypes.addressof(extra), 1, 16, 32) == philox()


def test_references_finds_a_wrapped_pointer():
    wrapped = struct.pack("<QQ", 5, 0x7F0000002000) + philox()
    assert devloop.references([b"\0" * 8, wrapped], 0x7F0000002000)
    assert not devloop.references([wrapped], 0x7F0000003000)


# -- NVRTC (no GPU needed; skipped where cuda-python or NVRTC is missing) ---------------------------

def _nvrtc():
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()
    except Exception as error:  # missing package or missing libnvrtc
        pytest.skip(f"NVRTC not available: {error}")
    return nvrtc


def test_nvrtc_compiles_the_condition_kernel_without_headers():
    nvrtc = _nvrtc()
    image, target = devloop.compile_kernels((9, 0), nvrtc)
    assert target == "sm_90" and image[:4] == b"\x7fELF"
    assert b"gdtool_loop_condition" in image and b"cudaGraphSetConditional" in image
    assert b"gdtool_stamp" in image and b"gdtool_rng_set" in image


def test_nvrtc_falls_back_to_ptx_for_an_unknown_architecture():
    nvrtc = _nvrtc()
    image, target = devloop.compile_kernels((99, 0), nvrtc)
    assert target.startswith("compute_") and b".entry gdtool_loop_condition" in image
    assert b".entry gdtool_stamp" in image and b"%globaltimer" in image


# -- GPU: the WHILE node ----------------------------------------------------------------------------

def capture(fn):
    """Warm `fn` up and capture it keeping the cudaGraph_t, as the device-loop mode does."""
    graphs.warm_up(fn, 1)
    graph = graphs.Captured(fn, keep_graph=True).graph
    torch.cuda.synchronize()
    return graph


def captured_toy(target, rows=None, advance_step=True):
    body, x, step, done, goal, reset = toy(target, "cuda", rows, advance_step)
    graph = capture(body)
    reset()
    return graph, x, step, done, goal, reset


@pytest.mark.cuda
@pytest.mark.parametrize("target", [1, 5, 1000])
def test_one_launch_runs_exactly_target_steps(target):
    graph, x, step, done, _, _ = captured_toy(target)
    with DeviceLoop(graph, done, step, 10**6) as loop:
        loop.launch()
        torch.cuda.synchronize()
        assert (int(x), int(step), bool(done), loop.launches) == (target, target, True, 1)
        loop.launch()  # already done: the entry kernel keeps the body from running
        torch.cuda.synchronize()
        assert int(x) == target


@pytest.mark.cuda
def test_inner_clock_times_the_inner_graphs_on_the_device():
    """An inner graph runs at each launch's start and after each step while its flag is 0; `inner_clock[1]`
    adds up its time on the device: positive, within the launch's time, and more for a launch with more runs."""
    body, x, step, done, _, reset = toy(6, "cuda")
    settled = torch.zeros(1, dtype=torch.long, device="cuda")
    runs = torch.zeros((), dtype=torch.long, device="cuda")

    def stepped():
        body()
        settled.zero_()   # every step asks for the inner graph

    def inner():
        torch.cuda._sleep(100_000)
        runs.add_(1)
        settled.fill_(1)

    outer, inner_graph = capture(stepped), capture(inner)
    clock = torch.zeros(2, dtype=torch.long, device="cuda")
    totals = []
    for target in (6, 18):
        reset(target)
        settled.zero_()
        runs.zero_()
        before = int(clock[1])
        with DeviceLoop(outer, done, step, 100, inner=[(inner_graph, settled)], inner_clock=clock) as loop:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loop.launch()
            end.record()
            torch.cuda.synchronize()
        spent = int(clock[1]) - before
        assert int(x) == target and int(runs) >= target
        assert 0 < spent <= start.elapsed_time(end) * 1e6
        totals.append(spent)
    assert totals[1] > totals[0]


@pytest.mark.cuda
def test_relaunch_after_reset_and_done_at_entry():
    graph, x, step, done, _, reset = captured_toy(7)
    with DeviceLoop(graph, done, step, 100) as loop:
        loop.launch()
        reset(12)
        loop.launch()
        torch.cuda.synchronize()
        assert int(x) == 12
        reset(12)
        done.fill_(True)
        loop.launch()
        torch.cuda.synchronize()
        assert int(x) == 0


@pytest.mark.cuda
def test_limit_is_respected():
    graph, x, step, done, _, _ = captured_toy(50)
    limit = torch.tensor(20, device="cuda")
    with DeviceLoop(graph, done, step, limit) as loop:
        loop.launch()
        torch.cuda.synchronize()
        assert int(step) == 20 and not bool(done)
        limit.fill_(30)  # the limit is read at each launch
        loop.launch()
        torch.cuda.synchronize()
        assert int(step) == 30


@pytest.mark.cuda
def test_chunked_launches():
    graph, x, step, done, _, _ = captured_toy(37)
    with DeviceLoop(graph, done, step, 100) as loop:
        ran, before = [], 0
        while not bool(done):
            loop.launch(max_steps=8)
            now = int(step)  # a host sync, as a streaming reader does
            ran.append(now - before)
            before = now
        assert ran == [8, 8, 8, 8, 5] and loop.launches == math.ceil(37 / 8)
        loop.launch(max_steps=3)
        loop.launch()  # back to no cap
        torch.cuda.synchronize()
        assert int(x) == 37


@pytest.mark.cuda
def test_count_steps_and_rows():
    graph, x, step, done, _, _ = captured_toy(9, advance_step=False)
    with DeviceLoop(graph, done, step, 100, count_steps=True) as loop:
        loop.launch()
        torch.cuda.synchronize()
        assert int(step) == int(x) == 9
    graph, x, step, done, _, _ = captured_toy(None, rows=[3, 9, 1, 6])
    with DeviceLoop(graph, done, step, 100) as loop:
        loop.launch()
        torch.cuda.synchronize()
        assert int(step) == 9 and x.tolist() == [9] * 4


@pytest.mark.cuda
def test_graph_without_keep_graph_is_refused():
    body, x, step, done, _, _ = toy(3, "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    with pytest.raises(ValueError, match="keep_graph=True"):
        DeviceLoop(graph, done, step, 10)


def sampler(batch=4, vocab=257, steps=24, seed=0):
    """A sampling step: Gumbel-max draw over fixed logits (exponential_ on the default generator)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    probs = torch.randn(batch, vocab, device="cuda", generator=g).softmax(-1)
    tokens = torch.zeros(steps, batch, dtype=torch.long, device="cuda")
    step = torch.zeros((), dtype=torch.long, device="cuda")
    done = torch.zeros((), dtype=torch.bool, device="cuda")
    last = torch.tensor(steps, device="cuda")

    def body():
        race = torch.empty_like(probs).exponential_(1)
        tokens.index_copy_(0, step.view(1), (probs / race).argmax(-1)[None])
        step.add_(1)
        torch.ge(step, last, out=done)

    def reset():
        tokens.zero_()
        step.zero_()
        done.zero_()

    return body, tokens, step, done, reset


def rng_increment(body, generator):
    before = generator.get_offset()
    body()
    torch.cuda.synchronize()
    return generator.get_offset() - before


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", [None, 5])
def test_sampling_draws_what_sequential_replays_draw(chunk):
    body, tokens, step, done, reset = sampler()
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    increment = rng_increment(body, generator)
    graph = capture(body)

    torch.cuda.manual_seed(1234)
    reset()
    for _ in range(tokens.shape[0]):
        graph.replay()
    torch.cuda.synchronize()
    expected, expected_offset = tokens.clone(), generator.get_offset()
    assert len({tuple(row) for row in expected.tolist()}) > 1  # the draws differ from step to step

    with DeviceLoop(graph, done, step, 10**6, advance_rng=True, rng_increment=increment) as loop:
        assert loop.rng_kernels >= 1
        torch.cuda.manual_seed(1234)
        reset()
        loop.start_rollout()
        while not bool(done):
            loop.launch(max_steps=chunk)
        assert loop.finish_rollout() == expected_offset
        assert torch.equal(tokens, expected)
        assert generator.get_offset() == expected_offset

        torch.cuda.manual_seed(1234)  # again, handing the step count instead of reading the device
        reset()
        loop.start_rollout()
        loop.launch()
        loop.finish_rollout(steps=tokens.shape[0])
        torch.cuda.synchronize()
        assert torch.equal(tokens, expected) and generator.get_offset() == expected_offset


@pytest.mark.cuda
def test_without_advance_every_iteration_draws_the_same():
    # Why advance_rng exists: replay() moves the Philox offset on the host, the device loop does not.
    body, tokens, step, done, reset = sampler()
    graph = capture(body)
    reset()
    with DeviceLoop(graph, done, step, 10**6) as loop:
        loop.launch()
        torch.cuda.synchronize()
    assert len({tuple(row) for row in tokens.tolist()}) == 1


@pytest.mark.cuda
def test_advance_rng_needs_the_increment_and_an_rng_kernel():
    body, tokens, step, done, reset = sampler()
    graph = capture(body)
    with pytest.raises(ValueError, match="rng_increment"):
        DeviceLoop(graph, done, step, 10, advance_rng=True)
    toy_graph, x, toy_step, toy_done, _, _ = captured_toy(3)
    with pytest.raises(ValueError, match="no torch RNG kernel"):
        DeviceLoop(toy_graph, toy_done, toy_step, 10, advance_rng=True, rng_increment=4)
