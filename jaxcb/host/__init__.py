"""The host side of the engine: everything between a request and the jitted step, in plain Python and
numpy. Nothing in this package imports JAX (tests/test_layers.py holds it to that).

The data's way through it: `request` (what a client asked for) -> `scheduler` (who runs this step, over
the `page_pool`, `prefix_cache` and `window` pages, sized by `memory_plan`) -> `batch` (the packed,
ragged step input, its token count bucketed by `buckets`) -> [the device side runs the step] ->
`output` (sampled tokens become text and events) -> back to the client. `engine` is the step loop that
drives them; `engine_thread` and `replicas` run engines on threads and route requests between them.
"""
