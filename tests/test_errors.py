"""Every bad input and unsupported setting: a clear error that names the problem and the fix."""
import pytest
import torch

import gdtool


@pytest.fixture(scope="module")
def model():
    return gdtool.load_model("tiny-llama", seed=0)


@pytest.fixture(scope="module")
def prompt(model):
    return gdtool.random_prompts(model, batch=2, lengths=(3, 6), seed=0)


def run(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", 4)
    return gdtool.decode(model, ids, mask, **kw)


BAD_SETTINGS = [
    (dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
    (dict(max_new_tokens=None), "max_new_tokens must be a positive int"),
    (dict(do_sample=True, temperature=0.0), "temperature=0.0 must be > 0"),
    (dict(do_sample=True, temperature=-1.0), "temperature=-1.0 must be > 0"),
    (dict(do_sample=True, top_k=-1), "top_k=-1 must be an int >= 0"),
    (dict(do_sample=True, top_p=1.5), r"top_p=1.5 is outside \(0, 1\]"),
    (dict(do_sample=True, top_p=0.0), r"top_p=0.0 is outside \(0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be > 0"),
    (dict(repetition_penalty=-2.0), "repetition_penalty=-2.0 must be > 0"),
    (dict(eos_token_id=[2, 99999]), "eos_token_id 99999 is outside the vocabulary"),
    (dict(eos_token_id=-1), "eos_token_id -1 is outside the vocabulary"),
    (dict(pad_token_id=4096), "pad_token_id 4096 is outside the vocabulary"),
    (dict(temperature=0.7), "temperature given with do_sample=False"),
    (dict(do_sample=False, top_k=10, top_p=0.9), "top_k, top_p given with do_sample=False"),
    (dict(eos_poll_interval=-1), "eos_poll_interval=-1 must be an int >= 0"),
    (dict(eos_poll_interval="sometimes"), "eos_poll_interval='sometimes'"),
    (dict(eos_poll_interval=1.5), "eos_poll_interval=1.5"),
    (dict(mode="graph"), "mode='graph' is not one of"),
    (dict(capture=True), "capture=True needs a CUDA device"),
    (dict(target_lengths=[3]), "target_lengths needs one length >= 1 per row"),
    (dict(target_lengths=[0, 2]), "target_lengths needs one length >= 1 per row"),
    (dict(eos_token_id=None, target_lengths=[2, 2]), "EOS is disabled"),
]


@pytest.mark.parametrize("kwargs,message", BAD_SETTINGS, ids=[m for _, m in BAD_SETTINGS])
def test_bad_settings(model, prompt, kwargs, message):
    if kwargs.get("capture") and torch.cuda.is_available():
        pytest.skip("capture=True is valid on a GPU")
    with pytest.raises(ValueError, match=message):
        run(model, prompt.input_ids, prompt.attention_mask, mode=kwargs.pop("mode", "step-graph"), **kwargs)


REFUSED = [
    ("min_new_tokens", 3), ("min_length", 5), ("no_repeat_ngram_size", 2), ("bad_words_ids", [[5]]),
    ("suppress_tokens", [5]), ("min_p", 0.1), ("typical_p", 0.9), ("epsilon_cutoff", 0.01), ("eta_cutoff", 0.01),
    ("num_beams", 2), ("stop_strings", ["x"]), ("max_time", 1.0),
    ("sequence_bias", {(5,): 1.0}), ("forced_eos_token_id", 2), ("renormalize_logits", True),
]


@pytest.mark.parametrize("name,value", REFUSED, ids=[n for n, _ in REFUSED])
def test_unimplemented_settings_are_refused_by_name(model, prompt, name, value):
    with pytest.raises(ValueError, match=f"{name}=.*gdtool does not implement it"):
        run(model, prompt.input_ids, prompt.attention_mask, **{name: value})


def test_unimplemented_setting_from_generation_config_is_refused_and_can_be_overridden(model, prompt):
    model.generation_config.no_repeat_ngram_size = 3
    try:
        with pytest.raises(ValueError, match=r"no_repeat_ngram_size=3 \(set in model.generation_config\)"):
            run(model, prompt.input_ids, prompt.attention_mask)
        out = run(model, prompt.input_ids, prompt.attention_mask, no_repeat_ngram_size=0)
        assert out.tokens.shape[0] == 2
    finally:
        model.generation_config.no_repeat_ngram_size = None


def test_num_return_sequences_points_to_num_samples(model, prompt):
    with pytest.raises(ValueError, match="num_return_sequences=2: gdtool calls it num_samples"):
        run(model, prompt.input_ids, prompt.attention_mask, num_return_sequences=2)


def test_unknown_keyword(model, prompt):
    with pytest.raises(TypeError, match="unexpected keyword argument 'tempreature'"):
        run(model, prompt.input_ids, prompt.attention_mask, tempreature=0.5)


BAD_INPUTS = {
    "empty batch": (lambda p: (p.input_ids[:0], p.attention_mask[:0]), "the batch is empty"),
    "1-D ids": (lambda p: (p.input_ids[0], p.attention_mask[0]), "input_ids must be a 2-D integer tensor"),
    "float ids": (lambda p: (p.input_ids.float(), p.attention_mask), "input_ids must be a 2-D integer tensor"),
    "list ids": (lambda p: (p.input_ids.tolist(), p.attention_mask), "input_ids must be a 2-D integer tensor"),
    "id too large": (lambda p: (p.input_ids + 5000, p.attention_mask), "outside the vocabulary"),
    "negative id": (lambda p: (p.input_ids - 5000, p.attention_mask), "outside the vocabulary"),
    "mask shape": (lambda p: (p.input_ids, p.attention_mask[:, 1:]), "attention_mask must have the shape"),
    "mask values": (lambda p: (p.input_ids, p.attention_mask * 2), "only 0 \\(pad\\) and 1"),
    "right padding": (lambda p: (p.input_ids, p.attention_mask.flip(1)), "right-padded or have holes"),
    "hole": (lambda p: (p.input_ids, _hole(p.attention_mask)), "right-padded or have holes"),
    "empty row": (lambda p: (p.input_ids, _empty_row(p.attention_mask)), r"rows \[1\] have no token"),
    "other device": (lambda p: (p.input_ids.to("meta"), p.attention_mask), "input_ids are on meta"),
    "mask on other device": (lambda p: (p.input_ids, p.attention_mask.to("meta")), "attention_mask is on meta"),
}


def _hole(mask):
    mask = torch.ones_like(mask)
    mask[0, 2] = 0
    return mask


def _empty_row(mask):
    mask = mask.clone()
    mask[1] = 0
    return mask


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("mode", gdtool.MODES)
def test_bad_inputs(model, prompt, case, mode):
    make, message = BAD_INPUTS[case]
    ids, mask = make(prompt)
    with pytest.raises(ValueError, match=message):
        run(model, ids, mask, mode=mode)


def test_prompt_plus_new_tokens_beyond_positions(model, prompt):
    with pytest.raises(ValueError, match="exceeds the model's 2048 positions"):
        run(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=2048)


def _tiny(config_cls, **fields):
    from transformers import AutoModelForCausalLM
    base = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**{**base, **fields})).eval()


