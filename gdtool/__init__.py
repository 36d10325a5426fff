"""gdtool: where the time of a decode step goes, host or device, and what a CUDA graph wins back.

    import gdtool
    model = gdtool.load_model("tiny-llama", seed=0)
    prompt = gdtool.random_prompts(model, batch=4, lengths=(5, 12), seed=0)
    out = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", max_new_tokens=32)
    print(out.tokens, out.steps, out.host_syncs)
"""
import warnings as _warnings

from .core.compat import untested_transformers as _untested_transformers
from .core.modes import MODES
from .loops.decode import DecodeOutput, decode
from .loops.decoder import Decoder
from .loops.rollout import RolloutInterrupted, RolloutOutput, rollout
from .core.models import PRESETS, load_model, random_prompts
from .measure.timing import ProfileResult, add_device_busy, profile
from .frontends.sweep import sweep
from .measure import costmodel, workloads

__all__ = ["MODES", "PRESETS", "DecodeOutput", "Decoder", "ProfileResult", "RolloutInterrupted", "RolloutOutput", "add_device_busy",
           "costmodel", "decode", "load_model", "profile", "random_prompts", "rollout", "sweep", "workloads"]
__version__ = "0.1.0"

_untested = _untested_transformers()
if _untested:
    _warnings.warn(_untested, stacklevel=2)
