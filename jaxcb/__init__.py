"""jaxcb: an LLM serving engine on JAX/XLA.

`LLM` and `SamplingParams` are imported lazily so that the host-side modules (request, page pool,
scheduler, buckets) stay importable without JAX.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from jaxcb.llm import LLM

        return LLM
    if name == "SamplingParams":
        from jaxcb.host.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