def test_training_mode_is_refused_with_the_fix(prompt):
    from transformers import LlamaConfig
    m = _tiny(LlamaConfig, attention_dropout=0.1).train()
    p = gdtool.random_prompts(m, batch=2, lengths=(3, 5))
    for mode in gdtool.MODES:
        with pytest.raises(ValueError, match="training mode.*call model.eval"):
            run(m, p.input_ids, p.attention_mask, mode=mode)
    m.config.attention_dropout = 0.0
    with pytest.raises(ValueError, match="training mode"):
        run(m, p.input_ids, p.attention_mask, mode="step-graph")
    run(m, p.input_ids, p.attention_mask, mode="eager")  # no dropout anywhere: eager is exact


@pytest.mark.parametrize("window", [4, 10])
def test_sliding_window_layers_run_in_every_mode(window):
    # window 4: full after the prompt; window 10: fills while decoding (the graph modes switch graphs there)
    from transformers import MistralConfig
    from reference import assert_same, decode, generate
    m = _tiny(MistralConfig, sliding_window=window)
    p = gdtool.random_prompts(m, batch=2, lengths=(3, 5))
    ref = generate(m, p.input_ids, p.attention_mask, 12, eos_token_id=None)
    for mode in gdtool.MODES:
        assert_same(decode(m, p.input_ids, p.attention_mask, 12, eos_token_id=None, mode=mode), *ref)


