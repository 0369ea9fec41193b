"""The device side: what runs under JAX. `runner` owns the weights, the KV pages and the jitted step
(`sampling` inside it); `parallel` and `multihost` spread it over a mesh and over hosts; `export` lowers
it for other platforms; `evaluate` scores text with it. `compile_cache` and `cpu_dots` set up XLA before
it starts and import no JAX themselves. Imports run downward only: device -> model -> host.
"""
