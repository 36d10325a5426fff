"""A refill's prefill program compiles its decoder layers once (`gdtool.kernels.regions`): the layers are found
across the zoo, the route is on the layers only inside its scope (and there, uncompiled, the layer itself), and a
model whose layers a region cannot hold compiles whole, with the reason in the compiles table, never an error or
another answer."""
import pytest
import torch

import gdtool
from gdtool.kernels import compiled, regions


def _model(name, dtype=torch.float64):
    if name.startswith("zoo:"):
        import zoo
        return zoo.build(name[4:], dtype=dtype)
    return gdtool.load_model(name, seed=0, dtype=dtype)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [7, 8, 9, 10, 11], [9, 9, 9, 9, 9, 9, 9, 9]]
SETTINGS = dict(slots=2, max_new_tokens=4, refill="host", eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe", "tiny-gemma3", "zoo:gpt_oss", "zoo:gemma3_text"])
def test_layers_found_and_the_route_only_inside_its_scope(name):
    model = _model(name, torch.float32)   # HF's grouped experts take no float64
    layers = regions.decoder_layers(model)
    assert len(layers) == model.config.get_text_config().num_hidden_layers > 0
    routes = regions.plan(model)
    assert [layer for layer, _ in routes] == layers
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with regions.scope(routes):   # outside torch.compile a region is the call itself
            assert all(vars(layer)["forward"].__func__ is regions._forward for layer in layers)
            inside = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(before, inside) and torch.equal(before, after)
    assert not any("forward" in vars(layer) for layer in layers)   # HF's forward back on exit


def test_a_layer_already_rerouted_is_left_alone():
    model = _model("tiny-llama")
    first = regions.decoder_layers(model)[0]
    hook = first.forward
    first.forward = lambda *a, **k: hook(*a, **k)   # a dispatch hook's own forward
    assert regions.plan(model) == []


def test_prefill_programs_compile_by_layer_and_are_their_own_twins():
    model = _model("tiny-llama")
    compiled.forget(model)
    host = gdtool.rollout(model, PROMPTS, kernels="compiled", **SETTINGS)
    device = gdtool.rollout(model, PROMPTS, kernels="compiled", **{**SETTINGS, "refill": "device"})
    assert [s.tokens.tolist() for s in host.sequences] == [s.tokens.tolist() for s in device.sequences]
    table = compiled.compiles(model).set_index("step")
    prefills = table[table.index.str.startswith("rows_prefill")]
    assert len(prefills) >= 1 and set(prefills.note) == {"compiled by layer (nested compile regions)"}
    assert table.loc[table.index.str.startswith("rows_decode"), "note"].tolist() == [""]
    assert set(table.compiles) == {1}


def test_a_region_that_fails_compiles_whole_and_says_why(monkeypatch):
    model = _model("tiny-llama")
    compiled.forget(model)
    reference = gdtool.rollout(model, PROMPTS, **SETTINGS)   # HF's kernels

    def broken(layer, *args, **kwargs):
        raise RuntimeError("a layer no region can hold")
    monkeypatch.setattr(regions, "_layer", broken)
    out = gdtool.rollout(model, PROMPTS, kernels="compiled", **SETTINGS)
    assert [s.tokens.tolist() for s in out.sequences] == [s.tokens.tolist() for s in reference.sequences]
    notes = set(compiled.compiles(model).note)
    assert any(n.startswith("compiled whole: by layer it failed (") for n in notes), notes
    assert "compiled by layer (nested compile regions)" not in notes