def test_mixture_of_experts_runs_in_every_mode_and_eager_experts_are_refused_for_capture():
    from transformers import MixtralConfig
    from reference import assert_same, decode, generate
    from gdtool.core import feed
    m = _tiny(MixtralConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    p = gdtool.random_prompts(m, batch=2, lengths=(3, 5))
    ref = generate(m, p.input_ids, p.attention_mask, 8, eos_token_id=None)
    for mode in gdtool.MODES:
        assert_same(decode(m, p.input_ids, p.attention_mask, 8, eos_token_id=None, mode=mode), *ref)
    assert feed.experts_implementation(m) == "grouped_mm"
    m.set_experts_implementation("eager")  # loops over the experts hit: a host read per step
    with pytest.raises(ValueError, match="experts_implementation='eager'.*set_experts_implementation"):
        feed.check(m, "step-graph", torch.device("cuda"))
    feed.check(m, "eager", torch.device("cuda"))   # eager mode decodes it as generate() does


def test_models_generate_decodes_without_a_static_cache_are_refused_in_every_mode():
    from transformers import MptConfig
    m = _tiny(MptConfig, d_model=64, n_heads=4, n_layers=2, vocab_size=512)
    assert m.generation_config.use_cache is False
    p = gdtool.random_prompts(m, batch=2, lengths=(3, 5))
    for mode in gdtool.MODES:
        with pytest.raises(ValueError, match="use_cache=False.*generation_config.use_cache = True"):
            run(m, p.input_ids, p.attention_mask, mode=mode, max_new_tokens=4)


def test_other_attention_kernels_are_refused_in_graph_modes(prompt):
    m = gdtool.load_model("tiny-llama", seed=0)
    m.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attention implementation 'flex_attention'.*attn_implementation='sdpa'"):
        run(m, prompt.input_ids, prompt.attention_mask, mode="forward-graph")


def test_unknown_preset_and_hub_names():
    with pytest.raises(ValueError, match="neither a preset .* nor a local checkpoint folder"):
        gdtool.load_model("meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match="batch >= 1"):
        gdtool.random_prompts(gdtool.load_model("tiny-llama"), batch=0)


def test_missing_local_model_folders_are_named(tmp_path):
    with pytest.raises(ValueError, match="model folder /nonexistent/folder does not exist; check the path"):
        gdtool.load_model("/nonexistent/folder")
    with pytest.raises(ValueError, match="has no config.json: not a checkpoint folder"):
        gdtool.load_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(ValueError, match="is a file, not a checkpoint folder"):
        gdtool.load_model(str(tmp_path / "model.safetensors"))


def test_a_folder_transformers_cannot_load_is_named(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(gdtool.load_model("tiny-llama").config.to_dict()))
    with pytest.raises(ValueError, match=f"model folder {tmp_path} holds no checkpoint transformers can load: .*"
                                         "model.safetensors"):
        gdtool.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="holds no checkpoint transformers can load: .*not a valid JSON"):
        gdtool.load_model(str(tmp_path))


def test_a_failed_capture_is_named_by_the_first_error_and_the_line_that_raised_it():
    """Leaving `torch.cuda.graph` after an op the stream could not capture raises a second, vaguer error ("operation
    failed due to a previous error during capture"); the message gdtool gives is built from the first."""
    from gdtool.core import graphs

    def step():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError) as raised:
        try:
            step()
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    first, where = graphs._first_error(raised.value)
    assert str(first).endswith("not permitted when stream is capturing")
    assert where.startswith("test_errors.py:") and "(step: raise RuntimeError(" in where
    alone = RuntimeError("no context")
    assert graphs._first_error(alone) == (alone, None)  # never raised: no traceback


