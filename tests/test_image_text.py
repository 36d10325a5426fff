"""Image-text-to-text checkpoints (Gemma 3 4B+, Qwen3-VL, Mistral 3, LLaVA...) loaded for text: `load_model`
reads a local folder with the class generate() decodes it with (the whole image-text model, fed text only),
and gdtool decodes it bit for bit like generate(), from Python and from the command line."""
import pytest
import torch

import gdtool
import zoo
from gdtool.frontends import run as cli
from gdtool.core.models import model_class
from reference import assert_same, decode, generate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Mistral 3 (Pixtral vision tower + Mistral text model) saved without a tokenizer."""
    path = tmp_path_factory.mktemp("mistral3")
    zoo.build("mistral3", image_text=True).save_pretrained(path)
    return path


def test_an_image_text_config_loads_as_the_image_text_model(checkpoint):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    assert model_class(AutoConfig.from_pretrained(checkpoint)) is AutoModelForImageTextToText
    assert model_class(zoo.tiny_config("llama")) is AutoModelForCausalLM


def test_load_model_decodes_an_image_text_checkpoint_like_generate(checkpoint):
    model = gdtool.load_model(str(checkpoint), device="cpu")
    assert type(model).__name__ == "Mistral3ForConditionalGeneration" and not model.training
    assert model.gdtool_tokenizer is None
    ids, mask = zoo.prompt(model, "cpu")
    ref = generate(model, ids, mask, 6, seed=1, do_sample=True, top_k=20, eos_token_id=None, pad_token_id=0)
    for mode in ("eager", "step-graph"):
        out = decode(model, ids, mask, 6, seed=1, mode=mode, do_sample=True, top_k=20, eos_token_id=None,
                     pad_token_id=0)
        assert_same(out, *ref)


def test_the_cli_runs_an_image_text_checkpoint(checkpoint, capsys):
    argv = ["--model", str(checkpoint), "--device", "cpu", "--batch", "2", "--max-new-tokens", "4", "--prompt-len",
            "3", "--mode", "eager", "step-graph", "--warmup", "0", "--no-progress"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert "mistral3" in capsys.readouterr().out


def _host_reads(fn):
    """The aten calls of `fn` that read a device value on the host (what a CUDA graph cannot capture)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    reads = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.is_nonzero.default, torch.ops.aten._local_scalar_dense.default):
                reads.append(func)
            return func(*args, **(kwargs or {}))

    with Watch():
        out = fn()
    return out, reads


def test_xglm_positions_are_read_without_a_host_read_while_decoding():
    """XGLM's position table checks `2 + seq_len + cache length` against its size, a host read when the cache
    length is the static cache's device counter; while decoding, gdtool looks the rows up without that check,
    with the same values."""
    from gdtool.core import compat
    model = zoo.build("xglm")
    table = model.model.embed_positions
    positions, counter = torch.tensor([[5], [9]]), torch.tensor(9)
    plain, reads = _host_reads(lambda: table(positions, counter))
    assert reads  # the comparison with a tensor counter
    with compat.capturable_positions(model, cache_len=32):
        patched, reads = _host_reads(lambda: table(positions, counter))
    assert not reads and torch.equal(patched, plain)
    assert "forward" not in vars(table)  # put back after decoding
    with compat.capturable_positions(model, cache_len=table.weights.size(0)):  # a table too short keeps its check
        assert "forward" not in vars(table)


@pytest.mark.parametrize("model_type", ["mvp", "roformer", "trocr"])
def test_arange_positions_are_read_without_a_host_read_while_decoding(model_type):
    """5.17's MVP, RoFormer and TrOCR position tables take `torch.arange(past_length, ...)`, a host read when
    the past length is the static cache's device counter; while decoding, gdtool adds the same positions to the
    counter on the device. (Later releases take the positions from the model: nothing is patched there.)"""
    from gdtool.core import compat
    model = zoo.build(model_type)
    tables = [m for m in model.modules() if type(m).__name__ in compat.ARANGE_POSITIONS]
    if not any(compat._reads_past_length_on_host(table) for table in tables):
        with compat.capturable_positions(model, cache_len=32):
            assert not any("forward" in vars(table) for table in tables)
        return
    for table in tables:
        for ids, counter in ((torch.ones(3, 4, dtype=torch.long), 0), (torch.ones(3, 1, dtype=torch.long), torch.tensor(9))):
            arg = ids.shape if model_type == "roformer" else ids
            plain, reads = _host_reads(lambda: table(arg, counter))
            assert reads or isinstance(counter, int)
            with compat.capturable_positions(model, cache_len=32):
                patched, reads = _host_reads(lambda: table(arg, counter))
            assert not reads and torch.equal(patched, plain)
            assert "forward" not in vars(table)
