"""Faster kernels for the same step: `kernels="compiled"` and `kernels="fast"` (docs/fast.md).

    step.py       the compiled step that composes them (`CompiledStep`, `KERNELS`, `new_step`)
    compiled.py   the compiled functions kept on the model, one per shape key (`compiles`, `forget`)
    forward.py    the decode forward of a Llama-family model (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Qwen3-MoE,
                  Mixtral, Qwen2-MoE: `forward.FAMILIES`) in gdtool's own kernels (`kernels="fast"`); which path
                  runs at which batch (`forward.line_paths`)
    gemv.py       matrix-vector products, the norm before them and the rotary after them fused in:
                  RMSNorm + GEMV (o, gate/up, down, lm_head); RMSNorm + q/k/v [+ biases] [+ q/k norm] + RoPE +
                  cache write (Triton), 1-16 rows
    attention.py  decode attention: packed grouped-query SDPA for the compiled step; split-KV over the
                  live cache slots for the fast step (Triton)
    window.py     a full sliding window's cache shifted left by one slot in place (Gemma 3; Triton)
    experts/      mixture-of-experts blocks at small batch (router, gate/up over the routed experts only,
                  down with the weighted top-k sum; the grouped kernels from 2 tokens; Triton), swapped into
                  the compiled HF forward: a module per part (tiles, reference, router, small, oss, grouped,
                  blocks)
    linear.py     any other model's linear layers at 1-4 rows in gemv.py's kernel (bias epilogue), swapped in too;
                  up to 64 rows in dot.py's (GDTOOL_DOT_LINEAR=1)
    dot.py        products of up to 64 rows on the tensor cores: split-K tl.dot, the slices added in the last
                  program of each column tile (Triton)
    swap.py       the swap: modules' forwards replaced for the length of a compiled call
    sampling.py   token selection: sort-free top-k/top-p sampling; a two-stage argmax (Triton)
    tail.py       the greedy fast step's tail in one kernel: the argmax's second stage, the state's update and
                  the caches' counters (Triton)
    fuse.py       q/k/v and gate/up as one weight each
    ops.py        each kernel behind one call: Triton where it runs, the torch reference elsewhere
    triton.py     what the kernels need from Triton, and whether it is there; the PDL switch
    testing.py    a test harness: every kernel against float64 on fresh random inputs (`check_all`,
                  `check_experts_all`; `check.py`, its old name, an alias for one release)

Above the core (it composes `core.step.Step`), below the loops that run it. A new kernel family is a
module of its own here (or a package of them, as `experts/`), with its torch reference and its entry in `ops.py`.
"""
