"""A seeded sweep over `kernels="fast"`: which models, which cases, and what each case covers.

The fast forward takes a batch in passes of the matrix-vector kernels up to the line (`forward.line_paths`;
`forward.gemv_line(N)` moves it, as the GPU bench does) and hands a wider batch to HF's forward, compiled.
What can go wrong depends on the family (q/k/v biases, q/k norm, a window, Gemma 3's norms and sliding
layers, experts), on where the batch falls against the line (one pass, several with a partial last one, past
it), on left padding, on the sampling settings and on EOS firing in some rows. Each case draws all of these:

    model     tiny Llama, Qwen2, Qwen3, Mistral (its window wider than the cache, or narrower: refused, HF's
              forward compiled runs), Gemma 3 (sliding layers of 8 beside a full one), Qwen3-MoE, Mixtral, Qwen2-MoE
    batch     1-64 rows, against the default line or one moved to 0-16 rows (most often to take the batch)
    prompt    padded width 1-12, left pads per row (one row unpadded)
    decode    2-14 new tokens; greedy, or sampling with a repetition penalty; EOS off, or a token the reference
              decodes in some row (it fires there, not in the others)
    modes     eager, forward-graph, step-graph (a random EOS polling interval), device-loop
    dot       in half the cases (the drawn seed even) the switch `dot_linear` on: where the batch runs HF's forward
              compiled past the matrix-vector kernels' rows, its linear layers in gdtool's split-K dot kernel
              (`kernels/dot.py`; derived from the seed, so the other draws are those of the sweep before it)

`run(case)` decodes it in every mode and checks what the option promises: every mode's tokens and scores bit
for bit its uncaptured twin's (`gdtool.kernels.step.uncaptured_twin`: eager for eager and forward-graph, which
compile the forward alone; the step-graph run uncaptured for step-graph and device-loop, which compile the whole
step), the path each compiled step's account (`compiles()`) names the one `forward.plan` chose for the batch, and
in float32 on a CPU (the fast forward's torch references; Triton's kernels where its interpreter is on) every
mode's tokens generate()'s; on CUDA (bf16: the kernels round otherwise than HF's, enough to flip a token) the
graph modes captured. The two compiled programs are lowered apart and may round a logit apart in bf16 (one
unit in one logit of one row of 33, Mistral on the H200): across them only the float32 tokens are compared, each
against generate()'s. `coverage()` names what a list of cases covers, so a test can assert that nothing was left
out. `profiles/fast_sweep.py` runs many seeds.
"""
from __future__ import annotations

import contextlib
import functools
import random
from dataclasses import dataclass

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "mistral-wide", "mistral-narrow", "tiny-gemma3",
          "qwen3_moe", "mixtral", "qwen2_moe")
MODES = ("eager", "forward-graph", "step-graph", "device-loop")
POLLS = (1, 3, "async", 0)
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1)
PATHS = ("one pass", "passes", "matmuls", "refused")


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    line: int | None      # the matrix-vector rows (forward.gemv_line), None: the default line
    width: int            # padded prompt width
    pads: tuple           # left pads per row
    new_tokens: int
    sampling: bool
    eos: tuple | None     # (row, step) of the reference's token taken for EOS, None: EOS off
    poll: object          # step-graph's eos_poll_interval
    seed: int
    dot: bool = False     # the switch dot_linear on (GDTOOL_DOT_LINEAR=1)

    @property
    def name(self) -> str:
        line = "default" if self.line is None else self.line
        eos = "off" if self.eos is None else f"r{self.eos[0]}s{self.eos[1]}"
        return (f"{self.model}-b{self.batch}-line{line}-p{self.width}-pads{'.'.join(map(str, self.pads))}-"
                f"n{self.new_tokens}-{'sample' if self.sampling else 'greedy'}-eos{eos}-poll{self.poll}-s{self.seed}"
                + ("-dot" if self.dot else ""))


def cases(per_model: int, seed: int = 0, models=MODELS, wide: float = 0.15) -> list[Case]:
    """`per_model` cases of each model drawn from `seed`; about `wide` of them past 16 rows (HF's forward compiled:
    ~10 s each on a CPU)."""
    rng = random.Random(f"fast-{seed}")
    out = []
    for _ in range(per_model):
        for model in models:
            batch = rng.randint(17, 64) if rng.random() < wide else rng.choice((rng.randint(1, 4), rng.randint(1, 16)))
            draw = rng.random()   # the default line, one that takes the batch, or any
            rows = None if draw < 0.4 else rng.randint(min(batch, 16), 16) if draw < 0.8 else rng.randint(0, 16)
            width, new_tokens = rng.randint(1, 12), rng.randint(2, 14)
            pads = [rng.randint(0, width - 1) for _ in range(batch)]
            pads[rng.randrange(batch)] = 0   # one row unpadded: the padded width is the longest prompt
            eos = (rng.randrange(batch), rng.randint(1, new_tokens - 1)) if rng.random() < 0.4 else None
            case = Case(model, batch, rows, width, tuple(pads), new_tokens, rng.random() < 0.4, eos,
                        rng.choice(POLLS), rng.randrange(1 << 16))
            out.append(Case(**{**vars(case), "dot": case.seed % 2 == 0}))
    return out


@functools.lru_cache(maxsize=None)
def build(name: str, device: str = "cpu", dtype=None):
    """The tiny model `name` (MODELS), float32 unless `dtype` says otherwise."""
    import torch
    import gdtool
    dtype = dtype or torch.float32
    if name.startswith("tiny-"):
        return gdtool.load_model(name, seed=0, device=device, dtype=dtype)
    if name.startswith("mistral-"):
        return tiny_mistral(4096 if name == "mistral-wide" else 6).to(device=device, dtype=dtype)
    import moe
    return moe.build(name, device=device, dtype=dtype)


