"""What a decode's counters count: CUDA graphs only.

`captures` and `replays` count CUDA graphs, so a graph mode run uncaptured (a model on a CPU, or
`capture=False`) reports 0 of both and `captured=False`; `launches` counts the calls of the mode's graph
either way, so the host loop's logic stays visible on a CPU. The same for a `Decoder`, which also names
the graphs it would capture on a GPU. The command line's table is checked in tests/test_cli.py.
"""
import pytest
import torch

import gdtool
from gdtool.loops.decoder import Decoder
from gdtool.measure import timing

GRAPH_MODES = [m for m in gdtool.MODES if m != "eager"]


@pytest.fixture(scope="module")
def tiny(load):
    model = load("tiny-llama", device="cpu")
    return model, gdtool.random_prompts(model, batch=2, lengths=(2, 5), seed=0)


def _decode(model, prompt, mode, **kw):
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode=mode, max_new_tokens=6,
                         eos_token_id=None, seed=0, **kw)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_a_graph_mode_on_a_cpu_reports_it_captured_and_replayed_nothing(tiny, mode):
    model, prompt = tiny
    out = _decode(model, prompt, mode)
    assert out.captured is False
    assert out.captures == 0 and out.replays == 0
    assert out.timings["capture_s"] == 0.0 and out.timings["warmup_s"] > 0  # the warm-up steps did run
    assert out.steps == 5
    # the uncaptured stand-in ran once per step, or once per device-loop launch
    assert out.launches == (1 if mode == "device-loop" else out.steps)


def test_eager_launches_no_graph(tiny):
    out = _decode(*tiny, "eager")
    assert (out.captured, out.captures, out.replays, out.launches) == (False, 0, 0, 0)
    assert out.timings["capture_s"] == 0.0 and out.timings["warmup_s"] == 0.0


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_tokens_do_not_depend_on_what_is_counted(tiny, mode):
    model, prompt = tiny
    assert torch.equal(_decode(model, prompt, mode).tokens, _decode(model, prompt, "eager").tokens)


def test_profile_of_the_device_loop_on_a_cpu_has_one_row_per_launch(tiny):
    """The device loop's rows are its launches; uncaptured they are no replays, and still ranges."""
    model, prompt = tiny
    res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode="device-loop", max_new_tokens=6,
                         eos_token_id=None, seed=0)
    assert res.steps["step"].tolist() == [1]
    assert res.output.launches == 1 and res.output.replays == 0 and res.output.steps == 5


@pytest.mark.parametrize("mode,graph", [("forward-graph", "forward"), ("step-graph", "step"), ("device-loop", "step")])
def test_a_decoder_on_a_cpu_names_the_graphs_a_gpu_would_capture(tiny, mode, graph):
    model, prompt = tiny
    dec = Decoder(model, mode=mode, max_new_tokens=4)
    assert dec.captured is False and "uncaptured=0" in repr(dec)
    first = dec.generate(prompt.input_ids, prompt.attention_mask, seed=0)
    second = dec.generate(prompt.input_ids, prompt.attention_mask, seed=1)
    # the first call builds the graph (a GPU captures it), the second reuses it (a GPU replays it)
    assert dec.uncaptured == 1 and dec.captures == 0
    assert first.captures == second.captures == 0 and not first.captured and not second.captured
    assert "captures=0, uncaptured=1" in repr(dec)
    assert dec.graphs == [{"graph": graph, "batch": 2, "width": prompt.input_ids.shape[1],
                           "cache_len": next(iter(dec.engines)).cache_len, "phase": 0, "captured": False}]
    dec.close()
    assert dec.graphs == [] and dec.uncaptured == 1  # a count over the Decoder's life, as captures is


def test_an_eager_decoder_has_no_graph(tiny):
    model, prompt = tiny
    dec = Decoder(model, mode="eager", max_new_tokens=4)
    dec.generate(prompt.input_ids, prompt.attention_mask)
    assert dec.graphs == [] and dec.uncaptured == 0 and dec.captured is False
    assert "uncaptured" not in repr(dec)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_on_a_gpu_replays_are_the_launches_and_capture_false_counts_none(mode):
    model = gdtool.load_model("tiny-llama", seed=0, device="cuda")
    prompt = gdtool.random_prompts(model, batch=2, lengths=(2, 5), seed=0)
    out = _decode(model, prompt, mode)
    assert out.captured is True and out.captures == 1 and out.timings["capture_s"] > 0
    assert out.replays == out.launches == (1 if mode == "device-loop" else out.steps)
    plain = _decode(model, prompt, mode, capture=False)
    assert plain.captured is False and plain.captures == plain.replays == 0 and plain.launches == out.launches
    dec = Decoder(model, mode=mode, max_new_tokens=4)
    dec.generate(prompt.input_ids, prompt.attention_mask)
    assert dec.captured and dec.captures == 1 and dec.uncaptured == 0 and dec.graphs[0]["captured"] is True
    assert "uncaptured" not in repr(dec)