def test_a_mask_on_the_device_is_a_hazard_except_where_torch_fills_through_it():
    """Indexing with a boolean mask on the device makes torch count its true elements on the host (`nonzero`),
    which no graph can capture (glm5_next's `pool_keys[:, keep]`); but `x[mask] = 0`, one host value through one
    mask, is run by ATen as `masked_fill_`, with no count, and image-text models do it on every step
    (Gemma 3's `llm_input_ids[special_image_mask] = 0`): it must not be refused. The ops are recorded as torch
    dispatches them on the CPU, then their indexed tensors moved to the meta device, which stands in for a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gdtool.core import graphs

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append((func.overloadpacket.__name__, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    def on_device(a, keep_value=False):  # the indexed tensor and its indices on the device; the value as given
        if isinstance(a, (list, tuple)):
            return type(a)(on_device(b) for b in a)
        return a.to("meta") if isinstance(a, torch.Tensor) and not keep_value else a

    def hazard(op) -> bool:
        with Record() as record:
            op(torch.zeros(2, 3), torch.tensor([[True, False, True], [False, False, True]]))
        indexing = [(n, a, k) for n, a, k in record.ops if n in graphs._INDEXING]
        assert len(indexing) == 1, record.ops
        name, args, kwargs = indexing[0]
        moved = (on_device(args[0]), on_device(args[1])) + tuple(on_device(a, keep_value=True) for a in args[2:])
        return graphs._mask_counted_on_host(name, moved, kwargs)

    def fill(x, mask):
        x[mask] = 0

    def fill_a_row_mask(x, mask):
        x[mask[:, 0]] = 5.0

    def put_values(x, mask):
        x[mask] = torch.arange(3.0)

    def accumulate(x, mask):  # adding through the mask: index_put_ with accumulate counts the mask
        x.index_put_((mask,), torch.ones(1) + 1, accumulate=True)

    def read(x, mask):
        return x[mask]

    def read_a_column(x, mask):
        return x[:, mask[0]]

    assert not hazard(fill) and not hazard(fill_a_row_mask)
    assert hazard(put_values) and hazard(accumulate) and hazard(read) and hazard(read_a_column)
    index = torch.tensor([0, 1], device="meta")
    assert not graphs._mask_counted_on_host("index", (torch.zeros(2, 3, device="meta"), [index]), {})
    # capture makes a scalar assigned into a CUDA tensor on the device (torch would copy it from the host inside the
    # op), except through one device mask, where that device value would turn ATen's fill into a counting index_put_
    x, mask = torch.zeros(2, 3, device="meta"), torch.ones(2, 3, dtype=torch.bool, device="meta")
    rows = torch.ones(2, dtype=torch.bool, device="meta")
    assert graphs._fills_through_a_mask(x, mask) and graphs._fills_through_a_mask(x, (rows, slice(None)))
    assert graphs._fills_through_a_mask(x, (Ellipsis, mask[0])) and graphs._fills_through_a_mask(x, (0, mask[0]))
    assert not graphs._fills_through_a_mask(x, (rows, rows[:1].expand(3)))        # two masks: index_put_
    assert not graphs._fills_through_a_mask(x, torch.tensor([0, 1], device="meta"))  # positions, not a mask
    assert not graphs._fills_through_a_mask(x, torch.ones(2, 3, dtype=torch.bool))  # a host mask (served as positions)


def test_a_transformers_release_outside_the_tested_range_is_named_at_import():
    """gdtool reads transformers' internals: a release outside the range its package metadata requires
    (pyproject's, the newest the zoo ran against) gets a warning at import that names the version, the range and
    the two fixes; the installed one is inside it (the test environments install from pyproject), so importing
    gdtool warns of nothing."""
    import subprocess
    import sys

    from gdtool.core.compat import untested_transformers
    requires = ["torch>=2.11", "transformers<5.26,>=5.17", 'pytest>=8; extra == "dev"']
    assert untested_transformers("5.25.0", requires) == "" and untested_transformers("5.17.0", requires) == ""
    for version in ("5.26.0", "5.26.0.dev0", "5.16.1", "6.0.0"):
        text = untested_transformers(version, requires)
        assert f"transformers {version} is outside" in text and "<5.26,>=5.17" in text, text
        assert "pip install 'transformers<5.26,>=5.17'" in text and "bash scripts/dev.sh test" in text
    assert untested_transformers("7.0", ["torch>=2.11"]) == ""  # no transformers requirement: nothing to say
    assert untested_transformers() == ""
    code = ("import warnings\nwith warnings.catch_warnings(record=True) as seen:\n    warnings.simplefilter('always')\n"
            "    import gdtool\nprint([str(w.message) for w in seen if 'gdtool was tested' in str(w.message)])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout[-2000:] + run.stderr[-2000:]