def tiny_mistral(window: int):
    """A tiny float32 Mistral (tiny-llama's shapes, head_dim 16) with a sliding window of `window` slots."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig
    config = MistralConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                           max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def path(case: Case, device: str = "cpu", dtype=None) -> str:
    """The path `forward.plan` picks for the case: one pass or several of the matrix-vector kernels, the matmuls
    past the line, or refused (Mistral's window narrower than the cache)."""
    from gdtool.kernels import forward, gemv
    with line(case.line, device):   # the cache holds the prompt and every new token but the last
        plan = forward.plan(build(case.model, device, dtype), case.batch, case.width + case.new_tokens - 1)
    if plan.applies:
        return "one pass" if case.batch <= gemv.ROWS_PER_PASS else "passes"
    return "matmuls" if plan.matmuls else "refused"


def dot_swap(case: Case, device: str = "cpu", dtype=None) -> bool:
    """Whether the case's linear layers run gdtool's split-K dot kernel: its switch on, the batch in HF's forward
    compiled (past the line, or refused), at rows the matrix-vector kernel does not take (`linear.kernel_for`)."""
    from gdtool.kernels import linear
    taken = path(case, device, dtype)
    if not case.dot or taken not in ("matmuls", "refused"):
        return False
    with switched(case):
        return linear.kernel_for(case.batch, taken == "matmuls") == "split-K dot"


def switched(case: Case):
    """The case's switches of gdtool's kernels (dot_linear)."""
    from gdtool.kernels import triton as fast_triton
    return fast_triton.switches(dot_linear=case.dot)


@contextlib.contextmanager
def line(rows, device: str = "cpu"):
    """Within it, the matrix-vector rows are `rows` at every hidden size (None: the device's own batch lines)."""
    import torch
    from gdtool.kernels import forward, tuning
    if rows is None:
        yield
        return
    with tuning.use(forward.batch_line(rows, tuning.current(torch.device(device)))):
        yield


def run(case: Case, device: str = "cpu", dtype=None) -> list[str]:
    """Decode `case` in every mode with kernels="fast"; the mismatches, one line each (module docstring)."""
    import torch
    from gdtool.kernels.step import compiles, forget
    from reference import decode, generate
    from windows import apart_from_twins, prompt   # prompt: random ids, each row's left pads masked
    model = build(case.model, device, dtype)
    ids, mask = prompt(case, device)
    settings = dict(SAMPLING) if case.sampling else dict(do_sample=False)
    settings.update(eos_token_id=None, pad_token_id=0)
    if case.eos is not None:   # the reference's token there: generate()'s (float32), else eager's with these kernels
        with line(case.line, device), switched(case):
            tokens = generate(model, ids, mask, case.new_tokens, seed=case.seed, **settings)[0] if device == "cpu" \
                else decode(model, ids, mask, case.new_tokens, seed=case.seed, kernels="fast", **settings).tokens
        settings["eos_token_id"] = int(tokens[case.eos])
    ref_tokens = generate(model, ids, mask, case.new_tokens, seed=case.seed, **settings)[0] \
        if device == "cpu" and model.dtype == torch.float32 else None
    expect = "HF forward compiled" if path(case, device, dtype) in ("matmuls", "refused") else "fast decode forward"
    dot = dot_swap(case, device, dtype)
    failures, outs = [], {}
    forget(model)   # a step compiled under another line would run its path again
    with line(case.line, device), switched(case):
        for mode in MODES:
            poll = case.poll if mode == "step-graph" else None
            out = outs[mode, None] = decode(model, ids, mask, case.new_tokens, seed=case.seed, mode=mode,
                                            eos_poll_interval=poll, kernels="fast", **settings)
            if ref_tokens is not None and not torch.equal(out.tokens, ref_tokens):
                failures.append(f"{case.name} {mode}: tokens differ from generate()'s")
            if device != "cpu" and mode == "step-graph" and out.replays != out.steps:
                failures.append(f"{case.name} {mode}: {out.replays} replays for {out.steps} steps (not captured)")
        failures += [f"{case.name} {mode}: tokens or scores differ from {twin}'s" for mode, twin in apart_from_twins(
            outs, "fast", device, lambda mode, capture: decode(model, ids, mask, case.new_tokens, seed=case.seed,
                                                               mode=mode, capture=capture, kernels="fast", **settings))]
    failures += [f"{case.name}: {expect!r} not in the step's account {note!r}"
                 for note in compiles(model).kernels if expect not in note]
    failures += [f"{case.name}: the split-K dot kernel {'not ' if dot else ''}in the step's account {note!r}"
                 for note in compiles(model).kernels if ("split-K dot kernel" in note) != dot]
    forget(model)
    return failures


def coverage(all_cases: list[Case]) -> dict[str, int]:
    """How many cases exercise each thing the sweep must cover."""
    got = {model: sum(c.model == model for c in all_cases) for model in MODELS}
    got.update({p: sum(path(c) == p for c in all_cases) for p in PATHS})
    got["left padding"] = sum(any(c.pads) for c in all_cases)
    got["sampling"] = sum(c.sampling for c in all_cases)
    got["greedy"] = sum(not c.sampling for c in all_cases)
    got["EOS on"] = sum(c.eos is not None for c in all_cases)
    got["line moved"] = sum(c.line is not None for c in all_cases)
    got["dot swap"] = sum(dot_swap(c) for c in all_cases)
    return got
