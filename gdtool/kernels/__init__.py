"""Faster kernels for the same step: `kernels="compiled"` and `kernels="fast"` (docs/fast.md).

    step.py       the compiled step that composes them (`CompiledStep`, `KERNELS`, `compiles`, `compare_kernels`)
    forward.py    the decode forward of a Llama model in gdtool's own kernels (`kernels="fast"`)
    gemv.py       matrix-vector products with RMSNorm fused in; q/k/v + rotary + cache write (Triton)
    splitkv.py    split-KV decode attention over the live cache slots; two-stage argmax (Triton)
    attention.py  packed grouped-query decode attention for the compiled step
    sampling.py   sort-free top-k/top-p sampling
    fuse.py       q/k/v and gate/up as one weight each
    ops.py        each kernel behind one call: Triton where it runs, the torch reference elsewhere
    triton.py     what the kernels need from Triton, and whether it is there; the PDL switch
    check.py      every kernel against float64 on fresh random inputs

Above the core (it composes `core.step.Step`), below the loops that run it.
"""
