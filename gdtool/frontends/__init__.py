"""What a person touches: the four commands, their grammar, and what a notebook shows.

    run.py        python -m gdtool run: decode in one or all modes and compare them
    bench.py      python -m gdtool bench: gdtool's modes against generate() and a gpt-fast-style step
    rollout_bench.py  python -m gdtool bench --workload rollout: gdtool.rollout against HF continuous batching
    profile.py    python -m gdtool profile: per-step host vs device time, in-process or under nsys
    sweep.py      python -m gdtool sweep, and `gdtool.sweep`: EOS-polling x batch-size grids
    options.py    the commands' one grammar: option names, lists, defaults, errors, --json, progress
    plot.py       DataFrame in, (fig, ax) out; widgets.py: the ipywidgets explorer
    notebook.py   a notebook's first cell: parameters, environment, CPU fallback

The top layer: it may import every layer below, never gdtool's face (`import gdtool`): the names the face
re-exports come from the layer modules that define them.
"""
