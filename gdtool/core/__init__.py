"""The decode core: one decode step and what it is made of, in HF's own kernels.

    modes.py      the decode modes and the kernels options by name (`MODES`, `Mode`, `KERNELS`), torch-free
    settings.py   generate()'s settings, resolved once per decode (`Settings`, `resolve`)
    feed.py       how a model's step is fed: inputs, masks, cache positions; what is refused (`Unsupported`)
    sampling.py   capture-safe token selection: argmax, penalties, warpers, multinomial
    step.py       the decode step: one function over device buffers (`Step`), shared by every loop
    rollout_step.py  a step whose rows are their own sequences, each written at its own cache column (`RowStep`)
    graphs.py     CUDA-graph capture of a step function (`CaptureError`); signature.py: what a graph bakes in
    capture.py    warm-up and capture of a step, one graph per sliding-window phase (`capture_phases`)
    models.py     named model presets (random weights in real shapes) and local checkpoints
    ranges.py     NVTX ranges (domain "gdtool"); syncs.py: the host waits a step makes, counted
    compat.py     the few places where transformers versions differ
    deprecation.py  old names kept for one release, warning with the new one (`renamed`)
    reexports.py  a package's guard against setting a name it only re-exports (`guard`)

The lowest layer: it imports nothing else of gdtool. docs/architecture.md draws the layers.
"""
