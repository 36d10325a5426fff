"""What gdtool must equal: generate() with a static cache and no compile, seeded the same way."""
import torch


def generate(model, prompt_ids, mask, max_new_tokens, seed=None, **settings):
    """generate()'s tokens and scores on the model as freshly loaded: no cache length and no module-held state left
    by earlier calls (`compat.start_fresh`: RecurrentGemma's one-token prefill reads the state it left)."""
    from gdtool.core import compat
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    compat.start_fresh(model)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(prompt_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         cache_implementation="static", disable_compile=True, output_scores=True,
                         return_dict_in_generate=True, **settings)
    # the new tokens: after the prompt, or (an encoder-decoder) after the decoder's start token; a model whose
    # own generate() gives no scores (block diffusion) returns what follows the prompt
    new = len(out.scores) if out.scores is not None else out.sequences.shape[1] - prompt_ids.shape[1]
    return out.sequences[:, out.sequences.shape[1] - new:], out.scores


def decode(model, prompt_ids, mask, max_new_tokens, **kwargs):
    import gdtool
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    return gdtool.decode(model, prompt_ids, mask, max_new_tokens=max_new_tokens, return_scores=True, **kwargs)


def assert_same(out, ref_tokens, ref_scores):
    assert out.tokens.shape == ref_tokens.shape, (out.tokens.shape, ref_tokens.shape)
    assert torch.equal(out.tokens, ref_tokens.cpu()), (out.tokens, ref_tokens)
    assert len(out.scores) == len(ref_scores)
    for i, (a, b) in enumerate(zip(out.scores, ref_scores)):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b), f"scores differ at step {i}"
