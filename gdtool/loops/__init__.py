"""The loops that drive the step: eager, forward-graph, step-graph and device-loop.

    decode.py     `decode()` and its `Engine`: prefill, warm-up, capture, the step loop, EOS polling
    decoder.py    `Decoder`: graphs kept across calls, keyed by their signature
    devloop/      the whole rollout in one launch: a WHILE node that runs on the device; by job,
                  support.py (what it needs, the probe), nvrtc.py (its kernels), nodes.py (the
                  captured graph's nodes and RNG arguments), loop.py (`DeviceLoop`)
    rollout.py    `rollout()`: many prompts through fixed slots, static batches or finished slots refilled

They run the core's step, or the kernels' compiled step, and carry the core's ranges and sync
counters that the measurement layer reads.
"""
